"""The engine core freezes its start-up heap out of the garbage collector's scans, thaws it at
shutdown, and is still freed by reference counting alone once dropped."""

from __future__ import annotations

import gc
import weakref

from raypaged.config import EngineConfig
from raypaged.engine.core import EngineCore, EngineCoreRequest
from raypaged.sampling_params import SamplingParams
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)


def test_the_start_up_heap_is_frozen_until_shutdown_and_the_core_goes_with_its_last_reference(tiny_model_dir):
    gc.unfreeze()
    core = EngineCore(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks_override=16, max_model_len=64), 2)
    model = weakref.ref(core.executor.worker.model)
    assert gc.get_freeze_count() > 10_000  # the model, the tokenizer's and torch's objects
    core.add(EngineCoreRequest("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), 3))
    while core.has_unfinished_requests():
        core.step()
    core.shutdown()
    assert gc.get_freeze_count() == 0
    gc.disable()  # nothing but reference counting frees it
    try:
        del core
        assert model() is None
    finally:
        gc.enable()
