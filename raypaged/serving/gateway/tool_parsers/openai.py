"""gpt-oss (harmony, ``raypaged.structured.harmony``): a call is a message to ``functions.NAME``,
``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>``; the
content is the final channel's text and the preambles (commentary to no one); analysis is the reasoning parser's.
"""

from __future__ import annotations

from raypaged.serving.gateway.tool_parsers.base import StreamingToolCalls, ToolCall, ToolParser
from raypaged.serving.gateway.tool_parsers.streamed import ScannedCall, StreamedCalls
from raypaged.structured import harmony


class OpenAIParser(ToolParser):
    """Reads the whole output (calls may follow reasoning and preambles): an output that opens with a harmony
    header is all section, one that does not (constrained from its first token) all content."""

    name = "openai"
    reasoning_parser = "openai_gptoss"

    def section_start(self, text: str) -> int | None:
        return 0 if harmony.opening(text) else None

    def holdback(self, text: str) -> int:
        return len(text) if harmony.opening(text) is None else 0

    def parse_section(self, section: str) -> list[ToolCall]:
        calls = [ToolCall(name, arguments) for name, arguments in harmony.calls(section)]
        if not calls:
            raise ValueError("no tool call")
        return calls

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls): the content is the final channel's text and the preambles."""
        try:
            calls = self.parse_section(text)
        except ValueError:
            calls = []
        return harmony.split(text)[1], calls

    def scanner(self) -> HarmonyScanner:
        return HarmonyScanner()

    def stream(self) -> StreamingToolCalls:
        return HarmonyToolCalls(self, StreamedCalls(self.scanner()))


class HarmonyScanner:
    """Reads the calls as the output is written: a call's name once its header is whole, its arguments as the
    model writes them."""

    def __init__(self) -> None:
        self.calls: list[ScannedCall] = []
        self._reader = harmony.HarmonyReader()
        self._numbers: dict[int, ScannedCall] = {}  # the call of each message that is one, by its number
        self._texts: dict[int, str] = {}  # each call's arguments so far, by id()

    def feed(self, chunk: str) -> None:
        for piece in self._reader.feed(chunk):
            if piece.header.kind != "call":
                continue
            call = self._numbers.get(piece.number)
            if call is None:
                call = self._numbers[piece.number] = ScannedCall(
                    (piece.header.recipient or "")[len(harmony.FUNCTIONS) :]
                )
                self.calls.append(call)
            self._texts[id(call)] = self._texts.get(id(call), "") + piece.text

    def arguments(self, call: ScannedCall) -> str:
        return self._texts.get(id(call), "")


class HarmonyToolCalls(StreamingToolCalls):
    """One streamed output: content as its messages come, the calls as they are written."""

    def __init__(self, parser: ToolParser, calls: StreamedCalls) -> None:
        super().__init__(parser, calls)
        self._split = harmony.HarmonySplit()

    def feed(self, delta: str) -> str:
        self.text += delta
        if self._section is None and harmony.opening(self.text):
            self._section = 0  # the whole output is read for calls
        return self._split.feed(delta)[1]

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._split.finish()[1], self.parser.extract(self.text)[1]
