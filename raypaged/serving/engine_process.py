"""The engine server in a process of its own, linked to the gateway's process by one socket pair.

``raypaged serve`` runs its gateway (HTTP parsing, JSON, SSE) in one process and its engines
(scheduler, model, sampler, detokenizer) with their gRPC server in a child process, as vLLM runs its
API server and its engine core: each has an interpreter lock of its own, so the event loop's work
for a token no longer waits for the engine's step, or the step for the loop. ``$RAYPAGED_ENGINE_PROCESS=0``
keeps both in one process (``serving/inprocess.py``).

The link carries the ``EngineClient`` calls (``serving/client.py``) and their answers, pickled, many
to a frame: every message that one side produces in one turn of its event loop goes in one write
(a step's tokens for all streams make one frame). The child answers each call with the engine
server's own handlers through ``InProcessStub``, so authentication, the input gate, tenant holds,
ids and statuses are those of gRPC and of the in-process link. A failure crosses as its status code,
details and trailing metadata, and comes out as the ``grpc.aio.AioRpcError`` a gRPC client would see.

Lifetimes: the parent starts the child and waits for its ``ready`` (the engines are loaded, its gRPC
server listens) or for the error that stopped it. The child ignores SIGINT and SIGTERM (a terminal's
Ctrl-C reaches the whole process group, systemd signals every process of a service; the parent drains
and then closes the link) and stops when the link closes, so a parent that dies, however it dies, takes
the child with it. When the child dies,
every open call fails ``UNAVAILABLE`` and the parent's ``on_lost`` callback runs (``raypaged serve``
then stops, for its supervisor to restart it, as vLLM's API server exits when its engine core dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import io
import logging
import logging.config
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import grpc

from raypaged.linked_child import start_linked
from raypaged.serving.inprocess import InProcessStub, LinkedCall, Metadata, rpc_error
from raypaged.serving.proto import generate_pb2 as pb

logger = logging.getLogger("raypaged")

_LENGTH = 4  # bytes of a frame's length prefix
_READY = "ready"
_FAILED = "failed"
_CALL, _CANCEL = "call", "cancel"
_ITEM, _END, _ERROR, _RESULT = "item", "end", "error", "result"
_STOP_TIMEOUT_S = 30.0  # for the child to stop its engines once the link closes, before it is killed


class EngineProcessLost(RuntimeError):
    """The engine process ended while it started (a crash as it loaded the model) or while the gateway served."""


def _message(name: str, data: bytes) -> Any:
    return getattr(pb, name).FromString(data)


def _reduce_message(message: Any) -> tuple[Any, ...]:
    return _message, (type(message).__name__, message.SerializeToString())


# protobuf messages cross as their type's name and their wire bytes (pickle cannot import the classes by the
# module name protoc gave them)
_PICKLE_TABLE = copyreg.dispatch_table.copy()
_PICKLE_TABLE.update({getattr(pb, name): _reduce_message for name in pb.DESCRIPTOR.message_types_by_name})


def _dumps(value: object) -> memoryview:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = _PICKLE_TABLE
    pickler.dump(value)
    return buffer.getbuffer()


def _crossable(message: tuple[Any, ...]) -> tuple[Any, ...]:
    """``message``, or, if it cannot be pickled, the failure of its call (``INTERNAL``)."""
    try:
        _dumps(message)
    except Exception as exc:
        details = f"the answer cannot cross the engine process's link: {type(exc).__name__}: {exc}"
        return (_ERROR, message[1], grpc.StatusCode.INTERNAL, details, ())
    return message


class _Link:
    """Frames of pickled message lists over a stream; ``send`` queues a message, written once per loop turn."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._out: list[tuple[Any, ...]] = []

    def send(self, message: tuple[Any, ...]) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(message)

    def _flush(self) -> None:
        out, self._out = self._out, []
        try:
            data = _dumps(out)
        except Exception:  # one message that cannot cross fails its own call, not the frame
            data = _dumps([_crossable(message) for message in out])
        if not self.writer.is_closing():
            self.writer.writelines((len(data).to_bytes(_LENGTH, "big"), data))

    async def receive(self) -> list[tuple[Any, ...]]:
        """The next frame's messages; ``asyncio.IncompleteReadError`` at the end of the stream."""
        size = int.from_bytes(await self.reader.readexactly(_LENGTH), "big")
        messages: list[tuple[Any, ...]] = pickle.loads(await self.reader.readexactly(size))
        return messages

    def close(self) -> None:
        self.writer.close()


def _error_message(cid: int, exc: grpc.aio.AioRpcError) -> tuple[Any, ...]:
    trailing = tuple((key, value) for key, value in exc.trailing_metadata() or ())
    return (_ERROR, cid, exc.code(), exc.details() or "", trailing)


# ---- the child: the engine server behind the link


async def _serve_link(stub: InProcessStub, link: _Link) -> None:
    """Answer the parent's calls with ``stub`` until the link closes; then cancel what still runs."""
    streams: dict[int, Any] = {}
    unary: dict[int, asyncio.Task[None]] = {}

    def forward(cid: int) -> Callable[[object], None]:
        def sink(item: object) -> None:
            if item is None:
                streams.pop(cid, None)
                link.send((_END, cid))
            elif isinstance(item, grpc.aio.AioRpcError):
                streams.pop(cid, None)
                link.send(_error_message(cid, item))
            else:
                link.send((_ITEM, cid, item))

        return sink

    async def answer(cid: int, method: str, request: Any, metadata: Metadata) -> None:
        try:
            link.send((_RESULT, cid, await getattr(stub, method)(request, metadata)))
        except grpc.aio.AioRpcError as exc:
            link.send(_error_message(cid, exc))
        finally:
            unary.pop(cid, None)

    try:
        while True:
            for message in await link.receive():
                if message[0] == _CANCEL:
                    call = streams.pop(message[1], None) or unary.pop(message[1], None)
                    if call is not None:
                        call.cancel()
                    continue
                _, cid, method, request, metadata = message
                if method == "Generate":
                    call = streams[cid] = stub.Generate(request, metadata)
                    call.forward(forward(cid))
                else:  # a unary call's deadline is the parent's to keep: past it, the parent cancels the call
                    unary[cid] = asyncio.ensure_future(answer(cid, method, request, metadata))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # the parent closed the link: stop
    finally:
        for call in [*streams.values(), *unary.values()]:
            call.cancel()


async def _child_main(fd: int) -> None:
    from raypaged.entrypoints.cli import configure_logging
    from raypaged.serving.engine_server import EngineServer

    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    link = _Link(reader, writer)
    try:
        [(server_args, host, port, log_level, log_config)] = await link.receive()
    except (asyncio.IncompleteReadError, ConnectionError):
        return  # the parent went away before it asked for the engines (a bad flag, an interrupt)
    configure_logging(log_level)  # as the parent logs
    if log_config is not None:
        logging.config.dictConfig(log_config)
    try:
        configs = server_args[0]  # or a function that makes them here (run_serve)
        server = EngineServer(configs if isinstance(configs, list) else configs(), *server_args[1:])
        bound = await server.start(host, port)
    except BaseException as exc:  # the parent raises it (or says what it was) and exits
        try:
            pickle.dumps(exc)
            failure: object = exc
        except Exception:
            failure = f"{type(exc).__name__}: {exc}"
        link.send((_FAILED, failure))
        await asyncio.sleep(0)
        await writer.drain()
        link.close()
        return
    _ignore_stop_signals()  # again: starting Ray (tensor parallelism) installs its own SIGTERM handler
    link.send((_READY, bound, server.served_names))
    try:
        await _serve_link(InProcessStub(server.servicer), link)
    finally:
        link.close()
        await server.stop()


def _ignore_stop_signals() -> None:
    """SIGINT and SIGTERM are the parent's to act on: a terminal's Ctrl-C reaches the whole process group,
    and systemd (``KillMode=control-group``) sends SIGTERM to every process of the service at once; the
    parent drains its requests and then closes the link, which stops the child."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> None:
    """The child's entry: ``python -m raypaged.serving.engine_process FD``, FD its end of the socket pair."""
    [fd] = argv if argv is not None else sys.argv[1:]
    _ignore_stop_signals()
    asyncio.run(_child_main(int(fd)))


# ---- the parent: an EngineClient over the link


def data_parallel_env(rank: int, size: int, tensor_parallel_size: int, environ: dict[str, str]) -> dict[str, str]:
    """The environment of data-parallel rank ``rank`` of ``size``: its share of this process's CPUs
    (``OMP_NUM_THREADS``, unless set) and its ``tensor_parallel_size`` GPUs (``CUDA_VISIBLE_DEVICES``: the
    rank's slice of those visible here, or of all)."""
    env = dict(environ)
    if "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // size))
    wanted = size * tensor_parallel_size
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(wanted)]
    if len(devices) < wanted:
        raise ValueError(
            f"--data-parallel-size {size} with --tensor-parallel-size {tensor_parallel_size} takes {wanted} "
            f"devices, but CUDA_VISIBLE_DEVICES lists {len(devices)}"
        )
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[rank * tensor_parallel_size : (rank + 1) * tensor_parallel_size])
    return env


class EngineProcess:
    """A child process serving an ``EngineServer``; ``ProcessStub(self)`` is its ``EngineClient`` here.

    ``launch()`` starts the child, which imports the engine while this process goes on (``raypaged serve``
    launches it before it reads its own flags); ``start(server_args, ...)`` launches it if need be and
    returns once ``EngineServer(*server_args)`` has loaded its engines and its gRPC server listens
    (``grpc_port``, ``served_names``), or raises what stopped the child. ``discard()`` kills a child
    that was launched but will not be started. If the child ends while the link is open, ``lost`` says
    how and ``on_lost`` is called with it."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        """``env``: the child's environment (default: this process's)."""
        self.env = env
        self.grpc_port = 0
        self.served_names: dict[str, str] = {}
        self.on_lost: Callable[[str], object] | None = None
        self.lost: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._link: _Link | None = None
        self._reader: asyncio.Task[None] | None = None
        self._next_id = 0
        self._streams: dict[int, LinkedCall] = {}
        self._unary: dict[int, asyncio.Future[Any]] = {}
        self._closing = False

    @classmethod
    def for_ranks(cls, data_parallel_size: int, tensor_parallel_size: int) -> list[EngineProcess]:
        """One engine process per data-parallel rank, each with its ``data_parallel_env`` (one: this environment)."""
        if data_parallel_size == 1:
            return [cls()]
        return [
            cls(data_parallel_env(rank, data_parallel_size, tensor_parallel_size, dict(os.environ)))
            for rank in range(data_parallel_size)
        ]

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def launch(self) -> None:
        if self._process is not None:
            return
        self._socket, self._process = start_linked("raypaged.serving.engine_process", env=self.env)

    def discard(self) -> None:
        if self._process is not None and self._link is None:
            self._process.kill()
            self._process.wait()

    async def start(
        self, server_args: tuple[Any, ...], host: str, port: int, log_config: dict[str, Any] | None = None
    ) -> None:
        """``server_args``: ``EngineServer``'s arguments; its gRPC server listens on ``host:port`` (0: a free
        port); ``log_config``: a ``logging.config.dictConfig`` dict for the child, which otherwise logs at
        this process's ``raypaged`` level."""
        self.launch()
        assert self._process is not None and self._socket is not None
        process = self._process
        try:
            reader, writer = await asyncio.open_unix_connection(sock=self._socket)
            self._link = _Link(reader, writer)
            self._link.send((server_args, host, port, logger.getEffectiveLevel(), log_config))
            first = (await self._link.receive())[0]
        except (asyncio.IncompleteReadError, ConnectionError):
            await self._wait_exit(None)
            raise EngineProcessLost(
                f"the engine process exited while starting (exit code {process.returncode})"
            ) from None
        except BaseException:  # cancelled, or interrupted, while the engines load
            process.kill()
            raise
        if first[0] == _FAILED:
            await self._wait_exit(None)
            failure = first[1]
            raise failure if isinstance(failure, BaseException) else RuntimeError(failure)
        _, self.grpc_port, self.served_names = first
        self._reader = asyncio.ensure_future(self._read())

    async def _wait_exit(self, timeout: float | None) -> None:
        """Wait for the child to exit; past ``timeout`` it is killed."""
        assert self._process is not None
        process = self._process
        try:
            await asyncio.get_running_loop().run_in_executor(None, process.wait, timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not stop within %g s: killing it", timeout)
            process.kill()
            await asyncio.get_running_loop().run_in_executor(None, process.wait)

    async def _read(self) -> None:
        assert self._link is not None
        try:
            while True:
                for message in await self._link.receive():
                    self._deliver(message)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a frame that cannot be read: the link is broken, and the child goes
            logger.exception("the engine process's link is broken")
            assert self._process is not None
            self._process.kill()
        await self._wait_exit(_STOP_TIMEOUT_S if self._closing else None)
        assert self._process is not None
        why = f"the engine process has exited (exit code {self._process.returncode})"
        ended = rpc_error(grpc.StatusCode.UNAVAILABLE, why)
        for call in self._streams.values():
            call.deliver(ended)
        for future in self._unary.values():
            if not future.done():
                future.set_exception(ended)
        self._streams.clear()
        self._unary.clear()
        if not self._closing:  # lost, not stopped
            self.lost = why
            logger.error("%s", why)
            if self.on_lost is not None:
                self.on_lost(why)

    def _deliver(self, message: tuple[Any, ...]) -> None:
        kind, cid = message[0], message[1]
        if kind == _ITEM:
            call = self._streams.get(cid)
            if call is not None:
                call.deliver(message[2])
        elif kind == _END:
            call = self._streams.pop(cid, None)
            if call is not None:
                call.deliver(None)
        elif kind == _RESULT:
            future = self._unary.pop(cid, None)
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == _ERROR:
            error = rpc_error(message[2], message[3], message[4])
            stream = self._streams.pop(cid, None)
            if stream is not None:
                stream.deliver(error)
            future = self._unary.pop(cid, None)
            if future is not None and not future.done():
                future.set_exception(error)

    def _call(self, method: str, request: Any, metadata: Metadata | None) -> int:
        if self.lost is not None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, self.lost)
        assert self._link is not None
        self._next_id += 1
        self._link.send((_CALL, self._next_id, method, request, tuple(metadata or ())))
        return self._next_id

    def _cancel(self, cid: int) -> None:
        if self._streams.pop(cid, None) is not None or self._unary.pop(cid, None) is not None:
            if self.lost is None and self._link is not None:
                self._link.send((_CANCEL, cid))

    def generate(self, request: pb.GenerateRequest, metadata: Metadata | None = None) -> LinkedCall:
        call = LinkedCall()
        try:
            cid = self._call("Generate", request, metadata)
        except grpc.aio.AioRpcError as exc:
            call.deliver(exc)
            return call
        call.on_cancel = lambda: self._cancel(cid)
        self._streams[cid] = call
        return call

    async def unary(self, method: str, request: Any, metadata: Metadata | None, timeout: float | None) -> Any:
        """One unary call; past ``timeout`` it fails ``DEADLINE_EXCEEDED`` and is cancelled in the child. The
        deadline is kept here, not in the child, so a child that no longer answers (its loop blocked) cannot
        hold the caller."""
        cid = self._call(method, request, metadata)
        future = self._unary[cid] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self._cancel(cid)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:
            self._cancel(cid)
            raise

    async def stop(self) -> None:
        """Close the link (the child stops its engines and exits) and wait for the child (killed if it
        has not stopped within 30 s)."""
        self._closing = True
        if self._link is not None:
            self._link.close()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


class ProcessStub:
    """The ``EngineClient`` of an ``EngineProcess``: each call crosses the link to the child's handlers.

    A data-parallel rank's stub outlives its process: ``replace`` points it at the process started in the dead
    one's place, and ``available`` is false in between (``Replicas`` sends nothing to it then)."""

    def __init__(self, engine: EngineProcess) -> None:
        self._engine = engine
        self.available = True

    def replace(self, engine: EngineProcess) -> None:
        self._engine = engine
        self.available = True

    def Generate(self, request: pb.GenerateRequest, metadata: Metadata | None = None) -> LinkedCall:
        return self._engine.generate(request, metadata)

    async def Render(
        self, request: pb.GenerateRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.RenderResponse:
        return await self._engine.unary("Render", request, metadata, timeout)

    async def Derender(
        self, request: pb.DerenderRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.DerenderResponse:
        return await self._engine.unary("Derender", request, metadata, timeout)

    async def Embed(
        self, request: pb.EmbedRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.EmbedResponse:
        return await self._engine.unary("Embed", request, metadata, timeout)

    async def Abort(
        self, request: pb.AbortRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.AbortResponse:
        return await self._engine.unary("Abort", request, metadata, timeout)

    async def Tokenize(
        self, request: pb.TokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.TokenizeResponse:
        return await self._engine.unary("Tokenize", request, metadata, timeout)

    async def Detokenize(
        self, request: pb.DetokenizeRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.DetokenizeResponse:
        return await self._engine.unary("Detokenize", request, metadata, timeout)

    async def TokenizerInfo(
        self, request: pb.TokenizerInfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.TokenizerInfoResponse:
        return await self._engine.unary("TokenizerInfo", request, metadata, timeout)

    async def Info(
        self, request: pb.InfoRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.InfoResponse:
        return await self._engine.unary("Info", request, metadata, timeout)

    async def Health(
        self, request: pb.HealthRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.HealthResponse:
        return await self._engine.unary("Health", request, metadata, timeout)

    async def Metrics(
        self, request: pb.MetricsRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.MetricsResponse:
        return await self._engine.unary("Metrics", request, metadata, timeout)

    async def LoadLoRAAdapter(
        self, request: pb.LoadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.LoadLoRAAdapterResponse:
        return await self._engine.unary("LoadLoRAAdapter", request, metadata, timeout)

    async def UnloadLoRAAdapter(
        self, request: pb.UnloadLoRAAdapterRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.UnloadLoRAAdapterResponse:
        return await self._engine.unary("UnloadLoRAAdapter", request, metadata, timeout)

    async def Sleep(
        self, request: pb.SleepRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        return await self._engine.unary("Sleep", request, metadata, timeout)

    async def WakeUp(
        self, request: pb.WakeUpRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        return await self._engine.unary("WakeUp", request, metadata, timeout)

    async def IsSleeping(
        self, request: pb.IsSleepingRequest, metadata: Metadata | None = None, timeout: float | None = None
    ) -> pb.SleepResponse:
        return await self._engine.unary("IsSleeping", request, metadata, timeout)


if __name__ == "__main__":  # run as the module of its name, so that what crosses the link pickles by that name
    from raypaged.serving.engine_process import main as engine_main

    engine_main()
