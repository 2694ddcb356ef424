"""Two simulated nodes: SPREAD puts one shard on each, steps go through a Ray Compiled
Graph (shared memory cannot reach the other node), and the tokens do not change."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_spread_places_one_worker_per_node_and_matches(tiny_llama, tiny_reference):
    # a Cluster is its own Ray instance: it runs in a process of its own, beside the session's
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distributed.two_node_cluster", str(tiny_llama)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert len(result["cluster_nodes"]) == 2
    assert sorted(result["worker_nodes"]) == result["cluster_nodes"]
    assert result["tokens"] == tiny_reference
    assert result["step_channel"] == "graph"
    # the forced start places its shards anew: one of its two ranks is on the other node
    assert re.fullmatch(
        re.escape(f"RAYPAGED_STEP_CHANNEL=shm needs every shard on the driver's node ({result['driver_node']}); ")
        + r"ranks \[[01]\] run on other nodes",
        result["forced_shm_error"],
    ), result["forced_shm_error"]
