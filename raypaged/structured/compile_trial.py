"""A grammar compiled first in a child process that is killed past ``max_compile_s``.

xgrammar's compile cannot be stopped once it runs, and a small constraint can take minutes: a JSON schema's
``"pattern": "^[a-z]{1,50000}$"`` took 392 s here, ``([a-z]{1,60}){1,60}`` 102 s. In the server's thread it would
hold a compile slot (one on two cores) and a core for all that time, and every other request with a new
constraint would wait behind it. A compiled grammar is too large to send back from another process (xgrammar's
``serialize_json`` of a 1,000-property schema is 636 MB and 42 s), so the child only tries: it builds and
compiles the constraint, says it is done, and drops the result; the server then compiles it itself, knowing how
long that takes. A child that is not done within the limit is killed, and the request is refused.

One child per compile slot serves every model of this process (it keeps a compiler for each tokenizer it was
sent); the first starts with the first constraint to compile, about 3 s (Python, xgrammar and torch). A child is
a new interpreter running this module (not a ``multiprocessing`` child, which would run the user's script
again), talking over a socket pair.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from raypaged.linked_child import start_linked

if TYPE_CHECKING:
    import xgrammar

    from raypaged.sampling_params import StructuredOutputsParams

_IDLE: list[_Child] = []  # started children waiting for a compile
_IDLE_LOCK = threading.Lock()
START_S = 120.0  # the most a child may take to start (it imports xgrammar, and torch with it)


class CompileTooSlow(Exception):
    """The trial did not finish within the limit (its child was killed), or its child died."""


@dataclass(slots=True)
class _Child:
    process: subprocess.Popen[bytes]
    connection: Connection
    tokenizers: set[str] = field(default_factory=set)  # the tokenizers' keys it holds a compiler for


@dataclass(slots=True, frozen=True)
class Tokenizer:
    """A tokenizer as a child takes it: xgrammar's ``TokenizerInfo`` as JSON, and a key naming it."""

    info_json: str
    key: str

    @classmethod
    def of(cls, info: xgrammar.TokenizerInfo) -> Tokenizer:
        text = info.serialize_json()
        return cls(text, hashlib.sha256(text.encode()).hexdigest())


def try_compile(
    tokenizer: Tokenizer,
    params: StructuredOutputsParams,
    any_whitespace: bool,
    max_whitespace: int | None,
    reasoning: str | None,
    limit_s: float,
) -> None:
    """Build and compile the constraint in a child; raise :class:`CompileTooSlow` if that takes more than
    ``limit_s`` seconds. A constraint that does not compile is no concern here: the server's own compile says
    why."""
    child = _take()
    deadline = time.monotonic() + limit_s
    try:
        info = None if tokenizer.key in child.tokenizers else tokenizer.info_json
        child.connection.send((tokenizer.key, info, params, any_whitespace, max_whitespace, reasoning))
        child.tokenizers.add(tokenizer.key)
        done = child.connection.poll(max(0.0, deadline - time.monotonic()))
        if done:
            child.connection.recv()
    except (EOFError, OSError):
        done = False
    if not done:
        _kill(child)
        threading.Thread(target=_start_spare, name="raypaged-grammar-trial-start", daemon=True).start()
        raise CompileTooSlow
    with _IDLE_LOCK:
        _IDLE.append(child)


def _take() -> _Child:
    with _IDLE_LOCK:
        while _IDLE:
            child = _IDLE.pop()
            if child.process.poll() is None:
                return child
            _kill(child)
    return _start()


def _start_spare() -> None:
    """A child started for the next compile, in place of one killed (so that compile does not wait for it)."""
    try:
        child = _start()
    except RuntimeError:
        return  # the next compile starts one, and says why it could not
    with _IDLE_LOCK:
        _IDLE.append(child)


def _start() -> _Child:
    ours, process = start_linked(__name__, stdin=subprocess.DEVNULL)
    connection = Connection(ours.detach())
    child = _Child(process, connection)
    answered = connection.poll(START_S)  # "ready", or the end of a child that exited
    if not answered or not _ready(connection):
        exit_code = _exit_code(process) if answered else None
        _kill(child)
        why = f"exited with code {exit_code}" if exit_code is not None else f"did not start within {START_S:g} s"
        raise RuntimeError(
            f"the process that tries grammars before they compile {why} (its error is in the server's log); "
            "max_compile_s: null in --structured-outputs-config compiles without it"
        )
    return child


def _exit_code(process: subprocess.Popen[bytes]) -> int | None:
    """The code of a child that closed its end; its socket closes a moment before the kernel reports it exited."""
    try:
        return process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None


def _ready(connection: Connection) -> bool:
    try:
        return connection.recv() == "ready"
    except (EOFError, OSError):
        return False


def _kill(child: _Child) -> None:
    child.process.kill()
    child.process.wait()
    child.connection.close()


def _serve(connection: Connection) -> None:
    """The child: compile each constraint it is sent, answer when done (whatever the outcome)."""
    import xgrammar as xgr

    from raypaged.structured.backend import GrammarBackend
    from raypaged.structured.reasoning import get_reasoning_parser

    compilers: dict[str, xgr.GrammarCompiler] = {}
    connection.send("ready")
    while True:
        try:
            key, info, params, any_whitespace, max_whitespace, reasoning = connection.recv()
        except EOFError:
            return
        if info is not None:
            tokenizer_info = xgr.TokenizerInfo.deserialize_json(info)
            compilers[key] = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        try:
            grammar: Any = GrammarBackend.build(params, any_whitespace, max_whitespace)
            if reasoning is not None:
                grammar = get_reasoning_parser(reasoning).after_section(grammar)
            compilers[key].compile_grammar(grammar)
        except Exception:  # noqa: BLE001 - the server's own compile reports it
            pass
        connection.send(None)


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
