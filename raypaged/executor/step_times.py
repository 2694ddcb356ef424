"""Cumulative step timings an executor keeps: how much of a step the workers' forward takes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTimes:
    """Sums over the steps since the executor started (or since :meth:`reset`), in seconds.

    ``executor_s - worker_s`` is the executor's own share (for Ray shards: sending the
    ``SchedulerOutput`` and returning the result); the engine's whole step minus
    ``worker_s`` is the driver's per-step overhead.
    """

    num_steps: int = 0
    executor_s: float = 0.0  # driver side: inside the executor's execute_model
    worker_s: float = 0.0  # inside the workers' execute_model; with several shards, the slowest one

    def add(self, executor_s: float, worker_s: float) -> None:
        self.num_steps += 1
        self.executor_s += executor_s
        self.worker_s += worker_s

    def reset(self) -> None:
        self.num_steps, self.executor_s, self.worker_s = 0, 0.0, 0.0
