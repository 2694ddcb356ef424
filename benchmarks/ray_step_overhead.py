"""Per-step driver overhead of the two Ray call paths, with a no-op shard (CPU).

Sends the ``SchedulerOutput`` of a 16-sequence decode step to ``tp`` actors and
waits for rank 0's ``ModelRunnerOutput``: plain ``actor.method.remote`` calls
collected by ``call_all`` (``RayExecutor``'s setup path) against a Ray Compiled
Graph of the same calls (its per-step path).

    python benchmarks/ray_step_overhead.py --tp 2 --steps 500
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from ray.dag import InputNode, MultiOutputNode

from raypaged.core.outputs import CachedRequestData, ModelRunnerOutput, SampledToken, SchedulerOutput
from raypaged.executor.ray_executor import call_all


class NoOpShard:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.rank:
            return ModelRunnerOutput()
        return ModelRunnerOutput(sampled={rid: SampledToken(7, -0.5, None) for rid in so.num_scheduled_tokens})


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--num-seqs", type=int, default=16)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=max(args.tp, 2), include_dashboard=False)
    shard = ray.remote(num_cpus=1)(NoOpShard)
    actors = [shard.remote(rank) for rank in range(args.tp)]
    so = decode_step(args.num_seqs)

    def plain(step: SchedulerOutput) -> ModelRunnerOutput:
        return call_all([a.execute_model.remote(step) for a in actors], actors)[0]

    plain_times = time_steps(plain, so, args.steps)
    with InputNode() as step_input:
        dag = MultiOutputNode([a.execute_model.bind(step_input) for a in actors])
    compiled = dag.experimental_compile()

    def graph(step: SchedulerOutput) -> ModelRunnerOutput:
        return ray.get(compiled.execute(step))[0]

    graph_times = time_steps(graph, so, args.steps)
    compiled.teardown()
    for name, times in (("plain actor calls", plain_times), ("compiled graph", graph_times)):
        ms = sorted(t * 1e3 for t in times)
        print(
            f"{name:18s} tp={args.tp} mean {statistics.fmean(ms):.3f} ms  median {statistics.median(ms):.3f} ms  "
            f"p90 {ms[int(0.9 * len(ms))]:.3f} ms"
        )


if __name__ == "__main__":
    main()
