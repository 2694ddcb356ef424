"""The body of one shard's Ray actor: thread limits, the worker, step timing and a stall probe."""

from __future__ import annotations

import os
import socket
import sys
import time
from types import FrameType

import ray
import torch

from raypaged.config import EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.executor import shm_channel
from raypaged.heap import freeze_startup_heap
from raypaged.model.parallel import TensorParallel
from raypaged.worker.worker import Worker

_COLLECTIVES_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
CONCURRENCY_GROUPS = {"step": 1}  # the shared-memory step loop; probes and setup calls use the default group


def node_cores() -> int:
    """CPU cores this process may run on (its affinity mask, so container CPU sets count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_shard(num_cores: int, shards_on_node: int, override: int | None) -> int:
    """``override``, else the node's cores split evenly over its shards, at least one each."""
    return override or max(1, num_cores // shards_on_node)


class WorkerActor:
    """One shard: a :class:`Worker` once ``start`` has run.

    ``switches`` (the driver's ``$RAYPAGED_*`` variables) go into the actor's environment first. On CPU
    (``shards_on_node`` given) the actor then limits itself to :func:`threads_per_shard` threads:
    ``torch.set_num_threads`` and ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` in its environment (Ray's own
    default is one thread per ``num_cpus=1`` actor whatever the machine).
    """

    def __init__(
        self,
        shards_on_node: int | None = None,
        threads_override: int | None = None,
        switches: dict[str, str] | None = None,
    ) -> None:
        os.environ.update(switches or {})
        if shards_on_node is not None:
            num_threads = threads_per_shard(node_cores(), shards_on_node, threads_override)
            os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(num_threads)
            torch.set_num_threads(num_threads)
        self.worker: Worker | None = None
        self._stall_next_step_s = 0.0
        self._fail_next_step: str | None = None

    def rendezvous_address(self) -> str:
        """A ``tcp://ip:port`` on this node for the shard group's process group (rank 0 is asked)."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def thread_settings(self) -> dict[str, int | str | None]:
        """What this shard computes with: torch's thread count and the OpenMP/MKL environment."""
        return {
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
        }

    def start(self, config: EngineConfig, eos_token_id: int | None, tp: TensorParallel, init_method: str) -> None:
        self.worker = Worker(config, eos_token_id, tp, init_method)

    def _started(self) -> Worker:
        """The worker; every call but the setup probes comes after ``start``."""
        assert self.worker is not None, "start() has not run"
        return self.worker

    def determine_num_blocks(self) -> tuple[int, int]:
        return self._started().determine_num_blocks()

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        worker = self._started()
        worker.initialize_cache(num_blocks, num_cpu_blocks)
        freeze_startup_heap(f"shard {worker.tp.rank}")  # the shard's weights and graphs, out of GC scans

    def execute_model(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:
        """The step's output and the seconds this shard spent on it."""
        start = time.perf_counter()
        if self._stall_next_step_s:
            stall, self._stall_next_step_s = self._stall_next_step_s, 0.0
            time.sleep(stall)
        if self._fail_next_step is not None:
            message, self._fail_next_step = self._fail_next_step, None
            raise RuntimeError(message)
        output = self._started().execute_model(scheduler_output)
        return output, time.perf_counter() - start

    @ray.method(concurrency_group="step")
    def serve_steps(self, endpoints: shm_channel.ShardEndpoints) -> int:
        """Answer steps from the driver's shared-memory channel until it stops the loop (one long
        call in its own concurrency group, so probes are answered meanwhile)."""
        return shm_channel.serve_steps(endpoints, self.execute_model)

    def stall_next_step(self, seconds: float) -> None:
        """Fault injection for tests and drills: the next step sleeps ``seconds`` before its forward
        (answered while steps run: the step loop has its own concurrency group)."""
        self._stall_next_step_s = seconds

    def fail_next_step(self, message: str) -> None:
        """Fault injection for tests and drills: the next step raises ``RuntimeError(message)``
        before its forward (its peers are left waiting in the first all-reduce)."""
        self._fail_next_step = message

    def step_activity(self) -> str:
        """Where this shard's step thread is: ``"idle"`` (no step running), ``"collective"``
        (waiting in a torch.distributed collective, i.e. for another shard) or ``"busy"``."""
        code = WorkerActor.execute_model.__code__
        for top in sys._current_frames().values():
            in_step = in_collective = False
            frame: FrameType | None = top
            while frame is not None:
                in_step = in_step or frame.f_code is code
                in_collective = in_collective or frame.f_code.co_filename.endswith(_COLLECTIVES_FILE)
                frame = frame.f_back
            if in_step:
                return "collective" if in_collective else "busy"
        return "idle"
