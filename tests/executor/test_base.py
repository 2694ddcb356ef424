"""Every executor is an ``Executor``; every lost-worker error is a ``WorkerLostError``."""

from __future__ import annotations

import pytest

from raypaged.executor.base import Executor, WorkerLostError
from raypaged.executor.ray_executor import RayExecutor, WorkerDiedError, WorkerStalledError
from raypaged.executor.uniproc import UniProcExecutor


def test_executors_share_the_base():
    assert issubclass(UniProcExecutor, Executor) and issubclass(RayExecutor, Executor)
    assert issubclass(WorkerStalledError, WorkerDiedError) and issubclass(WorkerDiedError, WorkerLostError)


def test_the_base_cannot_restart_and_has_nothing_to_release():
    class Idle(Executor):
        def determine_num_blocks(self):
            return 1, 0

        def initialize_cache(self, num_blocks, num_cpu_blocks):
            pass

        def execute_model(self, scheduler_output):
            raise AssertionError("not called")

        def sleep(self):
            raise AssertionError("not called")

        def wake_up(self, weights, kv_cache):
            raise AssertionError("not called")

    idle = Idle()
    idle.shutdown()
    with pytest.raises(NotImplementedError, match="^Idle cannot lose a worker, so it has none to restart$"):
        idle.restart()
    with pytest.raises(TypeError, match="abstract"):
        Executor()
