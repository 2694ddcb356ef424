"""The HTTP gateway's listening socket, kept from running the process out of file descriptors.

Every open connection is a descriptor. When a flood of connections took the last ones, requests already
accepted failed for want of one (a lazily imported module could not be read: a 500), and asyncio's accept
loop logged one error per attempt, a few thousand a second (about 180,000 log lines in 15 s at 400
connections under a limit of 256). So the soft limit is raised as far as the hard one allows
(``raise_open_files_limit``, as vLLM does at start), and ``GuardedListener`` accepts a connection only while
``connection_reserve`` descriptors stay free for the process: past that, connections wait in the kernel's
queue (the listen backlog) until others close, as nginx does at its connection limit, and asyncio tries
again each second, logging once."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import time
from typing import Any

logger = logging.getLogger("raypaged")

OPEN_FILES_TARGET = 65535  # the soft limit raised at start (vLLM's), where the hard limit allows it
_PAUSE_S = 0.5  # after asyncio is told there is no room, its remaining tries of that turn find none waiting


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> int:
    """The soft limit on open files raised to ``target`` (no further than the hard limit); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-files limit from %d to %d: %s", soft, wanted, exc)
            return soft
        logger.info("open-files limit raised from %d to %d", soft, wanted)
        return wanted
    return soft


def connection_reserve(limit: int) -> int:
    """Descriptors kept for the process besides its connections: an eighth of ``limit``, 64 to 1,024 (at most
    half of a small limit)."""
    return min(limit // 2, max(64, min(1024, limit // 8)))


class GuardedListener(socket.socket):
    """A listening socket whose ``accept`` takes a connection only where its descriptor would be below
    ``max_fd`` (the open-files limit less ``connection_reserve``). Where it would not, or the limit is reached,
    it raises ``EMFILE`` once: asyncio then stops accepting for a second and tries again, and the connections
    wait in the listen backlog meanwhile. Its other tries of the same turn find nothing waiting, so asyncio
    logs one error, not one per waiting connection."""

    def __init__(self, family: int, kind: int, proto: int = 0) -> None:
        super().__init__(family, kind, proto)
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = OPEN_FILES_TARGET if limit == resource.RLIM_INFINITY else limit
        self.max_fd = limit - connection_reserve(limit)  # a connection's descriptor must be below this
        self._paused_until = 0.0

    def accept(self) -> tuple[socket.socket, Any]:
        if time.monotonic() < self._paused_until:
            raise BlockingIOError(errno.EAGAIN, "accepting paused: no room for another connection")
        if self._lowest_free_fd() < self.max_fd:
            try:
                return super().accept()
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
        self._paused_until = time.monotonic() + _PAUSE_S
        raise OSError(
            errno.EMFILE,
            f"no room for another connection: descriptors {self.max_fd} and above are kept for the server's own "
            "use, so new connections wait until others close (raise the open-files limit, ulimit -n, to serve "
            "more at once)",
        )

    def _lowest_free_fd(self) -> int:
        """The descriptor a connection accepted now would get (the lowest free one); the limit when none is."""
        try:
            probe = os.dup(self.fileno())
        except OSError:
            return self.max_fd
        os.close(probe)
        return probe
