"""Bucket bounds of the Prometheus histograms, by vLLM's family names: vLLM's defaults, and those a server's
``--custom-histogram-buckets`` puts in their place (a family given replaces its bounds in every histogram of it).
Imports nothing heavy: ``EngineConfig`` checks the flag with it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# fmt: off
_DEFAULTS: dict[str, tuple[float, ...]] = {
    # arrival to the last token, queue, prefill, decode and inference seconds of a request
    "request_latency": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0),
    "time_to_first_token": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                            10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    # seconds between a request's steps, and per output token
    "inter_token_latency": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                            20.0, 40.0, 80.0),
    "iteration_tokens": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "request_params_n": (1, 2, 5, 10, 20),
}
# fmt: on
TOKEN_COUNTS = "request_tokens"  # prompt, generation and max_tokens counts: 1-2-5 up to max_model_len by default
FAMILIES = (*_DEFAULTS, TOKEN_COUNTS)
_NOT_EXPORTED = ("request_num_preemptions", "kv_cache_residency")  # vLLM's families of histograms raypaged lacks


def size_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to ``max_value``: 1, 2, 5, 10, 20, 50, ..."""
    bounds: list[int] = []
    magnitude = 1
    while True:
        for step in (1, 2, 5):
            if step * magnitude > max_value:
                return tuple(bounds)
            bounds.append(step * magnitude)
        magnitude *= 10


def buckets(family: str, custom: Mapping[str, list[float]] | None, max_model_len: int) -> tuple[float, ...]:
    """The bounds of ``family``'s histograms: ``custom``'s when it gives them, else vLLM's defaults."""
    if custom and family in custom:
        return tuple(custom[family])
    return size_buckets(max_model_len) if family == TOKEN_COUNTS else _DEFAULTS[family]


def check_custom_buckets(custom: Any) -> None:
    """``ValueError`` naming ``--custom-histogram-buckets`` unless ``custom`` is None or maps families
    (``FAMILIES``) to non-empty, strictly increasing lists of finite bounds above 0."""
    if custom is None:
        return
    flag = "--custom-histogram-buckets"
    if not isinstance(custom, dict):
        raise ValueError(f"{flag} takes a JSON object of bucket bounds by histogram family, got {custom!r}")
    for family, bounds in custom.items():
        if family in _NOT_EXPORTED:
            raise ValueError(f"{flag}: {family} is not supported: raypaged exports none of its histograms")
        if family not in FAMILIES:
            raise ValueError(f"{flag}: unknown histogram family {family!r}; families: {', '.join(FAMILIES)}")
        numbers = isinstance(bounds, list) and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b > 0 for b in bounds
        )
        if not numbers or not bounds:
            raise ValueError(f"{flag}: {family} takes a non-empty list of finite bounds above 0, got {bounds!r}")
        if any(low >= high for low, high in zip(bounds, bounds[1:])):
            raise ValueError(f"{flag}: {family}'s bounds must increase, got {bounds}")
