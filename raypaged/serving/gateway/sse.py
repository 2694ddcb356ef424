"""Server-sent event streams: the response that carries them, and keep-alive comments while one is idle."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it; proxies see the connection in use
_encode = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(ensure_ascii=False) builds one per call


def sse_data(data: dict | str) -> str:
    """One ``data:`` event: a JSON object, or text as it is (``[DONE]``)."""
    return f"data: {data if isinstance(data, str) else _encode(data)}\n\n"


class EventStream(StreamingResponse):
    """Server-sent events; ``cleanup`` runs however the response ends, even before its first event. With
    ``keep_alive_s`` (vLLM's ``--sse-keep-alive-interval``), a stream with no event for that long sends a
    keep-alive comment, and again after each further such wait."""

    def __init__(
        self,
        events: AsyncIterator[str],
        cleanup: Callable[[], object],
        headers: dict[str, str] | None = None,
        keep_alive_s: float = 0.0,
    ) -> None:
        super().__init__(
            keep_alive(events, keep_alive_s) if keep_alive_s > 0 else events,
            media_type="text/event-stream",
            headers=headers,
        )
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


async def keep_alive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """``events``, with ``KEEP_ALIVE`` after every ``interval_s`` without one; ``events`` is closed when this is."""
    source = aiter(events)
    pending: asyncio.Future[str] = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(anext(source))
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        if hasattr(source, "aclose"):
            await source.aclose()
