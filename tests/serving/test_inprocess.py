"""The in-process link (``raypaged serve``) answers exactly as the gRPC link (``raypaged gateway``).

One engine server with API keys; one gateway reaches it in process, a second over gRPC.
Every request, good or bad, streamed or not, gets the same status and body from both
(response ids and timestamps aside).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

import grpc
import pytest
from google.protobuf.message import Message

from raypaged.serving import messages
from raypaged.serving.inprocess import InProcessStub
from raypaged.serving.launch import Gateway, GatewayOptions, listen
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.serving.conftest import Stack, tiny_config

KEY = "sk-link"
AUTH = {"Authorization": f"Bearer {KEY}"}
METADATA = (("authorization", f"Bearer {KEY}"),)
GREEDY = {"model": "tiny", "prompt": "Both links", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CASES = [
    ("/v1/completions", GREEDY, AUTH),
    ("/v1/completions", dict(GREEDY, n=2, logprobs=2, stop=["zz"]), AUTH),
    ("/v1/completions", dict(GREEDY, stream=True, stream_options={"include_usage": True}), AUTH),
    ("/v1/completions", dict(GREEDY, best_of=3, n=1, temperature=1, seed=4), AUTH),
    (
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        AUTH,
    ),
    ("/v1/completions", dict(GREEDY, stop_token_ids=[49152]), AUTH),
    ("/v1/completions", dict(GREEDY, logprobs=50), AUTH),
    ("/v1/completions", dict(GREEDY, model="nope"), AUTH),
    ("/v1/completions", dict(GREEDY, priority=-1), AUTH),
    ("/v1/completions", dict(GREEDY, prompt=[[49152], [5, 6]]), AUTH),
    ("/v1/completions", dict(GREEDY, prompt="x" * 10_000), AUTH),
    ("/v1/completions", GREEDY, {"Authorization": "Bearer wrong"}),
    ("/v1/completions", dict(GREEDY, stream=True, n=2, logprobs=2), AUTH),
    ("/v1/completions", dict(GREEDY, echo=True, prompt_logprobs=2, logprobs=1), AUTH),
    ("/v1/completions", dict(GREEDY, echo=True, prompt_logprobs=1, logprobs=1, stream=True), AUTH),
    ("/v1/completions", dict(GREEDY, echo=True, max_tokens=0, logprobs=1), AUTH),
    ("/v1/completions", dict(GREEDY, echo=True, max_tokens=0, stream=True), AUTH),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        AUTH,
    ),
    ("/tokenize", {"model": "tiny", "prompt": "Hello world"}, AUTH),
    ("/tokenize", {"model": "tiny", "prompt": "z" * 10_000}, AUTH),
    ("/detokenize", {"model": "tiny", "tokens": [19556, 905]}, AUTH),
    ("/detokenize", {"model": "tiny", "tokens": [49152]}, AUTH),
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny")], api_key=KEY)
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def grpc_gateway_url(stack):
    gateway = Gateway(
        {"tiny": f"127.0.0.1:{stack.grpc_port}"}, GatewayOptions(port=0, log_level="warning", api_key=KEY)
    )
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), stack.background.loop)
    while not gateway.server.started:
        asyncio.run(asyncio.sleep(0.02))
    yield f"http://127.0.0.1:{gateway.port}"
    stack.background.loop.call_soon_threadsafe(gateway.stop)
    serving.result(timeout=30)


def comparable(text: str) -> object:
    """A response body without what differs per call (ids, timestamps)."""
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    bodies = [json.loads(e) for e in events if e != "[DONE]"] if events else [json.loads(text)]
    for body in bodies:
        body.pop("id", None)
        body.pop("created", None)
    return bodies


@pytest.mark.parametrize("path, body, headers", CASES, ids=[f"{i}{c[0]}" for i, c in enumerate(CASES)])
def test_both_links_answer_alike(stack, grpc_gateway_url, path, body, headers):
    import httpx

    with stack.client() as local, httpx.Client(base_url=grpc_gateway_url, timeout=120) as remote:
        a = local.post(path, json=body, headers=headers)
        b = remote.post(path, json=body, headers=headers)
    assert a.status_code == b.status_code, (a.text, b.text)
    assert comparable(a.text) == comparable(b.text)


def test_both_links_answer_a_stop_token_alike(stack, grpc_gateway_url):
    """A completion that a stop token ends: vLLM's integer ``stop_reason``, from either link's responses."""
    import httpx

    with stack.client() as local, httpx.Client(base_url=grpc_gateway_url, timeout=120) as remote:
        named = local.post(
            "/v1/completions", json=dict(GREEDY, logprobs=0, return_tokens_as_token_ids=True), headers=AUTH
        ).json()["choices"][0]["logprobs"]["tokens"]
        stop_token = int(named[2].removeprefix("token_id:"))
        answers = []
        for stream in (False, True):
            body = dict(GREEDY, stop_token_ids=[stop_token], stream=stream)
            a = local.post("/v1/completions", json=body, headers=AUTH)
            b = remote.post("/v1/completions", json=body, headers=AUTH)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert comparable(a.text) == comparable(b.text)
            answers.append(comparable(a.text))
    [[whole], chunks] = answers
    last = chunks[-1]["choices"][0]
    ended = (whole["choices"][0]["finish_reason"], whole["choices"][0]["stop_reason"])
    assert ended == (last["finish_reason"], last["stop_reason"]) == ("stop", stop_token)


def test_every_entry_point_checks_its_inputs_in_the_engines_one_input_processor(
    stack, grpc_gateway_url, tiny_model_dir, monkeypatch
):
    """HTTP in process, HTTP over gRPC and ``LLM.generate`` all build the core's request in
    ``InputProcessor.process``: the same token ids and resolved params, and the same text back."""
    import httpx

    from raypaged import LLM, SamplingParams
    from raypaged.engine.input_processor import InputProcessor

    seen = []
    real = InputProcessor.process

    def spy(self, *args, **kwargs):
        params, core_request = real(self, *args, **kwargs)
        seen.append((self, core_request.prompt_token_ids, core_request.max_tokens, core_request.sampling_params))
        return params, core_request

    monkeypatch.setattr(InputProcessor, "process", spy)
    with stack.client() as local, httpx.Client(base_url=grpc_gateway_url, timeout=120) as remote:
        texts = [
            client.post("/v1/completions", json=GREEDY, headers=AUTH).json()["choices"][0]["text"]
            for client in (local, remote)
        ]
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256)
    try:
        [offline] = llm.generate(
            GREEDY["prompt"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
    finally:
        llm.shutdown()
    served = stack.engine_server.models["tiny"].inputs
    assert [s[0] for s in seen] == [served, served, llm.llm_engine.input_processor]
    assert seen[0][1:3] == seen[1][1:3] == seen[2][1:3] == (llm.llm_engine.tokenize(GREEDY["prompt"]), 8)
    assert seen[0][3] == seen[1][3]  # the two HTTP links resolve to equal params
    assert texts == [offline.outputs[0].text] * 2


def test_both_links_are_engine_clients_with_every_rpc_of_the_service(stack):
    import grpc

    from raypaged.serving.client import EngineClient
    from raypaged.serving.inprocess import InProcessStub
    from raypaged.serving.proto import generate_pb2 as pb
    from raypaged.serving.proto import generate_pb2_grpc as pb_grpc

    rpcs = [m.name for m in pb.DESCRIPTOR.services_by_name["TextGenerationService"].methods]
    declared = [name for name in vars(EngineClient) if name[0].isupper()]
    assert declared == rpcs  # the protocol is the service, in the .proto's order
    local = InProcessStub(stack.engine_server.servicer)
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        remote = pb_grpc.TextGenerationServiceStub(channel)
        assert isinstance(local, EngineClient) and isinstance(remote, EngineClient)
    assert all(callable(getattr(local, name)) for name in rpcs)


def test_the_http_socket_is_tcp_so_responses_are_not_delayed():
    """asyncio sets TCP_NODELAY only on sockets whose proto is TCP; without it every response after
    the first on a kept-alive connection waited for a delayed ACK (about 40 ms)."""
    sock = listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_a_model_with_several_served_names_answers_to_each(tiny_model_dir):
    from raypaged.entrypoints.cli import build_parser, engine_configs

    args = build_parser().parse_args(
        [
            "serve",
            str(tiny_model_dir),
            "--served-model-name",
            "first",
            "second",
            "--max-model-len",
            "256",
            "--num-gpu-blocks-override",
            "64",
        ]
    )
    [config] = engine_configs(args)
    assert (config.model, config.served_model_name, config.served_model_aliases) == (
        str(tiny_model_dir),
        "first",
        ("second",),
    )
    stack = Stack([config])
    try:
        with stack.client() as client:
            assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["first", "second"]
            assert client.get("/v1/models/second").json()["max_model_len"] == 256
            texts = [
                client.post("/v1/completions", json=dict(GREEDY, model=name)).json()["choices"][0]["text"]
                for name in ("first", "second")
            ]
            assert texts[0] == texts[1]
    finally:
        stack.close()


def test_a_positional_model_and_served_name_groups_parse_as_vllm_does(tiny_model_dir):
    from raypaged.entrypoints.cli import build_parser, engine_configs

    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            str(tiny_model_dir),
            "--model",
            str(tiny_model_dir),
            "--served-model-name",
            "a",
            "--served-model-name",
            "b",
            "c",
            "--max-model-len",
            "256",
        ]
    )
    configs = engine_configs(args)
    assert [(c.served_model_name, c.served_model_aliases) for c in configs] == [("a", ()), ("b", ("c",))]
    with pytest.raises(ValueError, match=r"served_model_name must be distinct, non-empty names, got \['a', 'a'\]"):
        engine_configs(parser.parse_args(["serve", str(tiny_model_dir), "--served-model-name", "a", "a"]))


STREAM_MESSAGES = ("GenerateResponse", "CompletionDelta", "Usage", "TopLogprobs", "PromptLogprobs")
OPTIONAL = {"stop_token_id", "prompt_logprobs"}  # the stream's fields that may be unset


def as_values(message: object) -> dict:
    """A stream message of either form as nested dicts and lists (an unset optional field: ``None``)."""
    values = {}
    for f in getattr(pb, type(message).__name__).DESCRIPTOR.fields:
        if f.name in OPTIONAL and not message.HasField(f.name):
            values[f.name] = None
            continue
        value = getattr(message, f.name)
        if f.message_type is None:
            values[f.name] = list(value) if f.is_repeated else value
        else:
            values[f.name] = [as_values(v) for v in value] if f.is_repeated else as_values(value)
    return values


def not_plain(value: object, where: str = "response") -> list[str]:
    """Where ``value`` holds anything but plain Python values and ``messages`` objects (protobuf's
    messages and repeated containers among them)."""
    if value is None or isinstance(value, (str, int, float)):  # bools; logprobs may be outputs.Logprob floats
        return []
    if type(value) is list:
        return [bad for i, item in enumerate(value) for bad in not_plain(item, f"{where}[{i}]")]
    if type(value) in {getattr(messages, name) for name in STREAM_MESSAGES}:
        return [
            bad for f in dataclasses.fields(value) for bad in not_plain(getattr(value, f.name), f"{where}.{f.name}")
        ]
    kind = "protobuf message" if isinstance(value, Message) else type(value).__module__
    return [f"{where}: {kind} {type(value).__qualname__}"]


def test_the_plain_messages_mirror_the_protos_fields_and_defaults():
    for name in STREAM_MESSAGES:
        plain, proto = getattr(messages, name)(), getattr(pb, name)()
        assert [f.name for f in dataclasses.fields(plain)] == [f.name for f in proto.DESCRIPTOR.fields]
        assert as_values(plain) == as_values(proto)
        assert not_plain(plain) == []
        assert not hasattr(plain, "__dict__")  # slotted
    assert not_plain(messages.GenerateResponse(usage=pb.Usage(), outputs=[pb.CompletionDelta()])) == [
        "response.outputs[0]: protobuf message CompletionDelta",
        "response.usage: protobuf message Usage",
    ]
    assert not_plain(messages.CompletionDelta(token_ids=pb.CompletionDelta(token_ids=[1]).token_ids)) == [
        "response.token_ids: google._upb._message RepeatedScalarContainer"
    ]
    for message in (messages.Usage(), pb.Usage()):
        with pytest.raises(ValueError):
            message.HasField("prompt_tokens")  # no presence, on either form


async def _stream(stub, request: pb.GenerateRequest) -> list:
    call = stub.Generate(request, metadata=METADATA)
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


def _request(**fields) -> pb.GenerateRequest:
    stopping = {"max_tokens": 6, "ignore_eos": True, **fields.pop("stopping", {})}
    return pb.GenerateRequest(
        model="tiny",
        text="Both links",
        sampling=pb.SamplingParameters(n=2, temperature=0),
        stopping=pb.StoppingCriteria(**stopping),
        **fields,
    )


def test_the_in_process_stream_is_plain_objects_equal_to_the_grpc_streams_messages(stack):
    """One handler builds both streams: the same values, as protobuf messages over gRPC only."""
    local = InProcessStub(stack.engine_server.servicer)
    [_, first, *_] = stack.background.run(_stream(local, _request()))
    stop_token = first.outputs[0].token_ids[0]
    request = _request(
        request_id="same", logprobs=2, prompt_logprobs=1, echo=True, stopping={"stop_token_ids": [stop_token]}
    )

    async def both() -> tuple[list, list]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            return await _stream(local, request), await _stream(pb_grpc.TextGenerationServiceStub(channel), request)

    plain, protos = stack.background.run(both())
    assert [type(r) for r in plain] == [messages.GenerateResponse] * len(plain)
    assert [bad for r in plain for bad in not_plain(r)] == []
    assert [type(r) for r in protos] == [pb.GenerateResponse] * len(protos)
    assert [as_values(r) for r in plain] == [as_values(r) for r in protos]
    last = plain[-1]
    assert (
        last.finished
        and [(d.finish_reason, d.stop_token_id) for d in last.outputs] == [(pb.FINISH_REASON_STOP, stop_token)] * 2
    )
    with_tokens = next(r for r in plain if r.outputs)
    assert with_tokens.prompt_text == "Both links" and with_tokens.prompt_logprobs.token_ids
    assert len(with_tokens.outputs[0].top_logprobs[0].token_ids) == 2


def test_an_aborted_in_process_stream_ends_in_plain_objects(stack):
    local = InProcessStub(stack.engine_server.servicer)

    async def aborted() -> list:
        call = local.Generate(_request(request_id="to-abort", stopping={"max_tokens": 200}), metadata=METADATA)
        responses = [await call.read(), await call.read()]
        aborted = await local.Abort(pb.AbortRequest(request_ids=["to-abort"]), metadata=METADATA)
        assert aborted.num_aborted == 1
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        return responses

    responses = stack.background.run(aborted())
    assert [bad for r in responses for bad in not_plain(r)] == []
    last = responses[-1]
    assert last.finished and [d.finish_reason for d in last.outputs] == [pb.FINISH_REASON_ABORT] * 2
    assert last.usage.prompt_tokens == responses[1].usage.prompt_tokens > 0


def test_the_gateway_reads_no_protobuf_from_the_in_process_link(stack, monkeypatch):
    """Every response the gateway reads in process, over every kind of request of ``CASES``, is plain."""
    from raypaged.serving import inprocess

    seen = []
    real_read, real_forward = inprocess._StreamCall.read, inprocess._StreamCall.forward

    async def read(self):
        item = await real_read(self)
        seen.append(item)
        return item

    def forward(self, sink):
        def spy(item):
            seen.append(item)
            sink(item)

        real_forward(self, spy)

    monkeypatch.setattr(inprocess._StreamCall, "read", read)
    monkeypatch.setattr(inprocess._StreamCall, "forward", forward)
    with stack.client() as client:
        answered = [
            client.post(path, json=body, headers=headers).status_code
            for path, body, headers in CASES
            if path.startswith("/v1/")
        ]
    responses = [item for item in seen if item is not grpc.aio.EOF and item is not None]
    assert answered == [200] * 5 + [400, 400, 404, 400, 400, 400, 401] + [200] * 6  # CASES' statuses
    assert [bad for r in responses for bad in not_plain(r)] == []
    assert any(r.prompt_logprobs is not None for r in responses)
    assert any(d.top_logprobs for r in responses for d in r.outputs)


def test_a_forwarded_call_hands_on_queued_then_new_responses_then_its_status_then_none():
    from raypaged.serving.inprocess import _Context, _StreamCall

    async def handler(context, release):
        yield "first"
        yield "second"
        await release.wait()
        yield "third"
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV cache cannot hold it")

    async def run() -> list:
        release = asyncio.Event()
        call = _StreamCall(handler(_Context(None), release))
        assert await call.read() == "first"
        await asyncio.sleep(0)  # the handler runs on to its wait: "second" is queued, not read
        got: list = []
        call.forward(got.append)
        assert got == ["second"]
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        return got

    got = asyncio.run(run())
    assert got[:2] == ["second", "third"] and got[3:] == [None]
    assert isinstance(got[2], grpc.aio.AioRpcError)
    assert (got[2].code(), got[2].details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "the KV cache cannot hold it")
