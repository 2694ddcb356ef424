"""vLLM's server flags, honoured by a real gateway: logprob tokens as ids for every request, error responses
logged with their stack, paths left out of the access log, a bound on request heads, a Unix socket, and the
refusals of what the gateway cannot do."""

import asyncio
import json
import logging
import re

import httpx
import pytest

from raypaged.entrypoints.cli import build_parser
from raypaged.entrypoints.server_args import gateway_options
from raypaged.serving.gateway.output_log import OutputLogging
from raypaged.serving.inprocess import InProcessStub
from raypaged.serving.launch import Gateway, GatewayOptions
from tests.serving.conftest import Stack, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(
        [tiny_config(tiny_model_dir, "tiny", stream_interval=4, trust_request_chat_template=True)],
        uvicorn_log_level="info",
        return_tokens_as_token_ids=True,
        log_error_stack=True,
        access_log_skip_paths=("/health", "/metrics"),
        h11_max_incomplete_event_size=1 << 20,
        tokenizer_info_endpoint=True,
        exclude_tools_when_tool_choice_none=True,
        log_requests=True,
        output_logging=OutputLogging(deltas=True, max_len=6),
    )
    yield stack
    stack.close()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def completion(client: httpx.Client, **fields) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2, **fields}
    return client.post("/v1/completions", json=body)


def test_return_tokens_as_token_ids_names_every_requests_logprob_tokens_by_id(stack):
    with stack.client() as client:
        for fields in ({}, {"return_tokens_as_token_ids": False}):
            logprobs = completion(client, **fields).json()["choices"][0]["logprobs"]
            assert len(logprobs["tokens"]) == 3
            assert all(re.fullmatch(r"token_id:\d+", token) for token in logprobs["tokens"])
            assert all(re.fullmatch(r"token_id:\d+", token) for top in logprobs["top_logprobs"] for token in top)


def test_stream_interval_sends_the_first_token_then_every_fourth_and_the_end(stack):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with stack.client() as client:
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [json.loads(line)["choices"][0] for line in lines]
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1, 4, 4, 1]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == "length"


def test_log_outputs_logs_what_each_request_generated_cut_to_max_log_len(stack):
    records = Records()
    raypaged_logger = logging.getLogger("raypaged")
    level = raypaged_logger.level
    raypaged_logger.addHandler(records)
    raypaged_logger.setLevel(logging.INFO)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        with stack.client() as client:
            whole = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                events = [line for line in response.iter_lines() if line.startswith("data: {")]
    finally:
        raypaged_logger.removeHandler(records)
        raypaged_logger.setLevel(level)
    streamed_id = json.loads(events[0][6:])["id"]
    lines = [r.getMessage() for r in records.records if r.getMessage().startswith("Generated response")]
    choice = whole["choices"][0]
    assert lines[0] == (
        f"Generated response {whole['id']}: output: {choice['text'][:6]!r}, output_token_ids: "
        f"{choice['token_ids'][:6]}, finish_reason: length"
    )
    streamed = [line for line in lines[1:] if line.startswith(f"Generated response {streamed_id} ")]
    # this engine's --stream-interval 4: the first token, then 4, then the last 3, and the whole
    assert [line.split(":")[0] for line in streamed] == [f"Generated response {streamed_id} (streaming delta)"] * 3 + [
        f"Generated response {streamed_id} (streaming complete)"
    ]
    assert streamed[-1].endswith(
        f"output: {choice['text'][:6]!r}, output_token_ids: {choice['token_ids'][:6]}, finish_reason: length"
    )


def test_log_error_stack_logs_each_error_response_with_its_exception(stack):
    records = Records()
    logging.getLogger("raypaged").addHandler(records)
    try:
        with stack.client() as client:
            response = completion(client, max_tokens=-1)
    finally:
        logging.getLogger("raypaged").removeHandler(records)
    assert response.status_code == 400
    [record] = [r for r in records.records if r.getMessage().startswith("error response")]
    message = response.json()["error"]["message"]
    assert record.getMessage() == f"error response 400 on /v1/completions: {message}"
    assert record.levelno == logging.ERROR and record.exc_info is not None


def test_disabled_paths_get_no_access_log_line(stack):
    records = Records()
    access = logging.getLogger("uvicorn.access")
    access.addHandler(records)
    try:
        with stack.client() as client:
            assert client.get("/health").status_code == 200
            assert client.get("/metrics?x=1").status_code == 200
            assert client.get("/v1/models").status_code == 200
    finally:
        access.removeHandler(records)
    assert [record.args[2] for record in records.records] == ["/v1/models"]


def test_request_heads_are_bounded_by_the_h11_flag_not_h11s_default(stack):
    # h11 checks the bound on a head still incomplete after a read (uvicorn reads 64 KiB at a time); its
    # default, 16 KiB, refuses the first of these
    with stack.client() as client:
        assert client.get("/v1/models", headers={"X-Pad": "a" * 200_000}).status_code == 200
    with stack.client() as client:  # refused: a 400, sent while the client still writes, may arrive as a reset
        try:
            status = client.get("/v1/models", headers={"X-Pad": "a" * (2 << 20)}).status_code
        except (httpx.ReadError, httpx.WriteError):
            status = 400
        assert status == 400


def test_tokenizer_info_gives_the_tokenizers_settings_without_file_paths(stack, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with stack.client() as client:
        info = client.get("/tokenizer_info").json()
        assert client.get("/tokenizer_info", params={"model": "tiny"}).json() == info
        missing = client.get("/tokenizer_info", params={"model": "other"})
    assert missing.status_code == 404
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["eos_token"], info["bos_token"], info["model_max_length"]) == (
        tokenizer.eos_token,
        tokenizer.bos_token,
        tokenizer.model_max_length,
    )
    assert not {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"} & set(info)
    assert info["chat_template"] == tokenizer.chat_template  # the tokenizer's (the server has none of its own)


def test_without_the_flag_there_is_no_tokenizer_info_route_and_a_custom_fingerprint_is_the_value(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny")], fingerprint_mode="custom", fingerprint_value="blue-7")
    try:
        with stack.client() as client:
            assert client.get("/tokenizer_info").status_code == 404
            assert completion(client).json()["system_fingerprint"] == "blue-7"
    finally:
        stack.close()


def test_the_full_fingerprint_is_the_version_and_the_hash_of_the_engines_settings(stack, tiny_model_dir):
    from raypaged import __version__

    config = stack.engine().config
    with stack.client() as client:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        got = {
            completion(client).json()["system_fingerprint"],
            client.post("/v1/chat/completions", json=chat).json()["system_fingerprint"],
        }
    assert got == {f"raypaged-{__version__}-{config.config_hash()}"}
    alike = tiny_config(tiny_model_dir, "tiny", stream_interval=4, trust_request_chat_template=True)
    assert alike.config_hash() == config.config_hash()
    assert tiny_config(tiny_model_dir, "tiny", stream_interval=4).config_hash() != config.config_hash()


def test_tool_choice_none_renders_the_template_without_the_tools(stack, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = (
        "{% for t in tools or [] %}(tool {{ t.function.name }}){% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

    def rendered(choice: str) -> str:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "chat_template": template,
            "tools": [tool],
            "tool_choice": choice,
            "return_token_ids": True,
        }
        with stack.client() as client:
            answer = client.post("/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        return tokenizer.decode(answer.json()["prompt_token_ids"])

    assert (rendered("none"), rendered("required")) == ("hi", "(tool f)hi")


def test_uds_serves_on_a_unix_socket_and_removes_it_after(stack, tmp_path):
    path = tmp_path / "raypaged.sock"
    address = f"127.0.0.1:{stack.grpc_port}"
    local = {address: InProcessStub(stack.engine_server.servicer)}
    gateway = Gateway({"tiny": address}, GatewayOptions(uds=str(path), log_level="warning"), local)
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), stack.background.loop)
    try:
        for _ in range(200):
            if gateway.server.started:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert path.is_socket()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost") as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
            assert completion(client).status_code == 200
    finally:
        gateway.stop()
        serving.result(timeout=30)
    assert not path.exists()


def options(*argv: str) -> GatewayOptions:
    return gateway_options(build_parser().parse_args(["serve", *argv]))


def test_server_flags_reach_the_gateway_options(tmp_path):
    config = {"version": 1, "disable_existing_loggers": False, "loggers": {"raypaged.probe": {"level": "DEBUG"}}}
    (tmp_path / "logging.json").write_text(json.dumps(config))
    got = options(
        "--shutdown-timeout",
        "5",
        "--uds",
        "/tmp/x.sock",
        "--disable-access-log-for-endpoints",
        "/health,/metrics",
        "--log-config-file",
        str(tmp_path / "logging.json"),
        "--return-tokens-as-token-ids",
        "--log-error-stack",
        "--h11-max-incomplete-event-size",
        "65536",
        "--enable-tokenizer-info-endpoint",
        "--exclude-tools-when-tool-choice-none",
    )
    assert (got.drain_timeout_s, got.uds, got.access_log_skip_paths) == (5.0, "/tmp/x.sock", ("/health", "/metrics"))
    assert (got.log_config, got.return_tokens_as_token_ids, got.log_error_stack) == (config, True, True)
    assert (got.h11_max_incomplete_event_size, got.tokenizer_info_endpoint) == (65536, True)
    assert got.exclude_tools_when_tool_choice_none
    default = options()
    assert not (default.tokenizer_info_endpoint or default.exclude_tools_when_tool_choice_none)
    assert (default.return_tokens_as_token_ids, default.log_error_stack, default.log_config) == (False, False, None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--headless"], "--headless is not supported: the server always runs its HTTP API beside its engines"),
        (["-asc", "4"], "--api-server-count 4 is not supported: one HTTP server process serves every model"),
        (
            ["--middleware", "a.b", "c.d"],
            "--middleware a.b c.d is not supported: raypaged imports no plugin or user code",
        ),
        (["--ssl-ciphers", "ECDHE"], "--ssl-ciphers needs --ssl-certfile (cipher suites are HTTPS's)"),
        (["--h11-max-incomplete-event-size", "0"], "--h11-max-incomplete-event-size must be at least 1 byte, got 0"),
        (["--h11-max-header-count", "0"], "--h11-max-header-count must be at least 1, got 0"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests (the request log it adds to)"),
        (["--fingerprint-mode", "custom"], "--fingerprint-mode custom needs --fingerprint-value"),
        (
            ["--fingerprint-value", "x"],
            "--fingerprint-value is the fingerprint of --fingerprint-mode custom, not of 'full'",
        ),
    ],
)
def test_server_flags_raypaged_cannot_honour_are_refused_by_name(argv, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        options(*argv)


def test_a_log_config_file_must_be_a_dict_config(tmp_path):
    (tmp_path / "bad.json").write_text('{"loggers": {}}')
    with pytest.raises(ValueError) as info:
        options("--log-config-file", str(tmp_path / "bad.json"))
    assert str(info.value) == (
        f'--log-config-file {tmp_path / "bad.json"} must hold a logging.config.dictConfig mapping with "version": 1'
    )


def test_an_idle_stream_gets_keep_alive_comments_and_its_source_is_closed_with_it():
    from raypaged.serving.gateway.sse import KEEP_ALIVE, keep_alive

    closed = []

    async def events():
        try:
            yield "data: 1\n\n"
            await asyncio.sleep(0.35)  # idle: a comment at 0.1, 0.2 and 0.3 s
            yield "data: 2\n\n"
            await asyncio.sleep(10)
            yield "data: never\n\n"
        finally:
            closed.append(True)

    async def read() -> list[str]:
        got: list[str] = []
        stream = keep_alive(events(), 0.1)
        async for event in stream:
            got.append(event)
            if got[-2:-1] == ["data: 2\n\n"]:  # one more after the second event
                break
        await stream.aclose()
        return got

    got = asyncio.run(read())
    middle = got[1:-2]
    assert (got[0], got[-2:]) == ("data: 1\n\n", ["data: 2\n\n", KEEP_ALIVE])
    assert 1 <= len(middle) <= 4 and set(middle) == {KEEP_ALIVE}  # about one per 0.1 s of the 0.35 s wait
    assert closed == [True]


def test_sse_keep_alive_interval_reaches_the_gateway():
    assert options("--sse-keep-alive-interval", "15").sse_keep_alive_s == 15.0
    with pytest.raises(ValueError, match=re.escape("--sse-keep-alive-interval must be at least 0 seconds, got -1")):
        options("--sse-keep-alive-interval", "-1")
