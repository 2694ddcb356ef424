"""Runs the single worker in the driver's own process."""

from __future__ import annotations

import time

from raypaged.config import EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.executor.base import Executor
from raypaged.executor.step_times import StepTimes
from raypaged.worker.worker import Worker


class UniProcExecutor(Executor):
    """The single worker in the driver's own process (tensor parallelism 1 without Ray)."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        self.worker = Worker(config, eos_token_id)
        self.step_times = StepTimes()

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks, num_cpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        output = self.worker.execute_model(scheduler_output)
        elapsed = time.perf_counter() - start
        self.step_times.add(elapsed, elapsed)
        return output
