"""Runs one worker per tensor-parallel shard as Ray actors in one placement group.

Setup calls (load, profile, cache) are plain actor calls. Every step then goes to all
shards and rank 0's ``ModelRunnerOutput`` comes back through one of two channels
(``$RAYPAGED_STEP_CHANNEL``): when every shard runs on the driver's node, shared memory
and doorbells (``executor/shm_channel.py``, each shard in a long-running loop call);
otherwise one Ray Compiled Graph. A shard whose actor dies surfaces as
:class:`WorkerDiedError`, one that returns no step within ``$RAYPAGED_STEP_TIMEOUT_S``
as :class:`WorkerStalledError` (a ``WorkerDiedError``: the group is lost either way),
one whose step raises as a ``WorkerDiedError`` naming the exception (its peers may be
left inside a collective, so the group cannot take another step); ``restart()``
replaces the whole shard group with an empty KV cache of the same size.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from collections.abc import Iterator

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.dag.compiled_dag_node import CompiledDAG
from ray.exceptions import GetTimeoutError, RayActorError, RayChannelError, RayChannelTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypaged import envs
from raypaged.config import EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.executor import shm_channel
from raypaged.executor.base import Executor, PendingStep, WorkerLostError
from raypaged.executor.step_times import StepTimes
from raypaged.executor.worker_actor import CONCURRENCY_GROUPS, WorkerActor
from raypaged.model.parallel import PipelineStage, TensorParallel
from raypaged.model.portable_config import portable_config
from raypaged.worker.model_runner import fail_alone

logger = logging.getLogger("raypaged")

_PLACEMENT_TIMEOUT_S = 120.0
_PROBE_TIMEOUT_S = 5.0  # a dead actor answers a probe with an error at once, a live one within ms


class WorkerDiedError(WorkerLostError):
    """A shard's Ray actor died (node loss, OOM kill, ``ray.kill``), or its step failed: the shard
    group is lost."""

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
        num_cpus = max(os.cpu_count() or 1, config.tensor_parallel_size * config.pipeline_parallel_size)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


class RayExecutor(Executor):
    """The shard group of one engine: ``tensor_parallel_size`` actors, rank 0 samples. With pipeline parallelism,
    ``pipeline_parallel_size`` such groups, one per stage (global rank ``stage * tp + r``); rank 0 of the last
    stage samples."""

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
        # the rank that samples and reports the step: rank 0 of the last pipeline stage
        self._sampling_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self._wanted_channel = envs.step_channel()  # read (and checked) once, before Ray starts
        self.step_channel = self._wanted_channel  # "shm" or "graph" once the shards are placed
        self._step_graph: CompiledDAG | None = None  # compiled once the cache exists
        self._channel: shm_channel.ShmStepChannel | None = None  # or this, on one node
        self._loops: list[ray.ObjectRef] = []  # each shard's serve_steps call while the channel is up
        connect_ray(config)
        self._start_workers()

    # ---- lifecycle -------------------------------------------------------------
    def _start_workers(self) -> None:
        config = self.config
        tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
        size = tp_size * pp_size
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
        bundles = ranks_by_node([bundle_nodes[b] for b in range(size)])  # rank -> its bundle
        # the channel is chosen from where the shards will run, before any of them starts: a forced
        # shared-memory channel across nodes fails without loading the weights
        self.step_channel = self._choose_step_channel(self._wanted_channel, [bundle_nodes[b] for b in bundles])
        actor_class = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(WorkerActor)
        # the driver's $RAYPAGED_* switches are the shards' too, on whichever node they run and whenever Ray started
        # (set by the actor itself: a runtime_env of env_vars would keep it off Ray's started workers, 0.45 s more)
        switches = {name: value for name, value in os.environ.items() if name.startswith("RAYPAGED_")}
        self.workers = [
            actor_class.options(
                num_cpus=0 if on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=bundle
                ),
            ).remote(
                None if on_gpu else list(bundle_nodes.values()).count(bundle_nodes[bundle]),
                self.cpu_threads_override,
                switches,
            )
            for bundle in bundles
        ]
        init_method = ray.get(self.workers[0].rendezvous_address.remote())
        shard_config = copy.copy(config)  # the models' configs on transformers' base class (portable_config)
        shard_config.hf_config = portable_config(config.hf_config)
        if config.draft_hf_config is not None:
            shard_config.draft_hf_config = portable_config(config.draft_hf_config)
        self._call_all(
            [
                worker.start.remote(
                    shard_config,
                    self.eos_token_id,
                    TensorParallel(rank % tp_size, tp_size, pp=PipelineStage(rank // tp_size, pp_size, tp_size)),
                    init_method,
                )
                for rank, worker in enumerate(self.workers)
            ]
        )
        self.node_ids = self._call_all([worker.node_id.remote() for worker in self.workers])
        logger.info(
            "started %d shard actors (%s%s, %s, steps through %s)",
            size,
            f"{pp_size} pipeline stages of {tp_size}, " if pp_size > 1 else "",
            config.placement_strategy,
            "GPU" if on_gpu else "CPU",
            "shared memory" if self.step_channel == "shm" else "a Ray Compiled Graph",
        )

    def _choose_step_channel(self, wanted: str, node_ids: list[str]) -> str:
        """``node_ids``: the Ray node of each shard, by rank."""
        driver_node = ray.get_runtime_context().get_node_id()
        elsewhere = [rank for rank, node in enumerate(node_ids) if node != driver_node]
        available = shm_channel.available()
        if wanted == "graph" or (wanted == "auto" and (elsewhere or not available)):
            return "graph"
        if elsewhere:
            self.shutdown()
            raise ValueError(
                f"RAYPAGED_STEP_CHANNEL=shm needs every shard on the driver's node ({driver_node}); "
                f"ranks {elsewhere} run on other nodes"
            )
        if not available:
            self.shutdown()
            raise ValueError(f"RAYPAGED_STEP_CHANNEL=shm needs Linux and a writable {shm_channel.SHM_DIR}")
        return "shm"

    def restart(self) -> None:
        """Replace the whole shard group (survivors are stuck in collectives with the lost one)."""
        self.shutdown()
        self._start_workers()
        if self.num_blocks is not None:
            self.initialize_cache(*self.num_blocks)

    def sleep(self) -> None:
        """The shard actors and their placement group go (their weights and caches with them)."""
        self.shutdown()

    def wake_up(self, weights: bool, kv_cache: bool) -> None:
        """Weights: new shard actors load them; the KV cache: the shards make theirs, and the step channel opens."""
        if weights:
            self._start_workers()
        if kv_cache:
            assert self.num_blocks is not None, "initialize_cache() has not run"
            self.initialize_cache(*self.num_blocks)

    def shutdown(self) -> None:
        """Kill every shard actor and free the placement group; idempotent."""
        self._teardown_step_channel()
        self._kill_workers()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    def _kill_workers(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []

    def _teardown_step_channel(self) -> None:
        """Close whichever step channel is up: stop the shards' shared-memory loops, or tear the graph down."""
        if self._channel is not None:
            channel, self._channel, loops, self._loops = self._channel, None, self._loops, []
            try:
                channel.send(None, timeout=1.0)  # ends the loops of live shards; the rest are killed next
            except (shm_channel.PeerGone, shm_channel.ChannelTimeout):
                pass
            ray.wait(loops, num_returns=len(loops), timeout=1.0)
            channel.close()
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
        if self.step_channel == "shm":
            self._open_channel()
            return
        with InputNode() as scheduler_output:
            graph = MultiOutputNode([worker.execute_model.bind(scheduler_output) for worker in self.workers])
        stages = self.config.pipeline_parallel_size  # a micro-batch in flight per stage
        self._step_graph = graph.experimental_compile(
            _submit_timeout=self.step_timeout_s, _max_inflight_executions=stages if stages > 1 else None
        )

    def _open_channel(self) -> None:
        self._channel = shm_channel.ShmStepChannel(len(self.workers), depth=self.config.pipeline_parallel_size)
        self._loops = [
            worker.serve_steps.remote(self._channel.endpoints(rank)) for rank, worker in enumerate(self.workers)
        ]
        try:
            self._channel.wait_attached(_PLACEMENT_TIMEOUT_S, self._check_loops)
        except shm_channel.ChannelTimeout as err:
            raise RuntimeError(f"shard step loops did not start within {_PLACEMENT_TIMEOUT_S:.0f} s") from err

    def _check_loops(self) -> None:
        """Raise :class:`WorkerDiedError` for a shard whose step loop has ended (its actor died)."""
        ended, _ = ray.wait(self._loops, num_returns=1, timeout=0)
        if ended:
            rank = self._loops.index(ended[0])
            try:
                ray.get(ended[0])
            except RayActorError as err:
                raise WorkerDiedError(rank, self.workers[rank]._actor_id.hex(), err) from err
            raise WorkerDiedError(rank, self.workers[rank]._actor_id.hex(), None, "left its step loop")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Rank 0's output of one step on every shard; a shard that died or hung raises
        :class:`WorkerDiedError` / :class:`WorkerStalledError`."""
        return self.collect_step(self.submit_step(scheduler_output))

    def submit_step(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Send the step to every shard; with pipeline parallelism up to ``pipeline_parallel_size`` steps may be
        on their way at once (each stage runs them in order)."""
        step = PendingStep(scheduler_output, time.perf_counter())
        if self._channel is not None:
            with self._shard_failures():
                step.token = self._channel.send(scheduler_output, self.step_timeout_s)
        else:
            assert self._step_graph is not None, "initialize_cache() has not run"
            with self._shard_failures():
                step.token = self._step_graph.execute(scheduler_output)
        return step

    def collect_step(self, step: PendingStep) -> ModelRunnerOutput:
        if self._channel is not None:
            results = self._replies_through_channel(self._channel)
        else:
            with self._shard_failures():
                results = ray.get(step.token, timeout=self.step_timeout_s)
        self.step_times.add(time.perf_counter() - step.started, max(seconds for _, seconds in results))
        output = results[self._sampling_rank][0]
        if self._sampling_rank and (failures := results[0][0].failed):  # the first stage's inputs that failed
            fail_alone(output, failures)
        return output

    @contextlib.contextmanager
    def _shard_failures(self) -> Iterator[None]:
        """A channel or graph error as the shard it names: dead (:class:`WorkerDiedError`) or hung
        (:class:`WorkerStalledError`)."""
        try:
            yield
        except shm_channel.ChannelTimeout as err:
            self._check_loops()  # a shard that died while we waited is a death, not a stall
            raise self._stalled_worker(err) from err
        except shm_channel.PeerGone as err:  # a shard's doorbell closed: its process is going
            ray.wait(self._loops, num_returns=1, timeout=_PROBE_TIMEOUT_S)
            self._check_loops()
            raise self._dead_worker(err) from err
        except (RayChannelTimeoutError, GetTimeoutError) as err:  # before RayChannelError: one is one
            raise self._stalled_worker(err) from err
        except (RayActorError, RayChannelError) as err:  # the graph reports a dead shard either way
            raise self._dead_worker(err) from err

    def _replies_through_channel(self, channel: shm_channel.ShmStepChannel) -> list[tuple[ModelRunnerOutput, float]]:
        with self._shard_failures():
            replies = channel.receive(self.step_timeout_s, self._check_loops)
        for rank, reply in enumerate(replies):
            if reply is not None and reply[0] == "error":
                error = reply[1]
                dead = self._dead_rank(self._probe_all())  # a collective fails when a peer dies: name the peer
                if dead is not None:
                    raise WorkerDiedError(dead, self.workers[dead]._actor_id.hex(), error) from error
                raise WorkerDiedError(
                    rank,
                    self.workers[rank]._actor_id.hex(),
                    error,
                    f"failed in its step: {type(error).__name__}: {error}",
                ) from error
        return [value for _, value in replies]

    def _probe_all(self) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef]]:
        """A ``node_id`` call on every shard, and those answered within the probe timeout."""
        probes = [worker.node_id.remote() for worker in self.workers]
        ready, _ = ray.wait(probes, num_returns=len(probes), timeout=_PROBE_TIMEOUT_S)
        return probes, ready

    @staticmethod
    def _dead_rank(probed: tuple[list[ray.ObjectRef], list[ray.ObjectRef]]) -> int | None:
        """The first rank whose probe answered with an actor error (a dead actor answers at once)."""
        probes, ready = probed
        for rank, probe in enumerate(probes):
            if probe in ready:
                try:
                    ray.get(probe)
                except RayActorError:
                    return rank
        return None

    def _dead_worker(self, cause: Exception) -> WorkerDiedError:
        """Name the shard that died: with the step channel torn down, every actor is probed; a dead one
        answers with an error at once (survivors may stay silent, blocked in a collective with it)."""
        self._teardown_step_channel()
        probes, ready = probed = self._probe_all()
        rank = self._dead_rank(probed)
        if rank is None:
            rank = next((r for r, probe in enumerate(probes) if probe not in ready), 0)
        return WorkerDiedError(rank, self.workers[rank]._actor_id.hex(), cause)

    def _stalled_worker(self, cause: Exception) -> WorkerStalledError:
        """Name the shard that holds the step up: the first one busy outside a collective (the others
        wait for it inside one), else the first that does not answer, else the first dead one, else
        rank 0. The group's actors are then killed (a hung shard would block the graph's teardown)
        and the step channel torn down."""
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
        self._teardown_step_channel()
        return error

    def _call_all(self, refs: list[ray.ObjectRef]) -> list:
        return call_all(refs, self.workers)


def ranks_by_node(bundle_nodes: list[str]) -> list[int]:
    """The bundle each rank runs in (``bundle_nodes[b]``: bundle ``b``'s node): bundles grouped by node, nodes in the
    order their first bundle comes, bundle order within a node. Consecutive ranks share a node where they can, so
    a pipeline stage's tensor-parallel ranks (``stage * tp`` to ``stage * tp + tp - 1``) sit together whenever each
    node holds a multiple of ``tp`` bundles, and its all-reduces stay on the node."""
    first_seen = {node: i for i, node in reversed(list(enumerate(bundle_nodes)))}
    return sorted(range(len(bundle_nodes)), key=lambda b: (first_seen[bundle_nodes[b]], b))


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
