"""A generation request's engine calls at the gateway: its slot (the drain's count and the tenant's slots),
the calls started and accepted, their responses merged, cancelled when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from functools import partial
from typing import TypeVar

import grpc
from fastapi import Request

from raypaged.serving.client import EngineClient, Metadata, StreamCall
from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.tenants import TenantGate
from raypaged.serving.messages import AnyResponse
from raypaged.serving.proto import generate_pb2 as pb

_DISCONNECT_POLL_S = 0.2
T = TypeVar("T")


class Slot:
    """A request's place at the gateway: counted by the drain, then holding one tenant slot per prompt once admitted."""

    def __init__(self, gate: TenantGate, drain: Drain) -> None:
        self.gate = gate
        self._drain = drain
        self._num_slots = 0  # tenant slots held
        self._released = False
        drain.enter()

    async def admit(self, num_slots: int) -> None:
        await self.gate.admit(num_slots=num_slots)
        self._num_slots = num_slots

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._num_slots:
            self.gate.release(num_slots=self._num_slots)
        self._drain.leave()


def header_request_id(http: Request) -> str | None:
    """The client's ``X-Request-Id``, when it is a usable id (printable ASCII, at most 256 characters)."""
    found = http.headers.get("x-request-id")
    if found is None:
        return None
    if not 0 < len(found) <= 256 or not all(0x21 <= ord(c) <= 0x7E for c in found):
        raise APIError(400, "X-Request-Id must be 1 to 256 printable ASCII characters without spaces", "X-Request-Id")
    return found


def metadata(http: Request) -> Metadata | None:
    """gRPC metadata for the engine calls made for ``http``: the client's ``Authorization``, when sent."""
    authorization = http.state.authorization
    if authorization is None:
        return None
    if not all(" " <= c <= "~" for c in authorization):  # all that gRPC metadata can carry
        raise APIError(401, "Incorrect API key provided: the Authorization header must be printable ASCII")
    return (("authorization", authorization),)


async def admit(slot: Slot, http: Request, num_requests: int, drain: Drain) -> Metadata | None:
    """The engine calls' metadata for ``http``, once ``slot`` holds a tenant slot for each of ``num_requests``
    (a drain that has expired meanwhile refuses them)."""
    engine_metadata = metadata(http)
    await slot.admit(num_requests)
    if drain.expired.is_set():
        raise drain.expiry_error()
    return engine_metadata


async def start(
    slot: Slot, http: Request, stub: EngineClient, requests: list[pb.GenerateRequest], drain: Drain
) -> list[StreamCall]:
    """The requests' calls, once ``slot`` holds a tenant slot for each and the engine has accepted each (its
    first response); the calls are cancelled if that fails."""
    engine_metadata = await admit(slot, http, len(requests), drain)
    calls = [stub.Generate(r, metadata=engine_metadata) for r in requests]
    try:
        for call in calls:  # the first message says the engine accepted the request
            await call.read()
    except BaseException:
        cancel(calls)
        raise
    return calls


def _tagged(
    put: Callable[[tuple[int, AnyResponse | Exception | None]], None], index: int, item: AnyResponse | Exception | None
) -> None:
    put((index, item))


def cancel(calls: list[StreamCall]) -> None:
    for call in calls:
        call.cancel()


async def merged_responses(calls: list[StreamCall], drain: Drain) -> AsyncGenerator[tuple[int, AnyResponse], None]:
    """Every call's responses as they come, tagged with the call's index; cancels them all when left.

    Raises the drain's expiry error if the drain timeout expires first.
    """
    queue: asyncio.Queue[tuple[int, AnyResponse | Exception | None]] = asyncio.Queue()

    async def pump(index: int, call: StreamCall) -> None:
        try:
            while (response := await call.read()) is not grpc.aio.EOF:
                queue.put_nowait((index, response))
        except grpc.aio.AioRpcError as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    async def expire() -> None:
        await drain.expired.wait()
        queue.put_nowait((-1, drain.expiry_error()))

    tasks = [asyncio.create_task(expire())]
    for index, call in enumerate(calls):
        # a ForwardingCall (in process, or over the engine process's link) hands its responses to the queue;
        # isinstance against the runtime-checkable protocol would cost more than the rest of this per request
        forward: Callable[[Callable[..., None]], None] | None = getattr(call, "forward", None)
        if forward is not None:
            forward(partial(_tagged, queue.put_nowait, index))
        else:
            tasks.append(asyncio.create_task(pump(index, call)))
    try:
        remaining = len(calls)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        cancel(calls)


async def all_answered(calls: list[Awaitable[T]], drain: Drain) -> list[T]:
    """Every unary call's answer, the calls running at once; the first to fail, or the drain's expiry, cancels
    the others and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    expiry = asyncio.ensure_future(_expiry(drain))
    pending: set[asyncio.Future] = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait({*pending, expiry}, return_when=asyncio.FIRST_COMPLETED)
            pending.discard(expiry)
            failures = [task.exception() for task in done]  # each failure read (none is left unretrieved)
            for failure in failures:
                if failure is not None:
                    raise failure
        return [task.result() for task in tasks]
    finally:
        for task in (*tasks, expiry):
            task.cancel()


async def _expiry(drain: Drain) -> None:
    await drain.expired.wait()
    raise drain.expiry_error()


async def unless_disconnected(http: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client goes away first, cancel it (which aborts the requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                raise APIError(400, "client disconnected")
    finally:
        task.cancel()
