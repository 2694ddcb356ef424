"""Pythonic tool calls (Llama 3.2/4 style): the output is ``[get_weather(city="Paris"), f()]``,
keyword arguments of Python literals."""

from __future__ import annotations

import ast
import json

from raypaged.serving.gateway.tool_parsers.base import ToolCall, ToolParser
from raypaged.serving.gateway.tool_parsers.streamed import BuiltArguments, BuiltScanner


class PythonicParser(ToolParser):
    name = "pythonic"

    def section_start(self, text: str) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith("[") else None

    def holdback(self, text: str) -> int:
        return len(text) if not text.strip() else 0

    def parse_section(self, section: str) -> list[ToolCall]:
        tree = ast.parse(section.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("no tool call")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError("a tool call takes keyword arguments only")
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def scanner(self) -> PythonicScanner:
        return PythonicScanner()


class PythonicScanner(BuiltScanner):
    """Reads ``[name(key=value, ...), ...]`` as it is written, each character once: a call's name once it is
    sure to be one (its first ``key=``, or its ``)`` with nothing in it: an answer in brackets, ``[see (below)]``,
    announces no call), each argument once its value ends (at a ``,`` or ``)`` outside strings and brackets).
    Text before the ``[`` (Llama 4's ``<|python_start|>``) and after the ``]`` is passed over."""

    def __init__(self) -> None:
        super().__init__()
        self._at = 0  # the next character to read
        self._depth = 0  # brackets open: 1 in the list, 2 in a call's parentheses
        self._quote: str | None = None  # the open string's quote (' " \'\'\' or """)
        self._escape = False
        self._start: int | None = None  # where the name (in the list) or the key (in a call) begins
        self._key: str | None = None  # in a call: the argument whose value is being read
        self._value_start = 0
        self._name: str | None = None  # the open call's name, sent once it is sure to be a call
        self._built = BuiltArguments()  # the open call's arguments

    def feed(self, chunk: str) -> None:
        self.text += chunk
        text = self.text
        while self._at < len(text):
            i, c = self._at, text[self._at]
            if self._depth < 0:  # the list ended (or was not one of calls): nothing after it is read
                self._at = len(text)
                return
            if self._quote is not None:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif text.startswith(self._quote, i):
                    self._at += len(self._quote) - 1
                    self._quote = None
                elif len(self._quote) == 3 and c == self._quote[0] and len(text) - i < 3:
                    return  # a quote that may close a triple-quoted string: wait for what follows
            elif c in "'\"":
                if len(text) - i < 3 and text[i:] == c * (len(text) - i):
                    return  # an empty string or a triple quote: wait for what follows
                self._quote = c * 3 if text.startswith(c * 3, i) else c
                self._at += len(self._quote) - 1
            elif self._depth == 0:
                if c == "[":
                    self._depth, self._start = 1, None
            elif self._depth == 1:
                self._in_list(i, c)
            elif self._depth == 2:
                self._in_call(i, c)
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
            self._at += 1

    def _in_list(self, i: int, c: str) -> None:
        if c == "(":
            name = self.text[self._start if self._start is not None else i : i].strip()
            self._name = name if name.isidentifier() else None
            self._built = self.open_call(None)
            self._depth, self._start, self._key = 2, i + 1, None
        elif c in "[]{)}":
            self._depth = -1  # the list ended, or is not one of calls
        elif c == ",":
            self._start = None
        elif self._start is None and not c.isspace():
            self._start = i

    def _in_call(self, i: int, c: str) -> None:
        arguments = self._built
        if c in "([{":
            self._depth += 1
        elif c in ",)":
            if self._key is not None:
                self._argument(self.text[self._value_start : i])
            elif self.text[self._start or i : i].strip():
                arguments.broken = True  # a positional argument
            elif c == ")" and not arguments.whole:
                self._announce()  # no arguments
            if c == ")":
                self.close_call()
                self._depth = 1
            self._start, self._key = None if c == ")" else i + 1, None
        elif c == "=" and self._key is None:
            key = self.text[self._start or i : i].strip()
            if not key.isidentifier():
                arguments.broken = True
            elif not arguments.whole:
                self._announce()
            self._key, self._value_start = key, i + 1
        elif c in "]}":
            arguments.broken = True

    def _announce(self) -> None:
        """The open call is one: its name is sent (unless it is not one a call can have)."""
        if not self._built.broken:
            self.calls[-1].name = self._name

    def _argument(self, value: str) -> None:
        arguments = self._built
        try:
            literal = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            arguments.broken = True
            return
        assert self._key is not None
        arguments.add(self._key, literal)
