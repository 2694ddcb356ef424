"""Graceful shutdown of the gateway: refuse new requests, let in-flight ones finish, end the rest.

Once a drain begins, ``/health`` and every new request answer 503. Requests
already admitted get ``timeout_s`` to finish; then ``expired`` is set, which
ends each of them (its engine calls are cancelled, so the engine aborts it and
frees its KV blocks; a stream ends with an error event and ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from raypaged.serving.gateway.errors import APIError

logger = logging.getLogger("raypaged")

DRAINING_MESSAGE = "the server is draining: it is shutting down and accepts no new requests"
_AFTER_EXPIRY_WAIT_S = 5.0  # for aborted requests to send their last event


class Drain:
    """Counts the gateway's in-flight requests; ``run()`` drains them (once)."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"--drain-timeout must be at least 0 seconds, got {timeout_s:g}")
        self.timeout_s = timeout_s
        self.draining = False
        self.num_in_flight = 0
        self.expired = asyncio.Event()  # set when in-flight requests must end now
        self._idle = asyncio.Event()
        self._idle.set()

    def refusal(self) -> APIError:
        return APIError(503, DRAINING_MESSAGE, code="server_draining")

    def expiry_error(self) -> APIError:
        return APIError(
            503,
            f"the server shut down before this request finished (drain timeout {self.timeout_s:g} s)",
            code="server_draining",
        )

    def enter(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    def expire(self) -> None:
        """End every in-flight request now (a second signal during a drain)."""
        self.expired.set()

    async def run(self) -> None:
        """Refuse new requests, wait up to ``timeout_s`` for in-flight ones, then end those left."""
        self.draining = True
        logger.info("draining: %d requests in flight, waiting up to %g s for them", self.num_in_flight, self.timeout_s)
        try:
            await asyncio.wait_for(self._wait_idle_or_expired(), self.timeout_s)
        except asyncio.TimeoutError:
            pass
        if self.num_in_flight:
            logger.warning("drain timeout: aborting %d requests still running", self.num_in_flight)
            self.expired.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), _AFTER_EXPIRY_WAIT_S)
        logger.info("drained")

    async def _wait_idle_or_expired(self) -> None:
        idle = asyncio.ensure_future(self._idle.wait())
        expired = asyncio.ensure_future(self.expired.wait())
        try:
            await asyncio.wait({idle, expired}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
            expired.cancel()
