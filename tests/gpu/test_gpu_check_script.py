"""benchmarks/gpu_check.py, the script a lent GPU's minutes go to, run end to end without one (``--host``: the
kernels built for the CPU, small shapes, W1 on a tiny model): every part runs and reports, and the JSON holds
each part's numbers. Its numbers mean nothing; a script error found here costs no device time. It runs as on the
GPU machine, whose image has torch, transformers, peft, grpcio, pytest and cupy but none of ``ABSENT`` (nothing
can be installed there): the script and tests/gpu must not need them."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raypaged.kernels import host
from tests.gpu import ON_HOST

pytestmark = pytest.mark.skipif(not ON_HOST or host.compiler() is None, reason="the host check of the script")

ROOT = Path(__file__).resolve().parents[2]
# the serving, structured-output and format packages the GPU machine's image lacks (../.library: device KINDS.md)
ABSENT = ("ray", "fastapi", "uvicorn", "starlette", "pydantic", "xgrammar", "llguidance", "gguf", "compressed_tensors")
# run a script or pytest with those packages unimportable
AS_ON_THE_DEVICE = f"""
import runpy, sys
for name in {ABSENT!r}:
    sys.modules[name] = None
sys.argv = sys.argv[1:]
if sys.argv[0] == "pytest":
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""
PARTS = ("copy_bandwidth", "decode", "prefill", "varlen_prefill", "lora", "fused", "w4a16")


def test_every_part_of_gpu_check_runs_on_the_host(tmp_path):
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, "-c", AS_ON_THE_DEVICE, str(ROOT / "benchmarks/gpu_check.py"), "--host", "--skip-tests"]
    command += ["--concurrency", "2,3"]
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    # from another folder, as the GPU machine runs it: raypaged is found through the script's own checkout
    run = subprocess.run(
        [*command, "--json", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results) == {*PARTS, "end_to_end"}
    for name, value in results.items():
        assert not (isinstance(value, dict) and "error" in value), (name, value)
    assert set(results["decode"]["kernels"]) == {"v1 (default)", "v2 (512-token partitions)"}
    assert all("error" not in row for row in results["decode"]["tuning"].values())
    assert all("error" not in row for row in results["fused"]["kernels"].values())
    assert all("error" not in row for row in results["w4a16"]["layers"].values())
    assert max(results["varlen_prefill"]["single_span"]["rel_error"].values()) < 1e-2
    e2e = results["end_to_end"]
    for system in ("raypaged", "raypaged_eager", "raypaged_no_async", "raypaged_switches_off", "transformers"):
        assert "error" not in e2e[system], e2e[system]
    assert set(e2e["raypaged"]["levels"]) == {"2", "3"}
    assert all(level["generated_tokens"] == 4 * c * 100 for c, level in zip((2, 3), e2e["raypaged"]["levels"].values()))
    assert "| 3 |" in run.stdout and "the switches on / off (the default): 3: " in run.stdout  # the W1 tables


def test_the_gpu_tests_are_collected_without_the_packages_the_device_lacks():
    command = [sys.executable, "-c", AS_ON_THE_DEVICE, "pytest", "-q", "--co", "--soak", "-m", "gpu", "tests/gpu"]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the plugins of packages it lacks, too
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    collected = re.search(r"(\d+)/\d+ tests collected", run.stdout)
    assert collected and int(collected[1]) >= 700, run.stdout[-500:]
