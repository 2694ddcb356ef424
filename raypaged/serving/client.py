"""``EngineClient``: what the gateway calls on an engine server, whichever link reaches it.

Two implementations: ``InProcessStub`` (``raypaged serve``: the engine server's own handlers
in this process, with no socket and no serialization) and gRPC's
``TextGenerationServiceStub`` (``raypaged gateway``: an engine server elsewhere). The
methods are the ``TextGenerationService`` RPCs of ``protos/generate.proto``, called as a
``grpc.aio`` stub is: a request message, then ``metadata`` (and ``timeout`` for unary calls);
``Generate`` returns a call whose ``read()`` gives each response, then ``grpc.aio.EOF``.
Failures are ``grpc.aio.AioRpcError`` s on either link.

Requests and unary responses are ``generate_pb2`` messages on both links. ``Generate``'s
responses are ``pb.GenerateResponse`` messages over gRPC and the plain
``messages.GenerateResponse`` objects in process (no protobuf on the token path); the two have
the same fields and ``HasField``, and the gateway reads them with the same code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import grpc

from raypaged.serving.messages import AnyResponse
from raypaged.serving.proto import generate_pb2 as pb

Metadata = tuple[tuple[str, str], ...]


class StreamCall(Protocol):
    async def read(self) -> AnyResponse | Any: ...  # the link's GenerateResponse, or grpc.aio.EOF at the end

    def cancel(self) -> bool: ...


@runtime_checkable
class ForwardingCall(StreamCall, Protocol):
    """A call that can push its responses instead (the in-process link): after ``forward(sink)`` each
    response goes to ``sink`` as it is made, a failure as its ``grpc.aio.AioRpcError``, the end as ``None``."""

    def forward(self, sink: Callable[[AnyResponse | grpc.aio.AioRpcError | None], None]) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    def Generate(self, request: pb.GenerateRequest, metadata: Metadata | None = None) -> StreamCall: ...

    def Render(
        self, request: pb.GenerateRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.RenderResponse]: ...

    def Derender(
        self, request: pb.DerenderRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.DerenderResponse]: ...

    def Embed(
        self, request: pb.EmbedRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.EmbedResponse]: ...

    def Abort(
        self, request: pb.AbortRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.AbortResponse]: ...

    def Tokenize(
        self, request: pb.TokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.TokenizeResponse]: ...

    def Detokenize(
        self, request: pb.DetokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.DetokenizeResponse]: ...

    def TokenizerInfo(
        self, request: pb.TokenizerInfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.TokenizerInfoResponse]: ...

    def Info(
        self, request: pb.InfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.InfoResponse]: ...

    def Health(
        self, request: pb.HealthRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.HealthResponse]: ...

    def Metrics(
        self, request: pb.MetricsRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.MetricsResponse]: ...

    def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.LoadLoRAAdapterResponse]: ...

    def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.UnloadLoRAAdapterResponse]: ...

    def Sleep(
        self, request: pb.SleepRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.SleepResponse]: ...

    def WakeUp(
        self, request: pb.WakeUpRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.SleepResponse]: ...

    def IsSleeping(
        self, request: pb.IsSleepingRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> Awaitable[pb.SleepResponse]: ...
