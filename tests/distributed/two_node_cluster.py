"""Run by test_multinode.py in its own process: a 2-node ``ray.cluster_utils.Cluster``
(1 CPU per node), tp=2 with SPREAD; prints the nodes, the step channel, the greedy tokens
and the error of a shared-memory channel forced across nodes as JSON."""

from __future__ import annotations

import json
import os
import sys

import ray
from ray.cluster_utils import Cluster

from raypaged import LLM
from tests.distributed.conftest import TINY_PARAMS, TINY_PROMPTS, greedy_tokens


def main(model: str) -> None:
    os.environ["RAYPAGED_CPU_THREADS_PER_SHARD"] = "1"  # both simulated nodes share this machine's cores
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:

        def start() -> LLM:
            return LLM(
                model=model,
                device="cpu",
                tensor_parallel_size=2,
                placement_strategy="SPREAD",
                ray_address=cluster.address,
                num_gpu_blocks_override=128,
            )

        llm = start()
        result = {
            "cluster_nodes": sorted(node["NodeID"] for node in ray.nodes() if node["Alive"]),
            "worker_nodes": llm.llm_engine.executor.node_ids,
            "driver_node": ray.get_runtime_context().get_node_id(),
            "step_channel": llm.llm_engine.executor.step_channel,
            "tokens": greedy_tokens(llm, TINY_PROMPTS, TINY_PARAMS),
        }
        llm.shutdown()
        os.environ["RAYPAGED_STEP_CHANNEL"] = "shm"
        try:
            start()
        except ValueError as err:
            result["forced_shm_error"] = str(err)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
