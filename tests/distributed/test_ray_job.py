"""The deploy/ray batch example against a cluster started with ``ray start --head``.

``ray job submit`` needs the Ray dashboard (``ray[default]``), which this
environment does not install; the test runs the job's entry script itself as
the job would, with ``--ray-address`` naming the started cluster.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raypaged import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water boils at"]
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env() -> dict[str, str]:
    """No inherited cluster address; no token auth between this cluster and its one job (loopback only)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    return env


@pytest.fixture
def head_address(tmp_path) -> Iterator[str]:
    """A ``ray start --head --block`` cluster of 2 CPUs on free ports, stopped with its process group."""
    port = free_port()
    head = subprocess.Popen(
        [
            str(RAY), "start", "--head", "--block", "--disable-usage-stats", "--include-dashboard=false",
            "--num-cpus=2", "--node-ip-address=127.0.0.1", f"--port={port}", f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
        ],
        env=clean_env(),
        stdout=(tmp_path / "head.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while "Ray runtime started" not in (tmp_path / "head.log").read_text():
            assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()
            time.sleep(0.5)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # the head, its GCS, raylet and workers: this session only
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def test_batch_job_writes_outputs_jsonl(head_address, tiny_llama, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    outputs_file = tmp_path / "out" / "outputs.jsonl"
    job = subprocess.run(
        [
            sys.executable, "deploy/ray/batch_generate.py", "--input", str(prompts_file), "--output",
            str(outputs_file), "--model", str(tiny_llama), "--device", "cpu", "--ray-address", head_address,
            "--tensor-parallel-size", "2", "--max-tokens", str(MAX_TOKENS),
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert f"wrote 4 outputs to {outputs_file}" in job.stdout
    records = [json.loads(line) for line in outputs_file.read_text().splitlines()]
    assert [r["id"] for r in records] == ["p0", "p1", "p2", "p3"]
    assert [r["prompt"] for r in records] == PROMPTS
    reference = LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in reference]
    assert [r["text"] for r in records] == [o.outputs[0].text for o in reference]
    assert [r["finish_reason"] for r in records] == [o.outputs[0].finish_reason for o in reference]
