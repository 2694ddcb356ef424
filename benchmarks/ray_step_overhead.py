"""Per-step driver overhead of the step channels to Ray shards, with a no-op shard (CPU).

Sends the ``SchedulerOutput`` of a 16-sequence decode step to ``tp`` actors and
waits for every shard's reply (rank 0's ``ModelRunnerOutput``) three ways: plain
``actor.method.remote`` calls collected by ``call_all`` (``RayExecutor``'s setup
path), a Ray Compiled Graph of the same calls (its per-step path across nodes) and
the shared-memory channel (``executor/shm_channel.py``, its per-step path on one
node). Writes ``benchmarks/results/ray_step_overhead.json``.

    python benchmarks/ray_step_overhead.py --tp 2,4 --steps 1000
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from common import load_average, machine_info, write_json
from ray.dag import InputNode, MultiOutputNode

from raypaged.core.outputs import CachedRequestData, ModelRunnerOutput, SampledToken, SchedulerOutput
from raypaged.executor import shm_channel
from raypaged.executor.ray_executor import call_all
from raypaged.executor.worker_actor import CONCURRENCY_GROUPS


class NoOpShard:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.rank:
            return ModelRunnerOutput()
        return ModelRunnerOutput(sampled={rid: SampledToken(7, -0.5, None) for rid in so.num_scheduled_tokens})

    @ray.method(concurrency_group="step")
    def serve_steps(self, endpoints: shm_channel.ShardEndpoints) -> int:
        return shm_channel.serve_steps(endpoints, self.execute_model)


def decode_step(num_seqs: int) -> SchedulerOutput:
    cached = [CachedRequestData(str(i), [7], [], 100) for i in range(num_seqs)]
    return SchedulerOutput(cached_requests=cached, num_scheduled_tokens={str(i): 1 for i in range(num_seqs)})


def time_steps(run_step, so: SchedulerOutput, steps: int) -> list[float]:
    for _ in range(20):  # warm up
        run_step(so)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run_step(so)
        times.append(time.perf_counter() - start)
    return times


def measure(tp: int, steps: int, so: SchedulerOutput) -> dict[str, list[float]]:
    shard = ray.remote(num_cpus=1, concurrency_groups=CONCURRENCY_GROUPS)(NoOpShard)
    actors = [shard.remote(rank) for rank in range(tp)]

    def plain(step: SchedulerOutput) -> ModelRunnerOutput:
        return call_all([a.execute_model.remote(step) for a in actors], actors)[0]

    with InputNode() as step_input:
        dag = MultiOutputNode([a.execute_model.bind(step_input) for a in actors])
    compiled = dag.experimental_compile()

    def graph(step: SchedulerOutput) -> ModelRunnerOutput:
        return ray.get(compiled.execute(step))[0]

    times = {"plain actor calls": time_steps(plain, so, steps), "compiled graph": time_steps(graph, so, steps)}
    compiled.teardown()
    channel = shm_channel.ShmStepChannel(tp)
    loops = [a.serve_steps.remote(channel.endpoints(rank)) for rank, a in enumerate(actors)]
    channel.wait_attached(60.0, lambda: None)

    def shared_memory(step: SchedulerOutput) -> ModelRunnerOutput:
        channel.send(step, 10.0)
        return channel.receive(10.0, lambda: None)[0][1]

    times["shared memory"] = time_steps(shared_memory, so, steps)
    channel.send(None, 10.0)
    ray.get(loops)
    channel.close()
    for actor in actors:
        ray.kill(actor)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", default="2,4", help="comma-separated shard counts")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--num-seqs", type=int, default=16)
    args = parser.parse_args()
    sizes = [int(tp) for tp in args.tp.split(",")]
    ray.init(address="local", num_cpus=max(*sizes, 2), include_dashboard=False)
    so = decode_step(args.num_seqs)
    report = {
        "machine": machine_info(1),
        "load_average_start": load_average(),
        "steps": args.steps,
        "num_seqs": args.num_seqs,
        "results": [],
    }
    for tp in sizes:
        for name, times in measure(tp, args.steps, so).items():
            ms = sorted(t * 1e3 for t in times)
            row = {
                "path": name,
                "tp": tp,
                "mean_ms": statistics.fmean(ms),
                "median_ms": statistics.median(ms),
                "p90_ms": ms[int(0.9 * len(ms))],
            }
            report["results"].append(row)
            print(
                f"{name:18s} tp={tp} mean {row['mean_ms']:.3f} ms  median {row['median_ms']:.3f} ms  "
                f"p90 {row['p90_ms']:.3f} ms",
                flush=True,
            )
    report["load_average_end"] = load_average()
    print(write_json("ray_step_overhead", report))


if __name__ == "__main__":
    main()
