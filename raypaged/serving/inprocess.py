"""The gateway's link to an engine server in the same process (``raypaged serve``).

``InProcessStub`` offers the stub methods the gateway calls and runs the engine
server's own handlers directly: the same authentication, input gate, tenant
holds, ids and statuses as over gRPC, with no socket, HTTP/2 framing or protobuf
on the token path: ``Generate``'s responses are the plain objects of ``messages.py``,
built by the same handler that builds gRPC's ``GenerateResponse`` messages. The
requests stay protobuf messages (one per request, built once by the gateway and read
once by the handler, never encoded). A ``Generate`` handler runs in a task of its own, as
gRPC runs it, so cancelling the call cancels the handler (which aborts the
request in the engine and frees its tenant slot). A handler that ends the call
with a status (``context.abort``) comes out as the ``grpc.aio.AioRpcError`` a gRPC
client would have seen, trailing metadata included, so the gateway maps both links
the same way. gRPC stays the external API and the link to remote engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import grpc

from raypaged.serving import messages
from raypaged.serving.messages import AnyResponse
from raypaged.serving.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from raypaged.serving.engine_server import EngineServicer

Metadata = tuple[tuple[str, str], ...]
Request = TypeVar("Request")
Response = TypeVar("Response")


def rpc_error(code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> grpc.aio.AioRpcError:
    """The error a gRPC client sees for a call ended with ``code``, ``details`` and trailing metadata."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class _Ended(Exception):
    """A handler ended its call with a status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing

    def rpc_error(self) -> grpc.aio.AioRpcError:
        return rpc_error(self.code, self.details, self.trailing)


class _Context:
    """What the handlers use of a ``grpc.aio.ServicerContext``."""

    def __init__(self, metadata: Metadata | None) -> None:
        self._metadata = tuple(metadata or ())
        self._trailing: Metadata = ()

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def set_trailing_metadata(self, metadata: Metadata) -> None:
        self._trailing = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Ended(code, details, self._trailing)


Item: TypeAlias = AnyResponse | grpc.aio.AioRpcError | None


class LinkedCall:
    """A server-streaming call fed through ``deliver``: each response, then ``None`` at the end, or the
    ``grpc.aio.AioRpcError`` that ended it. ``read()`` gives each response, then ``grpc.aio.EOF``; or,
    after ``forward(sink)``, each item goes straight to ``sink`` as it is delivered. ``cancel()`` runs
    ``on_cancel`` once."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self.deliver: Callable[[Item], None] = self._queue.put_nowait
        self.on_cancel: Callable[[], object] | None = None

    async def read(self) -> AnyResponse | object:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # later reads see the end too
            return grpc.aio.EOF
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def forward(self, sink: Callable[[Item], None]) -> None:
        """From now on each response goes to ``sink`` as it is delivered, a failure as its
        ``AioRpcError``, and the end as ``None`` (one consumer task fewer a token than ``read()``);
        responses not yet read go first."""
        while not self._queue.empty():
            sink(self._queue.get_nowait())
        self.deliver = sink

    def cancel(self) -> bool:
        on_cancel, self.on_cancel = self.on_cancel, None
        if on_cancel is None:
            return False
        on_cancel()
        return True


class _StreamCall(LinkedCall):
    """A ``Generate`` handler's responses, pumped from its task (cancelling the call cancels the task)."""

    def __init__(self, responses: AsyncIterator[AnyResponse]) -> None:
        super().__init__()
        self._task = asyncio.ensure_future(self._pump(responses))
        self.on_cancel = self._task.cancel

    async def _pump(self, responses: AsyncIterator[AnyResponse]) -> None:
        try:
            async for response in responses:
                self.deliver(response)
        except _Ended as ended:
            self.deliver(ended.rpc_error())
        except Exception as exc:  # a handler bug: the call fails as gRPC fails it, UNKNOWN
            self.deliver(rpc_error(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}"))
        self.deliver(None)


class InProcessStub:
    """The in-process ``EngineClient`` (``serving/client.py``): the ``TextGenerationServiceStub``
    calls of the gateway, answered by ``servicer`` in this process; ``Generate`` streams the plain
    ``messages.GenerateResponse`` objects."""

    def __init__(self, servicer: EngineServicer) -> None:
        self._servicer = servicer

    def Generate(self, request: pb.GenerateRequest, metadata: Metadata | None = None) -> _StreamCall:
        return _StreamCall(self._servicer.Generate(request, _Context(metadata), messages))

    # the unary RPCs: each runs the servicer's handler of its name

    async def Render(
        self, request: pb.GenerateRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.RenderResponse:
        return await _unary(self._servicer.Render, request, metadata, timeout)

    async def Derender(
        self, request: pb.DerenderRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.DerenderResponse:
        return await _unary(self._servicer.Derender, request, metadata, timeout)

    async def Embed(
        self, request: pb.EmbedRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.EmbedResponse:
        return await _unary(self._servicer.Embed, request, metadata, timeout)

    async def Abort(
        self, request: pb.AbortRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.AbortResponse:
        return await _unary(self._servicer.Abort, request, metadata, timeout)

    async def Tokenize(
        self, request: pb.TokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        return await _unary(self._servicer.Tokenize, request, metadata, timeout)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.DetokenizeResponse:
        return await _unary(self._servicer.Detokenize, request, metadata, timeout)

    async def TokenizerInfo(
        self, request: pb.TokenizerInfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.TokenizerInfoResponse:
        return await _unary(self._servicer.TokenizerInfo, request, metadata, timeout)

    async def Info(
        self, request: pb.InfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.InfoResponse:
        return await _unary(self._servicer.Info, request, metadata, timeout)

    async def Health(
        self, request: pb.HealthRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.HealthResponse:
        return await _unary(self._servicer.Health, request, metadata, timeout)

    async def Metrics(
        self, request: pb.MetricsRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.MetricsResponse:
        return await _unary(self._servicer.Metrics, request, metadata, timeout)

    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.LoadLoRAAdapterResponse:
        return await _unary(self._servicer.LoadLoRAAdapter, request, metadata, timeout)

    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.UnloadLoRAAdapterResponse:
        return await _unary(self._servicer.UnloadLoRAAdapter, request, metadata, timeout)

    async def Sleep(
        self, request: pb.SleepRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        return await _unary(self._servicer.Sleep, request, metadata, timeout)

    async def WakeUp(
        self, request: pb.WakeUpRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        return await _unary(self._servicer.WakeUp, request, metadata, timeout)

    async def IsSleeping(
        self, request: pb.IsSleepingRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        return await _unary(self._servicer.IsSleeping, request, metadata, timeout)


async def _unary(
    handler: Callable[[Request, _Context], Awaitable[Response]],
    request: Request,
    metadata: Metadata | None,
    timeout: float | None,
) -> Response:
    """One unary handler call; past ``timeout`` it fails ``DEADLINE_EXCEEDED``, as over gRPC."""
    try:
        return await asyncio.wait_for(handler(request, _Context(metadata)), timeout)
    except _Ended as ended:
        raise ended.rpc_error() from None
    except TimeoutError:
        raise _Ended(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ()).rpc_error() from None
