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
from typing import TYPE_CHECKING, TypeVar

import grpc

from raypaged.serving import messages
from raypaged.serving.messages import AnyResponse
from raypaged.serving.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from raypaged.serving.engine_server import EngineServicer

Metadata = tuple[tuple[str, str], ...]
Request = TypeVar("Request")
Response = TypeVar("Response")
_END = object()


class _Ended(Exception):
    """A handler ended its call with a status."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing

    def rpc_error(self) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(*self.trailing), self.details)


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


class _StreamCall:
    """A server-streaming call: ``read()`` gives each response, then ``grpc.aio.EOF``; or, after
    ``forward(sink)``, the handler hands each response straight to ``sink``."""

    def __init__(self, responses: AsyncIterator[AnyResponse]) -> None:
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._sink: Callable[[object], None] = self._queue.put_nowait
        self._task = asyncio.ensure_future(self._pump(responses))

    async def _pump(self, responses: AsyncIterator[AnyResponse]) -> None:
        try:
            async for response in responses:
                self._sink(response)
        except _Ended as ended:
            self._sink(ended.rpc_error())
        except Exception as exc:  # a handler bug: the call fails as gRPC fails it, UNKNOWN
            self._sink(
                grpc.aio.AioRpcError(
                    grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(), grpc.aio.Metadata(), f"{type(exc).__name__}: {exc}"
                )
            )
        self._sink(_END)

    async def read(self) -> AnyResponse | object:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # later reads see the end too
            return grpc.aio.EOF
        if isinstance(item, grpc.aio.AioRpcError):
            raise item
        return item

    def forward(self, sink: Callable[[AnyResponse | grpc.aio.AioRpcError | None], None]) -> None:
        """From now on each response goes to ``sink`` as the handler yields it, a failure as its
        ``AioRpcError``, and the end as ``None`` (one consumer task fewer a token than ``read()``);
        responses not yet read go first."""

        def send(item: object) -> None:
            sink(None if item is _END else item)

        while not self._queue.empty():
            send(self._queue.get_nowait())
        self._sink = send

    def cancel(self) -> bool:
        return self._task.cancel()


class InProcessStub:
    """The in-process ``EngineClient`` (``serving/client.py``): the ``TextGenerationServiceStub``
    calls of the gateway, answered by ``servicer`` in this process; ``Generate`` streams the plain
    ``messages.GenerateResponse`` objects."""

    def __init__(self, servicer: EngineServicer) -> None:
        self._servicer = servicer

    def Generate(self, request: pb.GenerateRequest, metadata: Metadata | None = None) -> _StreamCall:
        return _StreamCall(self._servicer.Generate(request, _Context(metadata), messages))

    # the unary RPCs: each runs the servicer's handler of its name

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
