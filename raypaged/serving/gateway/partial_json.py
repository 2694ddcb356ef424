"""The value of a JSON text that may be cut short, as the Anthropic SDK's stream helper reads a ``tool_use`` block's
streamed ``input_json_delta`` s (``jiter.from_json(..., partial_mode=True)``): open objects and arrays keep what was
whole in them, and a value still being written at the cut (a string, a literal, a number such as ``12.``) is left
out together with its key.
"""

from __future__ import annotations

import json
import re
from typing import Any

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]+")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*"', re.DOTALL)
_LITERALS = {"true": True, "false": False, "null": None}
_CUT = object()  # a value the text ends inside


class _Cut(Exception):
    """The text ended inside a container, whose partial value is ``value``."""

    def __init__(self, value: Any) -> None:
        self.value = value


def parse_partial(text: str) -> Any:
    """The value of ``text``, a JSON text or a prefix of one; ``ValueError`` if it is neither (or empty)."""
    try:
        value, end = _value(text, _skip(text, 0))
    except _Cut as cut:
        return cut.value
    if value is _CUT:
        raise ValueError("no whole JSON value")
    if _skip(text, end) != len(text):
        raise ValueError(f"extra data at {end}")
    return value


def _skip(text: str, at: int) -> int:
    match = _WHITESPACE.match(text, at)
    assert match is not None  # matches the empty string
    return match.end()


def _value(text: str, at: int) -> tuple[Any, int]:
    if at == len(text):
        return _CUT, at
    head = text[at]
    if head == "{":
        return _object(text, at + 1)
    if head == "[":
        return _array(text, at + 1)
    if head == '"':
        return _string(text, at)
    for word, value in _LITERALS.items():
        if text.startswith(word, at):
            return value, at + len(word)
        if word.startswith(text[at:]):
            return _CUT, len(text)
    run = _NUMBER_CHARS.match(text, at)
    if run is None:
        raise ValueError(f"unexpected {head!r} at {at}")
    number = _NUMBER.match(text, at)
    if run.end() == len(text) and (number is None or number.end() != len(text)):
        return _CUT, len(text)  # a number still being written: "-", "12.", "1e"
    if number is None:
        raise ValueError(f"bad number at {at}")
    return json.loads(number.group()), number.end()


def _string(text: str, at: int) -> tuple[Any, int]:
    if _STRING_BODY.match(text, at + 1) is None:
        return _CUT, len(text)  # no closing quote yet
    try:
        return json.decoder.scanstring(text, at + 1)  # type: ignore[attr-defined]
    except json.JSONDecodeError as error:
        raise ValueError(error.msg) from None


def _object(text: str, at: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    at = _skip(text, at)
    if text.startswith("}", at):
        return out, at + 1
    while True:
        if at == len(text):
            raise _Cut(out)
        if text[at] != '"':
            raise ValueError(f"expected a key at {at}")
        key, at = _string(text, at)
        at = _skip(text, at)
        if key is _CUT or at == len(text):
            raise _Cut(out)
        if text[at] != ":":
            raise ValueError(f"expected ':' at {at}")
        value, at = _inner(text, _skip(text, at + 1), out, key)
        out[key] = value
        at = _skip(text, at)
        if at == len(text):
            raise _Cut(out)
        if text[at] == "}":
            return out, at + 1
        if text[at] != ",":
            raise ValueError(f"expected ',' or '}}' at {at}")
        at = _skip(text, at + 1)


def _array(text: str, at: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    at = _skip(text, at)
    if text.startswith("]", at):
        return out, at + 1
    while True:
        value, at = _inner(text, at, out, None)
        out.append(value)
        at = _skip(text, at)
        if at == len(text):
            raise _Cut(out)
        if text[at] == "]":
            return out, at + 1
        if text[at] != ",":
            raise ValueError(f"expected ',' or ']' at {at}")
        at = _skip(text, at + 1)


def _inner(text: str, at: int, container: dict[str, Any] | list[Any], key: str | None) -> tuple[Any, int]:
    """A value inside ``container``; a cut inside it ends ``container`` with what was whole."""
    try:
        value, end = _value(text, at)
    except _Cut as cut:
        if key is None:
            assert isinstance(container, list)
            container.append(cut.value)
        else:
            assert isinstance(container, dict)
            container[key] = cut.value
        raise _Cut(container) from None
    if value is _CUT:
        raise _Cut(container)
    return value, end
