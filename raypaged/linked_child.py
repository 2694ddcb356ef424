"""A child process linked to its parent by a socket pair: ``python -m MODULE FD``, FD the child's end.

A fresh interpreter, not a ``multiprocessing`` child: with the spawn method that would run the user's
script again, and with fork it would copy the server's threads' locks."""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import IO


def start_linked(
    module: str, env: dict[str, str] | None = None, stdin: int | IO[bytes] | None = None
) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """Start ``module`` with the child's end of a new socket pair as its one argument; returns this
    process's end and the child."""
    ours, theirs = socket.socketpair()
    with theirs:
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", module, str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env, stdin=stdin
            )
        except BaseException:
            ours.close()
            raise
    return ours, process
