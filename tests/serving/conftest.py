"""Real servers on loopback: an engine server (gRPC) and the HTTP gateway, in a background event loop."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from raypaged.config import EngineConfig
from raypaged.serving.engine_server import EngineServer
from raypaged.serving.gateway.tenants import Tenants
from raypaged.serving.inprocess import InProcessStub
from raypaged.serving.launch import Gateway, GatewayOptions
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.conftest import BOS_ID, add_bos, make_tiny_model  # noqa: F401  (theirs, imported by tests)


class BackgroundLoop:
    """An asyncio loop on its own thread; ``run(coro)`` waits for a result from test code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


class Stack:
    """An engine server and a gateway in front of it; ``url`` is the gateway's base URL."""

    def __init__(
        self,
        configs: list[EngineConfig],
        in_process: bool = True,
        metrics_prefix: str = "raypaged:",
        lora_modules: dict[str, str] | None = None,
        **gateway_options: Any,
    ) -> None:
        """As ``raypaged serve``: the engine server gets the gateway's keys and tenants, and the gateway
        reaches it in process (``in_process=False``: over gRPC, as ``raypaged gateway`` does)."""
        self.background = BackgroundLoop()
        options = GatewayOptions(port=0, log_level="warning", **gateway_options)
        tenants = Tenants.from_args(options.api_key, options.tenants_file)
        self.engine_server = EngineServer(configs, tenants, metrics_prefix=metrics_prefix, lora_modules=lora_modules)
        self.grpc_port = self.background.run(self.engine_server.start("127.0.0.1", 0))
        address = f"127.0.0.1:{self.grpc_port}"
        local = {address: InProcessStub(self.engine_server.servicer)} if in_process else None
        self.gateway = Gateway({name: address for name in self.engine_server.served_names}, options, local)
        self._serving = asyncio.run_coroutine_threadsafe(self.gateway.serve(), self.background.loop)
        self.url = f"http://127.0.0.1:{self.gateway.port}"
        self._wait_started()

    def _wait_started(self) -> None:
        for _ in range(200):
            if self.gateway.server.started:
                return
            threading.Event().wait(0.05)
        raise RuntimeError("gateway did not start")

    def engine(self, name: str | None = None):
        models = self.engine_server.models
        return (models[name] if name else next(iter(models.values()))).engine

    def grpc_stub(self) -> pb_grpc.TextGenerationServiceStub:
        return pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}"))

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)

    def close(self) -> None:
        self.gateway.stop()
        self._serving.result(timeout=30)
        self.background.run(self.engine_server.stop())
        self.background.close()


def _with_chat_template(path: Path, smollm2_dir: Path) -> Path:
    shutil.copy(smollm2_dir / "chat_template.jinja", path / "chat_template.jinja")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    return _with_chat_template(make_tiny_model(tmp_path_factory.mktemp("tiny"), smollm2_dir), smollm2_dir)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory, smollm2_dir) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), smollm2_dir, arch="qwen2")
    return _with_chat_template(path, smollm2_dir)


def tiny_config(model_dir: Path, name: str, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {"num_gpu_blocks_override": 64, "max_model_len": 256, **overrides}
    return EngineConfig(model=str(model_dir), served_model_name=name, **settings)


def serving(configs: list[EngineConfig], **gateway_options: Any) -> Iterator[httpx.Client]:
    """A module fixture's body: a ``Stack`` of ``configs`` and its HTTP client, closed after the module."""
    stack = Stack(configs, **gateway_options)
    try:
        with stack.client() as client:
            yield client
    finally:
        stack.close()


def after_section_ends(tokenizer_dir: Path, parser: str) -> Callable[[str], bool | None]:
    """For ``{"ok": true|false}`` constrained after ``parser``'s reasoning section: whether the grammar may end after
    a text (None: it refuses the text)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from raypaged.structured.reasoning import get_reasoning_parser

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    grammar = get_reasoning_parser(parser).after_section(xgr.Grammar.from_regex('\\{"ok": (true|false)\\}'))
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_grammar(grammar)

    def ends(text: str) -> bool | None:
        matcher = xgr.GrammarMatcher(compiled)
        if not all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)):
            return None
        return matcher.accept_token(tokenizer.eos_token_id)

    return ends


def streamed_chunks(shape: Any, pieces: list[str]) -> tuple[list[dict], list[str | None]]:
    """The chat chunks' deltas and finish reasons a ``ChunkWriter`` of ``shape`` makes of an answer arriving in
    ``pieces`` (the last one ends it)."""
    from raypaged.serving.gateway.responses import ChunkWriter
    from raypaged.serving.proto import generate_pb2 as pb

    writer = ChunkWriter(shape, 1, include_usage=False)
    deltas, finish_reasons = [], []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = pb.CompletionDelta(text=piece, finish_reason=pb.FINISH_REASON_STOP if last else 0)
        for chunk in writer.chunks(0, pb.GenerateResponse(outputs=[delta])):
            deltas.append(chunk["choices"][0]["delta"])
            finish_reasons.append(chunk["choices"][0]["finish_reason"])
    return deltas, finish_reasons


def streamed_calls(deltas: list[dict]) -> list[dict]:
    """The calls that the ``tool_calls`` of chat chunks' ``deltas`` make, in index order: each one's id, type and
    name from its first delta, its arguments joined."""
    calls: dict[int, dict] = {}
    for piece in (p for delta in deltas for p in delta.get("tool_calls") or ()):
        call = calls.get(piece["index"])
        if call is None:
            call = calls[piece["index"]] = {"id": piece["id"], "type": piece["type"], "function": piece["function"]}
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}, piece
            call["function"] = {
                **call["function"],
                "arguments": call["function"]["arguments"] + piece["function"]["arguments"],
            }
    return [calls[i] for i in sorted(calls)]


def streamed_parts(parser: str, output: str, piece: int) -> tuple[str, str]:
    """(reasoning, content) of ``output`` fed to ``parser``'s stream ``piece`` characters at a time."""
    from raypaged.structured.reasoning import get_reasoning_parser

    stream = get_reasoning_parser(parser).stream()
    reasoning = content = ""
    for i in range(0, len(output), piece):
        r, c = stream.feed(output[i : i + piece])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c
