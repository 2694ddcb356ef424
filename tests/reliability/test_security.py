"""Security defaults: loopback binds, keys on every non-exempt path, body limits, no remote code."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from pathlib import Path

import httpx
import pytest

import raypaged
from raypaged.config import EngineConfig
from raypaged.entrypoints.cli import build_parser, main
from raypaged.entrypoints.server_args import gateway_options
from raypaged.serving.gateway.guard import host_check_needed
from raypaged.serving.launch import Gateway, GatewayOptions
from tests.serving.conftest import Stack, tiny_config

KEY = "sk-guarded"
MISSING = {
    "error": {
        "message": "Missing API key; send it as 'Authorization: Bearer KEY'",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


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
            "127.0.0.1",
            ("/health", "/metrics"),
            30.0,
            16 * 1024 * 1024,
        )
    assert parser.parse_args(["serve"]).grpc_host == parser.parse_args(["engine"]).grpc_host == "127.0.0.1"
    assert parser.parse_args(["engine"]).drain_timeout == 30.0
    options = gateway_options(
        parser.parse_args(["serve", "--auth-exempt-paths", "", "--max-request-body-bytes", "64", "--api-key", KEY])
    )
    assert (options.auth_exempt_paths, options.max_body_bytes) == ((), 64)
    assert KEY not in repr(options)


def test_api_key_from_the_environment_stays_out_of_the_process_list(monkeypatch):
    parser = build_parser()
    monkeypatch.setenv("RAYPAGED_API_KEY", KEY)
    assert gateway_options(parser.parse_args(["serve"])).api_keys == (KEY,)
    # the flag wins
    assert gateway_options(parser.parse_args(["serve", "--api-key", "sk-flag"])).api_keys == ("sk-flag",)
    monkeypatch.setenv("RAYPAGED_API_KEY", "")
    assert gateway_options(parser.parse_args(["serve"])).api_keys == ()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--auth-exempt-paths", "/health,/v1/completions"],
            "error: --auth-exempt-paths cannot include /v1/completions: generation always needs a key when keys are "
            "set",
        ),
        (["--auth-exempt-paths", "health"], "error: --auth-exempt-paths takes paths starting with '/', got 'health'"),
        (["--max-request-body-bytes", "0"], "error: --max-request-body-bytes must be at least 1, got 0"),
        (["--drain-timeout", "-1"], "error: --drain-timeout must be at least 0 seconds, got -1"),
    ],
)
def test_bad_security_flags_exit_2_with_a_message(flags, message, capsys):
    assert main(["gateway", "--engine", "a=127.0.0.1:1", *flags]) == 2
    assert capsys.readouterr().err.strip() == message


def test_key_needed_everywhere_but_exempt_paths(stack):
    with stack.client() as anonymous, stack.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/metrics").status_code == 200
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/openapi.json"),
            ("GET", "/v1/no-such-route"),
        ]:
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
        assert response.json()["error"] == {
            "message": "request body exceeds the limit of 1000 bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }


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


def error(message: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def test_new_browser_flags_parse():
    parser = build_parser()
    options = gateway_options(parser.parse_args(["serve"]))
    assert (options.allowed_hosts, options.allowed_origins, options.max_prompts_per_request) == (None, (), 1024)
    options = gateway_options(
        parser.parse_args(
            [
                "gateway",
                "--engine",
                "a=127.0.0.1:1",
                "--allowed-hosts",
                "llm.example, Other.example:8000",
                "--allowed-origins",
                '["https://a.example", "https://b.example"]',
                "--allowed-methods",
                "GET,POST",
                "--allowed-headers",
                '["Authorization"]',
                "--allow-credentials",
                "--max-prompts-per-request",
                "8",
            ]
        )
    )
    assert (
        options.allowed_hosts,
        options.allowed_origins,
        options.allowed_methods,
        options.allowed_headers,
        options.allow_credentials,
        options.max_prompts_per_request,
    ) == (
        ("llm.example", "Other.example:8000"),
        ("https://a.example", "https://b.example"),
        ("GET", "POST"),
        ("Authorization",),
        True,
        8,
    )
    options = gateway_options(
        parser.parse_args(["serve", "--allowed-origins", "https://a.example,https://b.example", "--allowed-hosts", "*"])
    )
    assert (options.allowed_origins, options.allowed_methods, options.allowed_hosts) == (
        ("https://a.example", "https://b.example"),
        ("*",),
        ("*",),
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--allowed-origins", '["https://a.example", 3]'],
            "error: --allowed-origins takes a JSON list of strings or a comma-separated list, "
            """got '["https://a.example", 3]'""",
        ),
        (
            ["--allowed-methods", "GET"],
            "error: --allowed-methods needs --allowed-origins (without it the server sends no CORS headers)",
        ),
        (
            ["--allow-credentials"],
            "error: --allow-credentials needs --allowed-origins (without it the server sends no CORS headers)",
        ),
        (["--max-prompts-per-request", "0"], "error: --max-prompts-per-request must be at least 1, got 0"),
    ],
)
def test_bad_browser_flags_exit_2_with_a_message(flags, message, capsys):
    assert main(["gateway", "--engine", "a=127.0.0.1:1", *flags]) == 2
    assert capsys.readouterr().err.strip() == message


def test_host_check_runs_on_loopback_binds_and_where_hosts_are_listed():
    assert [host_check_needed(h, None) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]")] == [True] * 5
    assert [host_check_needed(h, None) for h in ("0.0.0.0", "::", "", "10.0.0.5", "llm.example")] == [False] * 5
    assert host_check_needed("0.0.0.0", ("llm.example",)) and host_check_needed("0.0.0.0", ())
    assert not host_check_needed("127.0.0.1", ("*",))


def test_post_bodies_must_be_json(stack):
    with stack.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        for content_type in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=b",
            "application/jsonx",
            "json",
        ):
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/no-such-route"):
                response = client.post(path, content=body, headers={"Content-Type": content_type})
                assert (response.status_code, response.json()) == (
                    415,
                    error(
                        f"Content-Type {content_type!r} is not supported: send the body as JSON with "
                        f"'Content-Type: application/json'",
                        "unsupported_media_type",
                    ),
                ), (path, content_type)
        for content_type in ("application/json", "Application/JSON; charset=utf-8", "application/merge-patch+json"):
            response = client.post("/v1/completions", content=body, headers={"Content-Type": content_type})
            assert response.status_code == 200, (content_type, response.text)
        response = client.post("/v1/completions", content=body)  # httpx sends no Content-Type for raw bytes
        assert "content-type" not in response.request.headers
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1


def foreign_host(host: str) -> dict:
    return error(
        f"Host {host!r} is not allowed: only loopback names (localhost, 127.0.0.1, [::1]) and the hosts "
        f"given to --allowed-hosts may address this server (it guards against DNS rebinding)",
        "host_not_allowed",
    )


def raw_http(port: int, request: bytes) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_loopback_bind_refuses_foreign_host_headers(stack):
    port = stack.gateway.port
    with stack.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "[2001:db8::1]:80", "10.0.0.1"):
            for method, path in [
                ("GET", "/health"),
                ("GET", "/metrics"),
                ("GET", "/v1/models"),
                ("POST", "/v1/completions"),
                ("OPTIONS", "/v1/completions"),
            ]:
                response = client.request(method, path, headers={"Host": host}, json={"prompt": "x", "max_tokens": 1})
                assert (response.status_code, response.json()) == (400, foreign_host(host)), (host, path)
        for host in (
            "localhost",
            f"LOCALHOST:{port}",
            "127.0.0.1",
            f"127.0.0.2:{port}",
            "[::1]",
            f"[::1]:{port}",
            "localhost.",
        ):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200, host
    assert raw_http(port, b"GET /health HTTP/1.0\r\n\r\n") == (
        400,
        error("the request has no Host header; send the host it was addressed to", "host_not_allowed"),
    )

    gateway, serving = extra_gateway(stack, api_key=KEY, allowed_hosts=("llm.example",))
    try:
        with httpx.Client(
            base_url=f"http://127.0.0.1:{gateway.port}", timeout=30, headers={"Authorization": f"Bearer {KEY}"}
        ) as client:
            assert client.get("/health", headers={"Host": f"llm.example:{gateway.port}"}).status_code == 200
            response = client.post(
                "/v1/completions", headers={"Host": "LLM.example"}, json={"prompt": "x", "max_tokens": 1}
            )
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1
            assert client.get("/health", headers={"Host": "localhost"}).status_code == 200
            response = client.get("/health", headers={"Host": "evil.example"})
            assert (response.status_code, response.json()) == (400, foreign_host("evil.example"))
    finally:
        stack.background.loop.call_soon_threadsafe(gateway.stop)
        serving.result(timeout=30)


PREFLIGHT = {
    "Origin": "https://a.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_cors_only_for_allowed_origins(stack):
    with stack.client() as client:
        response = client.options("/v1/completions", headers=PREFLIGHT)
        assert response.status_code == 401 and "access-control-allow-origin" not in response.headers
        response = client.get("/health", headers={"Origin": "https://a.example"})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers

    gateway, serving = extra_gateway(stack, api_key=KEY, allowed_origins=("https://a.example",))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as client:
            response = client.options("/v1/completions", headers=PREFLIGHT)
            assert response.status_code == 200
            assert response.headers["access-control-allow-origin"] == "https://a.example"
            assert "POST" in response.headers["access-control-allow-methods"]
            response = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
            assert response.status_code == 400 and "access-control-allow-origin" not in response.headers
            response = client.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"Origin": "https://a.example", "Authorization": f"Bearer {KEY}"},
            )
            assert (
                response.status_code == 200 and response.headers["access-control-allow-origin"] == "https://a.example"
            )
            refused = client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "https://a.example"})
            assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "https://a.example"
    finally:
        stack.background.loop.call_soon_threadsafe(gateway.stop)
        serving.result(timeout=30)


CROSS_SITE = (
    "cross-site request refused (Origin {!r}): list the origin in --allowed-origins to serve browser pages from it"
)


def test_cross_site_posts_are_refused_unless_the_origin_is_allowed(stack):
    body = {"prompt": "x", "max_tokens": 1}
    auth = {"Authorization": f"Bearer {KEY}"}
    with stack.client() as client:
        for headers, origin in (
            ({"Origin": "https://evil.example"}, "https://evil.example"),
            ({"Origin": "null"}, "null"),
            ({"Origin": "http://localhost:3000"}, "http://localhost:3000"),  # same site, another port
            ({"Sec-Fetch-Site": "cross-site"}, None),  # no-cors fetch without Origin or Content-Type
        ):
            response = client.post("/v1/completions", json=body, headers={**auth, **headers})
            assert response.status_code == 403, response.text
            assert response.json()["error"] == {
                "message": CROSS_SITE.format(origin),
                "type": "invalid_request_error",
                "param": None,
                "code": "cross_site_request",
            }
        same = f"http://127.0.0.1:{stack.url.rsplit(':', 1)[1]}"
        for headers in ({"Origin": same, "Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}, {}):
            assert client.post("/v1/completions", json=body, headers={**auth, **headers}).status_code == 200

    gateway, serving = extra_gateway(stack, api_key=KEY, allowed_origins=("https://a.example",))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=30) as client:
            allowed = {**auth, "Origin": "https://a.example", "Sec-Fetch-Site": "cross-site"}
            assert client.post("/v1/completions", json=body, headers=allowed).status_code == 200
            other = {**auth, "Origin": "https://b.example"}
            assert client.post("/v1/completions", json=body, headers=other).status_code == 403
    finally:
        stack.background.loop.call_soon_threadsafe(gateway.stop)
        serving.result(timeout=30)
