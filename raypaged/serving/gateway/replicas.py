"""Data-parallel replicas: several engines serving the same models, behind one ``EngineClient``.

``raypaged serve -dp N`` runs N engine processes; ``raypaged gateway`` takes one ``--engine NAME=host:port``
per replica of a name. ``Replicas`` sends each request to the replica with the fewest calls in flight from
this gateway (a ``Generate`` stream counts until its end, failure or cancel; an ``Embed``, ``Render`` or
``Derender`` until its answer), the next one in turn among equals, as vLLM's data-parallel load balancer
weighs its engines by their queues (``least_loaded``). With ``cache_aware`` routing, a request goes to the replica its
prefix hashes to (``affinity_key``: a conversation's system messages and first user message, so every turn of one
conversation meets its cached prefix there), unless that replica has ``AFFINITY_SLACK`` more calls in flight than
the least loaded one. A request keeps its replica for its whole life. What changes an
engine's state goes to every replica, in turn: ``Abort`` (a request id may be on any of them: the counts
are added), sleep mode (``Sleep``, ``WakeUp``; ``IsSleeping`` is true while any replica sleeps), and loading
or unloading a LoRA adapter (the first failure is the call's, and a load that one replica refuses is undone
on the others).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from raypaged.serving.client import EngineClient, Metadata, StreamCall
from raypaged.serving.messages import AnyResponse
from raypaged.serving.proto import generate_pb2 as pb


class _CountedCall:
    """A ``Generate`` call that gives its replica's slot back once, at its end, failure or cancel."""

    def __init__(self, call: StreamCall, release: Callable[[], None]) -> None:
        self._call = call
        self._release: Callable[[], None] | None = release

    def _done(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    async def read(self) -> AnyResponse | Any:
        try:
            response = await self._call.read()
        except BaseException:
            self._done()
            raise
        if response is grpc.aio.EOF:
            self._done()
        return response

    def cancel(self) -> bool:
        self._done()
        return self._call.cancel()


class _CountedForwardingCall(_CountedCall):
    """``_CountedCall`` of a call that can push its responses (the in-process and engine-process links)."""

    def forward(self, sink: Callable[[AnyResponse | grpc.aio.AioRpcError | None], None]) -> None:
        def counted(item: AnyResponse | grpc.aio.AioRpcError | None) -> None:
            if item is None or isinstance(item, grpc.aio.AioRpcError):
                self._done()
            sink(item)

        self._call.forward(counted)  # type: ignore[attr-defined]


ROUTING = ("least_loaded", "cache_aware")  # --data-parallel-routing
AFFINITY_SLACK = 4  # cache_aware: calls in flight above the least loaded replica's that its own replica may have
_TEXT_PREFIX_CHARS = 1024  # a text prompt's characters that its affinity reads
_ID_PREFIX = 256  # a token-id prompt's ids that its affinity reads


def affinity_key(request: pb.GenerateRequest) -> bytes | None:
    """What a request shares with the requests that can reuse its cached prefix: a conversation's messages up to
    its first user message (every later turn starts with them), a text prompt's first characters, a token-id
    prompt's first ids; with the model's name."""
    kind = request.WhichOneof("prompt")
    if kind == "messages":
        head = []
        for message in request.messages.messages:
            parts = tuple((p.text, p.image_url) for p in message.parts)
            head.append((message.role, message.content, tuple(message.image_urls), parts))
            if message.role == "user":
                break
        return repr((request.model, head)).encode()
    if kind == "text":
        return repr((request.model, request.text[:_TEXT_PREFIX_CHARS])).encode()
    if kind == "token_ids":
        return repr((request.model, list(request.token_ids.ids[:_ID_PREFIX]))).encode()
    return None


class Replicas:
    """An ``EngineClient`` over ``stubs``, the engines of one data-parallel group (``in_flight[i]``: the calls
    this gateway has running on replica ``i``); ``routing``: one of ``ROUTING``."""

    def __init__(self, stubs: Sequence[EngineClient], routing: str = "least_loaded") -> None:
        if len(stubs) < 2:
            raise ValueError(f"data-parallel replicas are at least 2 engines, got {len(stubs)}")
        if routing not in ROUTING:
            raise ValueError(f"--data-parallel-routing takes {' or '.join(ROUTING)}, got {routing!r}")
        self.routing = routing
        self.stubs = list(stubs)
        self.in_flight = [0] * len(stubs)
        self._next = 0

    def _up(self) -> list[int]:
        """The replicas to send calls to: those not being started again after their process died (all, if none is
        up: their calls fail UNAVAILABLE at once)."""
        up = [i for i, stub in enumerate(self.stubs) if getattr(stub, "available", True)]
        return up or list(range(len(self.stubs)))

    def _least_loaded(self) -> int:
        """The replica up with the fewest calls in flight; among equals, the first from the one after the last taken."""
        up = self._up()
        least = min(self.in_flight[i] for i in up)
        count = len(self.stubs)
        return next(
            i % count
            for i in range(self._next, self._next + count)
            if i % count in up and self.in_flight[i % count] == least
        )

    def _preferred(self, key: bytes) -> int | None:
        """The replica up that ``key`` hashes highest with (rendezvous hashing: replicas that go and come back
        move only their own keys), if it is within ``AFFINITY_SLACK`` calls of the least loaded one."""
        up = self._up()
        index = max(up, key=lambda i: hashlib.blake2b(key + i.to_bytes(2, "big"), digest_size=8).digest())
        least = min(self.in_flight[i] for i in up)
        return index if self.in_flight[index] - least <= AFFINITY_SLACK else None

    def _take(self, key: bytes | None = None) -> tuple[int, Callable[[], None]]:
        index = None if key is None else self._preferred(key)  # a key only with cache_aware routing
        if index is None:
            index = self._least_loaded()
            self._next = index + 1
        self.in_flight[index] += 1

        def release() -> None:
            self.in_flight[index] -= 1

        return index, release

    def Generate(self, request: pb.GenerateRequest, metadata: Metadata | None = None) -> StreamCall:
        index, release = self._take(affinity_key(request) if self.routing == "cache_aware" else None)
        try:
            call = self.stubs[index].Generate(request, metadata)
        except BaseException:
            release()
            raise
        kind = _CountedForwardingCall if hasattr(call, "forward") else _CountedCall
        return kind(call, release)

    async def _counted(self, method: str, request: Any, metadata: Metadata | None, timeout: float | None) -> Any:
        index, release = self._take()
        try:
            return await getattr(self.stubs[index], method)(request, metadata=metadata, timeout=timeout)
        finally:
            release()

    def Embed(
        self, request: pb.EmbedRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.EmbedResponse]:
        return self._counted("Embed", request, metadata, timeout)

    def Render(
        self, request: pb.GenerateRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.RenderResponse]:
        return self._counted("Render", request, metadata, timeout)

    def Derender(
        self, request: pb.DerenderRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.DerenderResponse]:
        return self._counted("Derender", request, metadata, timeout)

    def _any(self) -> EngineClient:
        """A replica for a call that reads what they all hold alike (the tokenizer, the models' descriptions); it is
        not counted, and leaves the turn where it was."""
        return self.stubs[self._least_loaded()]

    def Tokenize(
        self, request: pb.TokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.TokenizeResponse]:
        return self._any().Tokenize(request, metadata=metadata, timeout=timeout)

    def Detokenize(
        self, request: pb.DetokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.DetokenizeResponse]:
        return self._any().Detokenize(request, metadata=metadata, timeout=timeout)

    def TokenizerInfo(
        self, request: pb.TokenizerInfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.TokenizerInfoResponse]:
        return self._any().TokenizerInfo(request, metadata=metadata, timeout=timeout)

    def Info(
        self, request: pb.InfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.InfoResponse]:
        return self._any().Info(request, metadata=metadata, timeout=timeout)

    async def Health(
        self, request: pb.HealthRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.HealthResponse:
        """Serving while a replica serves (the others' requests go to it while they start again); else the first
        replica's answer, or its failure."""
        answers = await asyncio.gather(
            *(self.stubs[i].Health(request, metadata=metadata, timeout=timeout) for i in self._up()),
            return_exceptions=True,
        )
        for answer in answers:
            if isinstance(answer, pb.HealthResponse) and answer.status == pb.SERVING_STATUS_SERVING:
                return answer
        if isinstance(answers[0], BaseException):
            raise answers[0]
        return answers[0]

    async def Metrics(
        self, request: pb.MetricsRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.MetricsResponse:
        """Every replica's exposition, one after the other (their series differ by the ``engine`` label)."""
        texts = [(await s.Metrics(request, metadata=metadata, timeout=timeout)).prometheus_text for s in self.stubs]
        return pb.MetricsResponse(prometheus_text="".join(texts))

    async def Abort(
        self, request: pb.AbortRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.AbortResponse:
        aborted = 0
        for stub in self.stubs:
            aborted += (await stub.Abort(request, metadata=metadata, timeout=timeout)).num_aborted
        return pb.AbortResponse(num_aborted=aborted)

    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.LoadLoRAAdapterResponse:
        """On every replica; if one refuses, the replicas that took it unload it again, so all hold the same."""
        for count, stub in enumerate(self.stubs):
            try:
                await stub.LoadLoRAAdapter(request, metadata=metadata, timeout=timeout)
            except grpc.aio.AioRpcError:
                undo = pb.UnloadLoRAAdapterRequest(lora_name=request.lora_name)
                for loaded in self.stubs[:count]:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await loaded.UnloadLoRAAdapter(undo, metadata=metadata, timeout=timeout)
                raise
        return pb.LoadLoRAAdapterResponse()

    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.UnloadLoRAAdapterResponse:
        for stub in self.stubs:
            await stub.UnloadLoRAAdapter(request, metadata=metadata, timeout=timeout)
        return pb.UnloadLoRAAdapterResponse()

    async def Sleep(
        self, request: pb.SleepRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        for stub in self.stubs:
            await stub.Sleep(request, metadata=metadata, timeout=timeout)
        return pb.SleepResponse(is_sleeping=True)

    async def WakeUp(
        self, request: pb.WakeUpRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        sleeping = [(await s.WakeUp(request, metadata=metadata, timeout=timeout)).is_sleeping for s in self.stubs]
        return pb.SleepResponse(is_sleeping=any(sleeping))

    async def IsSleeping(
        self, request: pb.IsSleepingRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        sleeping = [(await s.IsSleeping(request, metadata=metadata, timeout=timeout)).is_sleeping for s in self.stubs]
        return pb.SleepResponse(is_sleeping=any(sleeping))
