"""Hugging Face Hub ids served from a Hub-layout cache built here, with HF_HUB_OFFLINE=1: nothing touches
the network. ``raypaged serve ID``, ``--model ID --revision``, ``--download-dir``, ``LLM(model=ID)``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import make_tiny_model
from tests.reliability.conftest import ServerProcess, free_port

REPO_ID = "tiny-org/tiny-llama"
MAIN, V2 = "a" * 40, "b" * 40  # commits: main has max_position_embeddings 512, the tag v2 has 256
ENGINE_FLAGS = ["--num-gpu-blocks-override", "32"]


def hub_cache(cache: Path, model_dir: Path) -> Path:
    """A Hugging Face cache holding REPO_ID at two commits (refs main and v2), as huggingface_hub lays it out."""
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    for commit, max_positions in ((MAIN, 512), (V2, 256)):
        snapshot = repo / "snapshots" / commit
        shutil.copytree(model_dir, snapshot)
        config = json.loads((snapshot / "config.json").read_text())
        (snapshot / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_positions}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return cache


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, smollm2_dir) -> Path:
    """$HF_HOME, whose hub/ folder is the cache."""
    home = tmp_path_factory.mktemp("hf_home")
    hub_cache(home / "hub", make_tiny_model(tmp_path_factory.mktemp("tiny"), smollm2_dir))
    return home


@pytest.fixture
def offline(monkeypatch, hf_home) -> Path:
    """Child processes see the cache under $HF_HOME, offline; returns the cache folder."""
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home / "hub"


def snapshot(cache: Path, commit: str) -> Path:
    return cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / commit


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raypaged.entrypoints.cli", *args], capture_output=True, text=True, timeout=300
    )


def serve(tmp_path: Path, *args: str) -> tuple[ServerProcess, str]:
    port = free_port()
    server = ServerProcess(
        "serve", [*args, *ENGINE_FLAGS, "--port", str(port), "--grpc-port", "0"], tmp_path / "serve.log"
    )
    url = f"http://127.0.0.1:{port}"
    server.wait_http_ready(url)
    return server, url


def test_serve_a_hub_id_from_the_cache_under_its_own_name(tmp_path, offline):
    server, url = serve(tmp_path, REPO_ID)
    try:
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(REPO_ID, 512)]  # main's snapshot
        body = httpx.post(
            f"{url}/v1/completions",
            timeout=60,
            json={"model": REPO_ID, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "temperature": 0},
        ).json()
        assert (body["model"], body["usage"]["completion_tokens"]) == (REPO_ID, 3)
    finally:
        server.close()
    assert f"model {REPO_ID}: {snapshot(offline, MAIN)}" in server.log()


def test_revision_and_download_dir_pick_that_cache_and_snapshot(tmp_path, offline, hf_home):
    elsewhere = tmp_path / "downloads"
    shutil.copytree(offline, elsewhere)
    shutil.rmtree(snapshot(elsewhere, MAIN))  # only v2 is there
    server, url = serve(
        tmp_path, "--model", REPO_ID, "--revision", "v2", "--download-dir", str(elsewhere), "--tokenizer", REPO_ID
    )
    try:
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(REPO_ID, 256)]
    finally:
        server.close()
    assert f"model {REPO_ID} at revision 'v2': {snapshot(elsewhere, V2)}" in server.log()


def test_llm_takes_a_hub_id_and_a_commit(offline):
    code = (
        "from raypaged import LLM, SamplingParams\n"
        "params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        f"by_id = LLM(model={REPO_ID!r}, revision={V2!r}, num_gpu_blocks_override=32)\n"
        f"by_folder = LLM(model={str(snapshot(offline, V2))!r}, num_gpu_blocks_override=32)\n"
        "print(by_id.llm_engine.config.model_path, by_id.llm_engine.config.max_model_len)\n"
        "print(by_id.generate(['Hello'], params, use_tqdm=False)[0].outputs[0].token_ids ==\n"
        "      by_folder.generate(['Hello'], params, use_tqdm=False)[0].outputs[0].token_ids)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"{snapshot(offline, V2)} 256", "True"]


def test_an_id_missing_from_the_cache_offline_names_the_id_the_cache_and_hf_hub_offline(offline):
    result = run_cli("serve", "tiny-org/not-cached")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: model 'tiny-org/not-cached' is not a local folder and not in the Hugging Face cache {offline} "
        "(HF_HUB_OFFLINE=1: nothing is downloaded); unset HF_HUB_OFFLINE to download it, or give its local folder"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model", REPO_ID, "--revision", "v3"],
            "error: model 'tiny-org/tiny-llama' at revision 'v3' is not a local folder and not in the Hugging Face "
            "cache {cache} (HF_HUB_OFFLINE=1: nothing is downloaded); unset HF_HUB_OFFLINE to download it, or give its "
            "local folder",
        ),
        (
            ["./no/such/folder"],
            "error: model './no/such/folder' is neither a local folder nor a Hugging Face Hub id (org/name)",
        ),
        (
            ["{main}", "--revision", "v2"],
            "error: --revision v2 applies to Hugging Face Hub ids, but model '{main}' is a local folder",
        ),
        (
            ["{main}", "--download-dir", "/tmp"],
            "error: --download-dir /tmp applies to Hugging Face Hub ids, but model '{main}' is a local folder",
        ),
        (
            [REPO_ID, "--tokenizer-revision", "v3"],
            "error: tokenizer 'tiny-org/tiny-llama' at revision 'v3' is not a local folder and not in the Hugging Face "
            "cache {cache} (HF_HUB_OFFLINE=1: nothing is downloaded); unset HF_HUB_OFFLINE to download it, or give its "
            "local folder",
        ),
    ],
)
def test_resolution_errors_name_what_to_change(offline, args, message):
    names = {"cache": offline, "main": snapshot(offline, MAIN), "v2": snapshot(offline, V2)}
    result = run_cli("serve", *[a.format(**names) for a in args])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == message.format(**names)


def test_the_cache_is_the_one_hf_hub_cache_names(tmp_path, offline, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))  # over $HF_HOME/hub
    result = run_cli("serve", REPO_ID)
    assert result.returncode == 2
    assert f"is not a local folder and not in the Hugging Face cache {tmp_path / 'empty'} " in result.stderr
