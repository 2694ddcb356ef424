"""Runs one worker per tensor-parallel shard as Ray actors in one placement group.

Setup calls (load, profile, cache) are plain actor calls; every step then goes
through one Ray Compiled Graph that hands the ``SchedulerOutput`` to all shards
and returns rank 0's ``ModelRunnerOutput`` (measured faster per step than plain
``actor.method.remote`` calls; see docs/distributed.md). A shard whose actor
dies surfaces as :class:`WorkerDiedError`, one that returns no step within
``$RAYPAGED_STEP_TIMEOUT_S`` as :class:`WorkerStalledError` (a
``WorkerDiedError``: the group is lost either way); ``restart()`` replaces the
whole shard group with an empty KV cache of the same size.
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.dag.compiled_dag_node import CompiledDAG
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayChannelTimeoutError
from ray.util.placement_group import (PlacementGroup, placement_group, placement_group_table,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypaged import envs
from raypaged.config import EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.executor.step_times import StepTimes
from raypaged.executor.worker_actor import WorkerActor
from raypaged.model.parallel import TensorParallel

logger = logging.getLogger("raypaged")

_PLACEMENT_TIMEOUT_S = 120.0
_PROBE_TIMEOUT_S = 5.0  # a dead actor answers a probe with an error at once, a live one within ms


class WorkerDiedError(RuntimeError):
    """A shard's Ray actor died (node loss, OOM kill, ``ray.kill``): the shard group is lost."""

    def __init__(self, rank: int, actor_id: str, cause: BaseException | None, reason: str | None = None) -> None:
        super().__init__(f"worker rank {rank} (Ray actor {actor_id}) {reason or f'died: {type(cause).__name__}'}")
        self.rank = rank
        self.actor_id = actor_id


class WorkerStalledError(WorkerDiedError):
    """A shard is alive but returned no step within the step timeout: the group is treated as lost."""


def connect_ray(config: EngineConfig) -> None:
    """Join ``config.ray_address``, or start a new local Ray (enough CPUs for the CPU shards) unless
    this process is already connected."""
    if ray.is_initialized():
        return
    if config.ray_address is not None:
        ray.init(address=config.ray_address, log_to_driver=True)
        return
    num_cpus = None
    if config.resolved_device == "cpu":
        num_cpus = max(os.cpu_count() or 1, config.tensor_parallel_size)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


class RayExecutor:
    """The shard group of one engine: ``tensor_parallel_size`` actors, rank 0 samples."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.step_timeout_s = envs.step_timeout_s()
        self.cpu_threads_override = envs.cpu_threads_per_shard()  # None: the node's cores over its shards
        self.workers: list[ray.actor.ActorHandle] = []
        self.placement_group: PlacementGroup | None = None
        self.node_ids: list[str] = []  # the Ray node of each shard, by rank
        self.num_blocks: tuple[int, int] | None = None  # (device, CPU) once the cache exists
        self.step_times = StepTimes()
        self._step_graph: CompiledDAG | None = None  # compiled once the cache exists
        connect_ray(config)
        self._start_workers()

    # ---- lifecycle -------------------------------------------------------------
    def _start_workers(self) -> None:
        config = self.config
        size = config.tensor_parallel_size
        on_gpu = config.resolved_device == "cuda"
        bundle = {"GPU": 1} if on_gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * size, strategy=config.placement_strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"Ray could not place {size} shards of {bundle} with {config.placement_strategy} within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()}"
            ) from None
        bundle_nodes = placement_group_table(self.placement_group)["bundles_to_node_id"]  # bundle index -> node
        actor_class = ray.remote(WorkerActor)
        self.workers = [
            actor_class.options(
                num_cpus=0 if on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            ).remote(
                None if on_gpu else list(bundle_nodes.values()).count(bundle_nodes[rank]), self.cpu_threads_override
            )
            for rank in range(size)
        ]
        init_method = ray.get(self.workers[0].rendezvous_address.remote())
        self._call_all(
            [
                worker.start.remote(config, self.eos_token_id, TensorParallel(rank, size), init_method)
                for rank, worker in enumerate(self.workers)
            ]
        )
        self.node_ids = self._call_all([worker.node_id.remote() for worker in self.workers])
        logger.info("started %d shard actors (%s, %s)", size, config.placement_strategy, "GPU" if on_gpu else "CPU")

    def restart(self) -> None:
        """Replace the whole shard group (survivors are stuck in collectives with the lost one)."""
        self.shutdown()
        self._start_workers()
        if self.num_blocks is not None:
            self.initialize_cache(*self.num_blocks)

    def shutdown(self) -> None:
        """Kill every shard actor and free the placement group; idempotent."""
        self._teardown_step_graph()
        self._kill_workers()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    def _kill_workers(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []

    def _teardown_step_graph(self) -> None:
        if self._step_graph is not None:
            graph, self._step_graph = self._step_graph, None
            try:
                graph.teardown()
            except RayActorError:
                pass  # a dead shard cannot be told to stop; its actor is killed next

    # ---- the executor interface -------------------------------------------------
    def determine_num_blocks(self) -> tuple[int, int]:
        """The minimum over shards of (device blocks, CPU swap blocks)."""
        counts = self._call_all([worker.determine_num_blocks.remote() for worker in self.workers])
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self._call_all([worker.initialize_cache.remote(num_blocks, num_cpu_blocks) for worker in self.workers])
        self.num_blocks = (num_blocks, num_cpu_blocks)
        with InputNode() as scheduler_output:
            graph = MultiOutputNode([worker.execute_model.bind(scheduler_output) for worker in self.workers])
        self._step_graph = graph.experimental_compile(_submit_timeout=self.step_timeout_s)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0's output of one step on every shard; a shard that died or hung raises
        :class:`WorkerDiedError` / :class:`WorkerStalledError`."""
        start = time.perf_counter()
        try:
            results = ray.get(self._step_graph.execute(scheduler_output), timeout=self.step_timeout_s)
        except RayChannelTimeoutError as err:  # before RayChannelError: it is one
            raise self._stalled_worker(err) from err
        except (RayActorError, RayChannelError) as err:  # the graph reports a dead shard either way
            raise self._dead_worker(err) from err
        self.step_times.add(time.perf_counter() - start, max(seconds for _, seconds in results))
        return results[0][0]

    def _dead_worker(self, cause: Exception) -> WorkerDiedError:
        """Name the shard that died: with the graph torn down, every actor is probed; a dead one
        answers with an error at once (survivors may stay silent, blocked in a collective with it)."""
        self._teardown_step_graph()
        probes = [worker.node_id.remote() for worker in self.workers]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=_PROBE_TIMEOUT_S)
        for rank, probe in enumerate(probes):
            if probe in ready:
                try:
                    ray.get(probe)
                except RayActorError:
                    return WorkerDiedError(rank, self.workers[rank]._actor_id.hex(), cause)
        silent = next((rank for rank, probe in enumerate(probes) if probe not in ready), 0)
        return WorkerDiedError(silent, self.workers[silent]._actor_id.hex(), cause)

    def _stalled_worker(self, cause: Exception) -> WorkerStalledError:
        """Name the shard that holds the step up: the first one busy outside a collective (the others
        wait for it inside one), else the first that does not answer, else the first dead one, else
        rank 0. The group's actors are then killed (a hung shard would block the graph's teardown)
        and the graph torn down."""
        probes = [worker.step_activity.remote() for worker in self.workers]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=_PROBE_TIMEOUT_S)
        activity = []
        for probe in probes:
            try:
                activity.append(ray.get(probe) if probe in ready else "silent")
            except RayActorError:
                activity.append("dead")
        rank = next((r for state in ("busy", "silent", "dead") for r, a in enumerate(activity) if a == state), 0)
        states = ", ".join(f"rank {r} {a}" for r, a in enumerate(activity))
        reason = f"stalled: no step result within {self.step_timeout_s:g} s ({states})"
        error = WorkerStalledError(rank, self.workers[rank]._actor_id.hex(), cause, reason)
        self._kill_workers()
        self._teardown_step_graph()
        return error

    def _call_all(self, refs: list[ray.ObjectRef]) -> list:
        return call_all(refs, self.workers)


def call_all(refs: list[ray.ObjectRef], workers: list[ray.actor.ActorHandle]) -> list:
    """Every shard's result, by rank (``refs[rank]`` is a call on ``workers[rank]``); a dead
    shard raises :class:`WorkerDiedError` at once, without waiting for the survivors (they
    may be blocked in a collective with it)."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready[0])
        except RayActorError as err:
            rank = refs.index(ready[0])
            raise WorkerDiedError(rank, workers[rank]._actor_id.hex(), err) from err
    return ray.get(refs)
