"""Security defaults: loopback binds, keys on every non-exempt path, body limits, no remote code."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest

import raypaged
from raypaged.config import EngineConfig
from raypaged.entrypoints.cli import build_parser, gateway_options, main
from raypaged.serving.launch import Gateway, GatewayOptions
from tests.serving.conftest import Stack, tiny_config

KEY = "sk-guarded"
MISSING = {"error": {"message": "Missing API key; send it as 'Authorization: Bearer KEY'",
                     "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny")], api_key=KEY, max_body_bytes=1000)
    yield stack
    stack.close()


def extra_gateway(stack: Stack, **options) -> tuple[Gateway, asyncio.Future]:
    """A second gateway in front of the stack's engine server."""
    gateway = Gateway({"tiny": f"127.0.0.1:{stack.grpc_port}"}, GatewayOptions(port=0, log_level="warning", **options))
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), stack.background.loop)
    while not gateway.server.started:
        asyncio.run(asyncio.sleep(0.02))
    return gateway, serving


def test_defaults_bind_loopback_and_protect_all_but_health_and_metrics():
    parser = build_parser()
    for command in (["serve"], ["gateway", "--engine", "a=127.0.0.1:1"]):
        options = gateway_options(parser.parse_args(command))
        assert (options.host, options.auth_exempt_paths, options.drain_timeout_s, options.max_body_bytes) == (
            "127.0.0.1", ("/health", "/metrics"), 30.0, 16 * 1024 * 1024)
    assert parser.parse_args(["serve"]).grpc_host == parser.parse_args(["engine"]).grpc_host == "127.0.0.1"
    assert parser.parse_args(["engine"]).drain_timeout == 30.0
    options = gateway_options(parser.parse_args(["serve", "--auth-exempt-paths", "", "--max-request-body-bytes", "64",
                                                 "--api-key", KEY]))
    assert (options.auth_exempt_paths, options.max_body_bytes) == ((), 64)
    assert KEY not in repr(options)


def test_api_key_from_the_environment_stays_out_of_the_process_list(monkeypatch):
    parser = build_parser()
    monkeypatch.setenv("RAYPAGED_API_KEY", KEY)
    assert gateway_options(parser.parse_args(["serve"])).api_key == KEY
    assert gateway_options(parser.parse_args(["serve", "--api-key", "sk-flag"])).api_key == "sk-flag"  # the flag wins
    monkeypatch.setenv("RAYPAGED_API_KEY", "")
    assert gateway_options(parser.parse_args(["serve"])).api_key is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--auth-exempt-paths", "/health,/v1/completions"],
     "error: --auth-exempt-paths cannot include /v1/completions: generation always needs a key when keys are set"),
    (["--auth-exempt-paths", "health"], "error: --auth-exempt-paths takes paths starting with '/', got 'health'"),
    (["--max-request-body-bytes", "0"], "error: --max-request-body-bytes must be at least 1, got 0"),
    (["--drain-timeout", "-1"], "error: --drain-timeout must be at least 0 seconds, got -1"),
])
def test_bad_security_flags_exit_2_with_a_message(flags, message, capsys):
    assert main(["gateway", "--engine", "a=127.0.0.1:1", *flags]) == 2
    assert capsys.readouterr().err.strip() == message


def test_key_needed_everywhere_but_exempt_paths(stack):
    with stack.client() as anonymous, stack.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/openapi.json"),
                             ("GET", "/v1/no-such-route")]:
            response = anonymous.request(method, path, json={"prompt": "x"})
            assert (response.status_code, response.json()) == (401, MISSING), path
        assert client.get("/v1/models").status_code == 200
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200

    gateway, serving = extra_gateway(stack, api_key=KEY, auth_exempt_paths=())
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as anonymous:
            for path in ("/health", "/metrics"):
                assert (anonymous.get(path).status_code, anonymous.get(path).json()) == (401, MISSING)
            assert anonymous.get("/health", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        stack.background.loop.call_soon_threadsafe(gateway.stop)
        serving.result(timeout=30)


def test_body_limit_holds_without_a_content_length(stack):
    def chunks():
        for _ in range(20):
            yield b"x" * 100

    with stack.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        response = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"] == {"message": "request body exceeds the limit of 1000 bytes",
                                            "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def test_remote_code_is_never_trusted(tmp_path, tiny_model_dir):
    package = Path(raypaged.__file__).parent
    trusting = [str(p) for p in package.rglob("*.py") if re.search(r"trust_remote_code\s*=\s*True", p.read_text())]
    assert trusting == []
    # a model folder asking for its own code: refused, and the code never runs
    model = tmp_path / "remote"
    model.mkdir()
    for item in tiny_model_dir.iterdir():
        (model / item.name).symlink_to(item)
    (model / "config.json").unlink()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    marker = tmp_path / "ran"
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig"}
    (model / "config.json").write_text(json.dumps(config))
    assert EngineConfig(model=str(model)).hf_config.__class__.__name__ == "LlamaConfig"  # the built-in class
    config["model_type"] = "evil"  # no built-in class: only its own code could load it
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        EngineConfig(model=str(model))
    assert not marker.exists()
