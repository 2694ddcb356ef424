"""What every executor offers the engine, and the one error that means its workers are gone."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.executor.step_times import StepTimes


class WorkerLostError(RuntimeError):
    """The executor lost a worker (it died, hung or failed in a step): its group's KV cache is gone.

    The engine recovers from it (``Executor.restart`` and every in-flight sequence recomputed) or,
    with recovery off, aborts every request and raises it.
    """


@dataclass(slots=True)
class PendingStep:
    """A step handed to the workers whose output is still to be collected: when it was handed over, and the
    executor's own token for it (a channel's sequence number, a graph's result; None: it runs when collected)."""

    scheduler_output: SchedulerOutput
    started: float
    token: Any = None


class Executor(ABC):
    """Runs the workers: sizes their KV caches, creates them, and runs each step on every shard.

    ``step_times`` sums, per step, the time inside ``execute_model`` and the slowest worker's.
    """

    step_times: StepTimes

    @abstractmethod
    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) every worker can hold."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Create the KV caches (and whatever per-step channel needs them)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every worker; rank 0's output. Raises :class:`WorkerLostError` when a worker is gone."""

    def submit_step(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Hand a step to the workers without waiting for its output, so that more may follow before the first
        is collected (pipeline parallelism: the first stage starts the next micro-batch while the later stages
        finish this one). By default the step runs when it is collected."""
        return PendingStep(scheduler_output, time.perf_counter())

    def collect_step(self, step: PendingStep) -> ModelRunnerOutput:
        """The output of ``step``, the oldest submitted step not collected yet. Raises
        :class:`WorkerLostError` when a worker is gone (the steps after it are lost with it)."""
        return self.execute_model(step.scheduler_output)

    def restart(self) -> None:
        """Replace lost workers with fresh ones and caches of the same size (only executors whose
        workers can be lost need to)."""
        raise NotImplementedError(f"{type(self).__name__} cannot lose a worker, so it has none to restart")

    @abstractmethod
    def sleep(self) -> None:
        """Sleep mode: free every worker's weights and KV cache (the workers go; steps cannot run until
        ``wake_up`` has brought both back)."""

    @abstractmethod
    def wake_up(self, weights: bool, kv_cache: bool) -> None:
        """Bring back what ``sleep`` freed: the ``weights`` (read again from the checkpoint), and then the
        ``kv_cache`` (the same number of blocks, empty)."""

    def shutdown(self) -> None:  # noqa: B027  (not abstract: nothing to release by default)
        """Release the workers; the executor is unusable after. Nothing to release by default."""
