"""vLLM's server flags, honoured by a real gateway: logprob tokens as ids for every request, error responses
logged with their stack, paths left out of the access log, a bound on request heads, a Unix socket, queue limits
and histogram buckets, and the refusals of what the gateway cannot do."""

import asyncio
import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from raypaged.entrypoints.cli import build_parser
from raypaged.entrypoints.server_args import gateway_options
from raypaged.serving.gateway.output_log import OutputLogging
from raypaged.serving.inprocess import InProcessStub
from raypaged.serving.launch import Gateway, GatewayOptions
from tests.serving.conftest import Stack, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)

# the engine of the module's stack: vLLM's queue limits and histogram buckets (sequential requests pass the limits)
ENGINE_FLAGS = {
    "stream_interval": 4,
    "trust_request_chat_template": True,
    "max_num_queued_reqs": 3,
    "max_num_queued_tokens": 16,
    "custom_histogram_buckets": {"time_to_first_token": [0.5, 1.0], "request_tokens": [4, 64]},
}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack(
        [tiny_config(tiny_model_dir, "tiny", **ENGINE_FLAGS)],
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
    alike = tiny_config(tiny_model_dir, "tiny", **ENGINE_FLAGS)
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


def busy(why: str) -> dict:
    message = f"the engine is unavailable: tiny is busy: {why}; send the request again later, or to another replica"
    return {"error": {"message": message, "type": "server_error", "param": None, "code": "engine_unavailable"}}


def test_queue_limits_refuse_a_request_with_503_until_the_engine_catches_up(stack):
    """vLLM's --max-num-queued-reqs 3 and --max-num-queued-tokens 16: a request whose sequences (n) and the unfinished
    ones would be more than 3, or that comes while 16 prompt tokens wait for their prefill, is refused with 503 and
    Retry-After (to be sent again, or elsewhere), counted by its limit in /metrics; once the engine caught up, taken."""
    engine = stack.engine()
    release = threading.Event()
    held = asyncio.run_coroutine_threadsafe(engine.call(release.wait), stack.background.loop)  # no step runs
    try:
        with ThreadPoolExecutor(1) as pool, stack.client() as client, stack.client() as other:
            waiting = pool.submit(completion, other, prompt="Hello there " * 12)  # 1 sequence, 24+ tokens
            for _ in range(400):
                if engine.num_unfinished_seqs():
                    break
                time.sleep(0.025)
            queued = engine.num_queued_tokens()
            assert (engine.num_unfinished_seqs(), queued >= 16) == (1, True)
            by_count = completion(client, n=3, temperature=1.0)
            by_tokens = completion(client, stream=True)
            release.set()
            assert waiting.result(timeout=60).status_code == 200
            taken = completion(client, n=3, temperature=1.0)
            scraped = client.get("/metrics").text
    finally:
        release.set()
        held.result(timeout=60)
    assert (by_count.status_code, by_count.json()) == (
        503,
        busy("its 3 sequence(s) and the 1 unfinished would be more than --max-num-queued-reqs 3"),
    )
    assert (by_tokens.status_code, by_tokens.json()) == (
        503,
        busy(f"{queued} prompt tokens wait for their prefill (--max-num-queued-tokens 16)"),
    )
    assert by_count.headers["retry-after"] == by_tokens.headers["retry-after"] == "1"
    assert taken.status_code == 200 and len(taken.json()["choices"]) == 3
    for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
        assert f'raypaged:admission_rejections_total{{model_name="tiny",reason="{reason}"}} 1.0' in scraped


def test_custom_histogram_buckets_replace_the_bounds_of_their_families(stack):
    """vLLM's --custom-histogram-buckets: a family given (time_to_first_token, request_tokens) has its bounds in each
    of its histograms; the others keep vLLM's."""
    from prometheus_client.parser import text_string_to_metric_families

    with stack.client() as client:
        assert completion(client).status_code == 200
        text = client.get("/metrics").text
    bounds = {
        family.name: [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
        for family in text_string_to_metric_families(text)
        if family.type == "histogram"
    }
    assert bounds["raypaged:time_to_first_token_seconds"] == ["0.5", "1.0", "+Inf"]
    for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens"):
        assert bounds[f"raypaged:{name}"] == ["4.0", "64.0", "+Inf"]
    assert bounds["raypaged:inter_token_latency_seconds"][:3] == ["0.01", "0.025", "0.05"]  # vLLM's


# the chat template of the effort stack: what reasoning_effort and enable_thinking it was rendered with
EFFORT_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if enable_thinking is defined %}{% if enable_thinking %} think {{ reasoning_effort }} at length"
    "{% else %} no thinking ({{ reasoning_effort }}){% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def effort_stack(tiny_model_dir):
    config = tiny_config(tiny_model_dir, "tiny", chat_template=EFFORT_TEMPLATE)
    stack = Stack([config], reasoning_effort_map={"medium": "low"})
    yield stack
    stack.close()


def rendered_prompt(client: httpx.Client, tiny_model_dir, **fields) -> str:
    from transformers import AutoTokenizer

    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}
    answer = client.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return AutoTokenizer.from_pretrained(tiny_model_dir).decode(answer.json()["prompt_token_ids"])


def test_reasoning_effort_map_rewrites_a_requests_effort_for_the_chat_template(effort_stack, tiny_model_dir):
    """vLLM's --reasoning-effort-map '{"medium": "low"}': medium renders as low (thinking), the others as sent."""
    with effort_stack.client() as client:
        got = [rendered_prompt(client, tiny_model_dir, reasoning_effort=e) for e in ("medium", "high", "none")]
    assert got == ["Hi think low at length", "Hi think high at length", "Hi no thinking (none)"]


def test_messages_with_thinking_disabled_render_with_the_flags_effort(effort_stack):
    """vLLM's --anthropic-disabled-thinking-effort: auto is none where the chat template renders none apart from
    every thinking effort (this one), the effort given otherwise (low here: a model that cannot stop thinking)."""
    disabled = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}}

    def counted(client: httpx.Client, body: dict) -> int:
        answer = client.post("/v1/messages/count_tokens", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["input_tokens"]

    def tokens(client: httpx.Client, **variables) -> int:
        body = {"model": "tiny", "messages": disabled["messages"], "chat_template_kwargs": variables}
        return client.post("/tokenize", json=body).json()["count"]

    address = f"127.0.0.1:{effort_stack.grpc_port}"
    low = GatewayOptions(port=0, log_level="warning", anthropic_disabled_thinking_effort="low")
    gateway = Gateway({"tiny": address}, low, {address: InProcessStub(effort_stack.engine_server.servicer)})
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), effort_stack.background.loop)
    try:
        for _ in range(200):
            if gateway.server.started:
                break
            time.sleep(0.05)
        with effort_stack.client() as client, httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}") as lows:
            none_tokens = tokens(client, reasoning_effort="none", enable_thinking=False)
            low_tokens = tokens(client, reasoning_effort="low", enable_thinking=True)
            assert none_tokens != low_tokens
            assert (counted(client, disabled), counted(lows, disabled)) == (none_tokens, low_tokens)
    finally:
        gateway.stop()
        serving.result(timeout=30)


@pytest.mark.parametrize(
    "renders, chosen",
    [
        ({"none": [1], "low": [2], "medium": [3], "high": [4], "xhigh": [5], "max": [6]}, "none"),
        ({"none": [1], "low": [2], "medium": [3], "high": [1], "xhigh": [5], "max": [6]}, "low"),  # none as high
        ({"none": None, "low": [2], "medium": [3], "high": [4], "xhigh": [5], "max": [6]}, "low"),  # none refused
    ],
)
def test_auto_disabled_thinking_is_low_where_the_template_cannot_stop_thinking(renders, chosen):
    from raypaged.serving.gateway.efforts import DisabledThinking

    calls = []

    async def render(effort: str) -> list[int] | None:
        calls.append(effort)
        return renders[effort]

    auto = DisabledThinking()
    assert asyncio.run(auto.effort_for("m", render)) == asyncio.run(auto.effort_for("m", render)) == chosen
    assert len(calls) == len(set(calls))  # probed once per model
