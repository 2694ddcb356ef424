"""Runs the single worker in the driver's own process."""

from __future__ import annotations

import gc
import time

import torch

from raypaged.config import EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.executor.base import Executor
from raypaged.executor.step_times import StepTimes
from raypaged.worker.worker import Worker


class UniProcExecutor(Executor):
    """The single worker in the driver's own process (tensor parallelism 1 without Ray)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.worker = Worker(config, eos_token_id)
        self.step_times = StepTimes()
        self.num_blocks: tuple[int, int] | None = None  # (device, CPU) once the cache exists

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks, num_cpu_blocks)
        self.num_blocks = (num_blocks, num_cpu_blocks)

    def sleep(self) -> None:
        """The worker goes, and with it the model and the caches (CUDA's cached blocks are given back too)."""
        del self.worker
        gc.collect()
        if self.config.resolved_device == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, weights: bool, kv_cache: bool) -> None:
        if weights:
            self.worker = Worker(self.config, self.eos_token_id)
        if kv_cache:
            assert self.num_blocks is not None, "initialize_cache() has not run"
            self.worker.initialize_cache(*self.num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self.worker.execute_model(scheduler_output)
        elapsed = time.perf_counter() - start
        self.step_times.add(elapsed, elapsed)
        return output
