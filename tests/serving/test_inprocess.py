"""The in-process link (``raypaged serve``) answers exactly as the gRPC link (``raypaged gateway``).

One engine server with API keys; one gateway reaches it in process, a second over gRPC.
Every request, good or bad, streamed or not, gets the same status and body from both
(response ids and timestamps aside).
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from raypaged.serving.launch import Gateway, GatewayOptions, listen
from tests.serving.conftest import Stack, tiny_config

KEY = "sk-link"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"model": "tiny", "prompt": "Both links", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CASES = [
    ("/v1/completions", GREEDY, AUTH),
    ("/v1/completions", dict(GREEDY, n=2, logprobs=2, stop=["zz"]), AUTH),
    ("/v1/completions", dict(GREEDY, stream=True, stream_options={"include_usage": True}), AUTH),
    ("/v1/completions", dict(GREEDY, best_of=3, n=1, temperature=1, seed=4), AUTH),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "temperature": 0}, AUTH),
    ("/v1/completions", dict(GREEDY, stop_token_ids=[49152]), AUTH),
    ("/v1/completions", dict(GREEDY, logprobs=50), AUTH),
    ("/v1/completions", dict(GREEDY, model="nope"), AUTH),
    ("/v1/completions", dict(GREEDY, priority=-1), AUTH),
    ("/v1/completions", dict(GREEDY, prompt=[[49152], [5, 6]]), AUTH),
    ("/v1/completions", dict(GREEDY, prompt="x" * 10_000), AUTH),
    ("/v1/completions", GREEDY, {"Authorization": "Bearer wrong"}),
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
    gateway = Gateway({"tiny": f"127.0.0.1:{stack.grpc_port}"}, GatewayOptions(port=0, log_level="warning",
                                                                             api_key=KEY))
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


def test_every_entry_point_checks_its_inputs_in_the_engines_one_input_processor(
        stack, grpc_gateway_url, tiny_model_dir, monkeypatch):
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
        texts = [client.post("/v1/completions", json=GREEDY, headers=AUTH).json()["choices"][0]["text"]
                 for client in (local, remote)]
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256)
    try:
        [offline] = llm.generate(GREEDY["prompt"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)
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
        ["serve", str(tiny_model_dir), "--served-model-name", "first", "second", "--max-model-len", "256",
         "--num-gpu-blocks-override", "64"]
    )
    [config] = engine_configs(args)
    assert (config.model, config.served_model_name, config.served_model_aliases) == (
        str(tiny_model_dir), "first", ("second",))
    stack = Stack([config])
    try:
        with stack.client() as client:
            assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["first", "second"]
            assert client.get("/v1/models/second").json()["max_model_len"] == 256
            texts = [client.post("/v1/completions", json=dict(GREEDY, model=name)).json()["choices"][0]["text"]
                     for name in ("first", "second")]
            assert texts[0] == texts[1]
    finally:
        stack.close()


def test_a_positional_model_and_served_name_groups_parse_as_vllm_does(tiny_model_dir):
    from raypaged.entrypoints.cli import build_parser, engine_configs

    parser = build_parser()
    args = parser.parse_args(["serve", str(tiny_model_dir), "--model", str(tiny_model_dir), "--served-model-name", "a",
                              "--served-model-name", "b", "c", "--max-model-len", "256"])
    configs = engine_configs(args)
    assert [(c.served_model_name, c.served_model_aliases) for c in configs] == [("a", ()), ("b", ("c",))]
    with pytest.raises(ValueError, match=r"served_model_name must be distinct, non-empty names, got \['a', 'a'\]"):
        engine_configs(parser.parse_args(["serve", str(tiny_model_dir), "--served-model-name", "a", "a"]))
