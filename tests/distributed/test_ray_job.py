"""The deploy/ray examples against a ``ray start --head`` cluster with its dashboard (job server).

The cluster is separate from the session's Ray instance: its own temp dir, its own
free ports, its own process group, stopped with it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.dashboard.modules.job.cli import job_cli_group
from ray.job_submission import JobStatus, JobSubmissionClient

from raypaged import LLM, SamplingParams
from raypaged.entrypoints.cli import build_parser, engine_configs

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
RAY = VENV_BIN / "ray"
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "Water boils at"]
MAX_TOKENS = 12


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_env() -> dict[str, str]:
    """No inherited cluster address; no token auth between this cluster and its jobs (loopback only);
    this venv first on PATH, so the job's ``python`` is the one raypaged is installed in."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


class ClusterStartFailed(Exception):
    pass


def wait_for(ready, what: str, head: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if head.poll() is not None:
            raise ClusterStartFailed(f"ray start exited while waiting for {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() >= deadline:
            raise ClusterStartFailed(f"no {what} within {timeout_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


def dashboard_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/version", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def ray_logs(temp_dir: Path) -> str:
    """The tail of each raylet and GCS log of a cluster: why a node failed to come up."""
    tails = []
    for path in sorted(temp_dir.glob("session_*/logs/*")):
        if path.is_file() and path.name.startswith(("raylet", "gcs_server")) and path.suffix in (".out", ".err"):
            tails.append(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}")
    return "\n".join(tails)


def stop_cluster(head: subprocess.Popen, temp_dir: Path) -> None:
    head.send_signal(signal.SIGTERM)  # `ray start --block` drains and stops its processes (about 3 s)
    try:
        head.wait(timeout=20)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(head.pid, signal.SIGKILL)  # whatever of this cluster is left
    except ProcessLookupError:
        pass
    head.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


def start_cluster() -> tuple[subprocess.Popen, Path, str]:
    """``ray start --head --block`` on fresh free ports in a fresh temp dir; waits for its dashboard.

    Raises ``ClusterStartFailed`` with the head's output and the raylet/GCS logs when the node does
    not come up (a port taken between choosing it and binding it, or a raylet that did not register)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rpjob-", dir="/tmp"))  # short: Ray's socket paths live under it
    log = temp_dir / "head.log"
    dashboard_port = free_port()
    ports = {
        flag: free_port()
        for flag in (
            "port",
            "ray-client-server-port",
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "metrics-export-port",
            "node-manager-port",
            "object-manager-port",
        )
    }
    head = subprocess.Popen(
        [
            str(RAY),
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            "--num-cpus=2",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            *(f"--{flag}={port}" for flag, port in ports.items()),
        ],
        env=cluster_env() | {"RAY_raylet_start_wait_time_s": "90"},  # a loaded 2-core machine registers slowly
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: every process of this cluster, and nothing else
    )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        wait_for(lambda: "Ray runtime started" in log.read_text(), "Ray runtime", head, log, timeout_s=150)
        wait_for(lambda: dashboard_up(url), "dashboard", head, log)
    except ClusterStartFailed as failure:
        failure.args = (f"{failure.args[0]}\n{ray_logs(temp_dir)}",)
        stop_cluster(head, temp_dir)
        raise
    return head, temp_dir, url


@pytest.fixture
def dashboard_url() -> Iterator[str]:
    """A ``ray start --head --block`` cluster of 2 CPUs with its dashboard on a free port; its URL.

    A start that fails is tried once more on new ports (the ports are chosen free, then bound by
    Ray's processes later, so another process can take one in between); both failures are shown."""
    try:
        head, temp_dir, url = start_cluster()
    except ClusterStartFailed as first:
        try:
            head, temp_dir, url = start_cluster()
        except ClusterStartFailed as second:
            pytest.fail(f"ray start failed twice.\nFirst:\n{first}\nSecond:\n{second}")
    try:
        yield url
    finally:
        stop_cluster(head, temp_dir)


def run_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "deploy" / "ray" / script), *args],
        cwd=ROOT,
        env=cluster_env() | env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_ray_job_submit_batch_writes_outputs_jsonl(dashboard_url, tiny_llama, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    outputs_file = tmp_path / "out" / "outputs.jsonl"
    job = run_script(
        "submit_batch.sh",
        str(prompts_file),
        str(outputs_file),
        "--device",
        "cpu",
        "--max-tokens",
        str(MAX_TOKENS),
        RAY_DASHBOARD=dashboard_url,
        TP="2",
        MODEL=str(tiny_llama),
    )
    log = job.stdout + job.stderr
    assert job.returncode == 0, log[-4000:]
    [submission_id] = re.findall(r"Job '(raysubmit_\w+)' succeeded", log)
    assert f"wrote 4 outputs to {outputs_file}" in log
    assert JobSubmissionClient(dashboard_url).get_job_status(submission_id) == JobStatus.SUCCEEDED
    records = [json.loads(line) for line in outputs_file.read_text().splitlines()]
    assert [r["id"] for r in records] == ["p0", "p1", "p2", "p3"]
    assert [r["prompt"] for r in records] == PROMPTS
    reference = LLM(model=str(tiny_llama), device="cpu", num_gpu_blocks_override=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    assert [r["token_ids"] for r in records] == [o.outputs[0].token_ids for o in reference]
    assert [r["text"] for r in records] == [o.outputs[0].text for o in reference]
    assert [r["finish_reason"] for r in records] == [o.outputs[0].finish_reason for o in reference]


def test_submit_server_command_parses(tiny_llama):
    script = ROOT / "deploy" / "ray" / "submit_server.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    printed = run_script(
        "submit_server.sh",
        "--max-num-seqs",
        "8",
        DRY_RUN="1",
        RAY_DASHBOARD="http://10.0.0.5:8265",
        TP="2",
        PORT="8123",
        MODEL=str(tiny_llama),
    )
    assert printed.returncode == 0, printed.stderr
    argv = shlex.split(printed.stdout)
    assert argv[:3] == ["ray", "job", "submit"]
    submit = job_cli_group.commands["submit"].make_context("submit", argv[3:]).params  # Ray's own CLI parser
    assert (submit["address"], submit["no_wait"]) == ("http://10.0.0.5:8265", True)
    entrypoint = list(submit["entrypoint"])
    assert entrypoint[0] == "raypaged"
    args = build_parser().parse_args(entrypoint[1:])
    assert (args.command, args.model, args.host, args.port) == ("serve", [str(tiny_llama)], "0.0.0.0", 8123)
    [config] = engine_configs(args)  # the same validation `raypaged serve` runs before loading
    assert (config.tensor_parallel_size, config.ray_address, config.placement_strategy, config.max_num_seqs) == (
        2,
        "auto",
        "STRICT_PACK",
        8,
    )
