"""gpt-oss's harmony format, read from an output's text (the engine keeps its special tokens in it).

An output continues a prompt that ends with ``<|start|>assistant``. It is messages, each a header, ``<|message|>``,
its text and an end: ``<|end|>`` (then ``<|start|>assistant`` opens the next), ``<|return|>`` (the answer is
done), ``<|call|>`` (a tool call is done) or ``<|endoftext|>``; the end of the output ends its last message
(the engine may keep a stop token's text or not). A header names the
message's channel and, for a tool call, its recipient and content type, in either order:
``<|channel|>commentary to=functions.get_weather <|constrain|>json`` or
``to=functions.get_weather<|channel|>commentary json``.

- ``analysis`` messages are reasoning;
- ``final`` messages, and ``commentary`` ones to no recipient (preambles), are the answer's content;
- a message to ``functions.NAME`` calls the tool NAME, its text the arguments;
- the others (to built-in tools, other channels) are neither.

An output that does not open with a header (one constrained from its first token) is all content. No marker is
ever part of a message's text: one inside a text ends the message (``<|start|>``, ``<|channel|>`` open the next),
or is dropped (``<|message|>``, ``<|constrain|>``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL, END_OF_TEXT = "<|constrain|>", "<|return|>", "<|call|>", "<|endoftext|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, END_OF_TEXT)
FUNCTIONS = "functions."
_OPENINGS = ("<|", "to=")  # how a header can begin (the recipient may come before the channel)
_ANY_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)([^<]*)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_CONSTRAINT = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")

Kind = Literal["reasoning", "content", "call", "other"]


@dataclass(frozen=True, slots=True)
class Header:
    channel: str | None
    recipient: str | None
    content_type: str | None  # ``json`` (after ``<|constrain|>`` or the channel), or None

    @classmethod
    def parse(cls, text: str) -> Header:
        """The header ``text`` (markers and all) before a ``<|message|>``."""
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text)
        constraint = _CONSTRAINT.search(text)
        content_type = constraint.group(1) if constraint else None
        if content_type is None and channel is not None:  # "commentary json"
            content_type = next((w for w in channel.group(2).split() if not w.startswith("to=")), None)
        return cls(channel.group(1) if channel else None, recipient.group(1) if recipient else None, content_type)

    @property
    def kind(self) -> Kind:
        if self.recipient is not None and self.recipient.startswith(FUNCTIONS):
            return "call"
        if self.channel == "analysis":
            return "reasoning"
        if self.channel == "final" or (self.channel == "commentary" and self.recipient is None):
            return "content"
        return "other"


PLAIN = Header("final", None, None)  # an output that does not open with a header is all answer


@dataclass(frozen=True, slots=True)
class Piece:
    """Text of the ``number``-th message (from 0), whose header is ``header``."""

    number: int
    header: Header
    text: str


def opening(text: str) -> bool | None:
    """Whether an output that begins with ``text`` opens with a header; ``None``: too short to tell."""
    body = text.lstrip()
    if body.startswith(_OPENINGS):
        return True
    return None if any(o.startswith(body) for o in _OPENINGS) else False


def held_back(text: str, markers: tuple[str, ...] = MARKERS) -> int:
    """The length of the longest end of ``text`` that begins one of ``markers`` (and could still become it)."""
    for size in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


class HarmonyReader:
    """Reads an output as it grows: ``feed`` gives the message text now sure, a marker split across deltas held
    back until it is whole and a header until its ``<|message|>``; ``finish`` gives the rest."""

    def __init__(self) -> None:
        self._pending = ""  # text not read yet: a header so far, or the end of a text that could begin a marker
        self._header: Header | None = None  # the open message's; None while a header is read
        self._number = -1  # the open message's number
        self._opened: bool | None = None  # the output opens with a header (None: not known yet)

    def feed(self, delta: str) -> list[Piece]:
        self._pending += delta
        if self._opened is None:
            self._opened = opening(self._pending)
        if self._opened is None:
            return []
        if self._opened:
            return self._read(final=False)
        text, self._pending = self._pending, ""
        return [Piece(0, PLAIN, text)] if text else []

    def finish(self) -> list[Piece]:
        if self._opened is None and self._pending.strip():  # text that could have begun a header, and did not
            self._opened = False
        if self._opened is None:  # whitespace only
            return []
        return self._read(final=True) if self._opened else self.feed("")

    def _read(self, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            if self._header is None:
                at = self._pending.find(MESSAGE)
                if at < 0:
                    if final:
                        self._pending = ""  # a header that never opened its message holds no text
                    return pieces
                self._header, self._number = Header.parse(self._pending[:at]), self._number + 1
                self._pending = self._pending[at + len(MESSAGE) :]
            found = _ANY_MARKER.search(self._pending)
            if found is None:
                safe = len(self._pending) if final else len(self._pending) - held_back(self._pending)
                if safe:
                    pieces.append(Piece(self._number, self._header, self._pending[:safe]))
                self._pending = self._pending[safe:]
                return pieces
            if found.start():
                pieces.append(Piece(self._number, self._header, self._pending[: found.start()]))
            marker = found.group()
            if marker in (MESSAGE, CONSTRAIN):  # stray in a text: dropped
                self._pending = self._pending[found.end() :]
                continue
            self._header = None  # the message ends; <|channel|> is already the next one's header
            self._pending = self._pending[found.start() if marker == CHANNEL else found.end() :]


class HarmonySplit:
    """(reasoning, content) of an output, as deltas while it grows; the texts of two messages of one kind are
    joined by a newline (as vLLM joins them)."""

    def __init__(self) -> None:
        self._reader = HarmonyReader()
        self._last: dict[Kind, int] = {}  # the last message of each kind with text

    def feed(self, delta: str) -> tuple[str, str]:
        return self._parts(self._reader.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._parts(self._reader.finish())

    def _parts(self, pieces: list[Piece]) -> tuple[str, str]:
        parts: dict[Kind, str] = {"reasoning": "", "content": ""}
        for piece in pieces:
            kind = piece.header.kind
            if kind not in parts or not piece.text:
                continue
            last = self._last.get(kind)
            if last is not None and last != piece.number:
                parts[kind] += "\n"
            parts[kind] += piece.text
            self._last[kind] = piece.number
        return parts["reasoning"], parts["content"]


def split(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; ``None`` for a part that is not there."""
    stream = HarmonySplit()
    reasoning, content = stream.feed(text)
    more, rest = stream.finish()
    return reasoning + more or None, content + rest or None


def calls(text: str) -> list[tuple[str, str]]:
    """(tool name, arguments) of each tool call of a whole output. JSON arguments (the content type is ``json``
    or not given) are written anew, as vLLM does; others are the message's text as it is."""
    reader = HarmonyReader()
    found: dict[int, tuple[Header, str]] = {}
    for piece in reader.feed(text) + reader.finish():
        if piece.header.kind == "call":
            header, body = found.get(piece.number, (piece.header, ""))
            found[piece.number] = header, body + piece.text
    return [((header.recipient or "")[len(FUNCTIONS) :], _arguments(header, body)) for header, body in found.values()]


def _arguments(header: Header, body: str) -> str:
    if header.content_type is not None and "json" not in header.content_type:
        return body
    try:
        return json.dumps(json.loads(body), ensure_ascii=False)
    except ValueError:
        return body
