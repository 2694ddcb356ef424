"""The engine's start-up heap kept out of Python's cyclic garbage collector.

A full (generation-2) collection scans every object alive. An engine holds a few hundred
thousand from start-up on (the model's modules and parameters, the tokenizer, CUDA graphs,
the libraries it imported), so without this one such collection paused a step for ~200 ms
at 256 running sequences on the tiny model, all of them waiting (``benchmarks/gc_pause.py``).
After :func:`freeze_startup_heap` those objects sit in the permanent generation and a full
collection scans only what requests made since (2-3 ms there), as vLLM does after start-up.
Frozen objects are still freed by reference counting (an engine that is dropped goes with
its last reference); :func:`thaw` hands them back to the collector at shutdown.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger("raypaged")


def freeze_startup_heap(what: str) -> None:
    """Freeze every object the collector tracks now (``gc.freeze``); ``what`` names it in the log.

    No collection first (it would cost a full scan per engine started, 0.1-0.3 s): garbage cycles
    alive at this moment stay until :func:`thaw` gives them back at shutdown."""
    gc.freeze()
    logger.debug("%s: %d objects frozen out of the garbage collector's scans", what, gc.get_freeze_count())


def thaw() -> None:
    """Give the frozen objects back to the collector (an engine shutting down: cycles among its
    objects, if any, can then be collected)."""
    gc.unfreeze()
