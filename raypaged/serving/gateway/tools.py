"""OpenAI tools on chat completions: the request's ``tools`` and ``tool_choice``, the constraint
that makes ``required`` and a named function always valid, and the tool calls in an output.

- ``none``: the template sees the tools; the output is content.
- ``auto``: the output is parsed by ``--tool-call-parser`` (needs ``--enable-auto-tool-choice``).
- ``required``: the output is a JSON array of ``{"name", "parameters"}``, one of the tools each,
  enforced while decoding (at most one with ``parallel_tool_calls: false``).
- a named function: the output is that function's arguments, enforced by its schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.tool_parsers import StreamingToolCalls, ToolCall, ToolParser
from raypaged.serving.gateway.tool_parsers.streamed import CallScanner, StreamedCalls
from raypaged.serving.proto import generate_pb2 as pb

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced whenever the call is (required, named)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list[Tool]
    mode: Literal["none", "auto", "required", "named"]
    parser: ToolParser | None = None  # auto
    function: str | None = None  # named
    parallel: bool = True

    @classmethod
    def of(
        cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool, parser: ToolParser | None
    ) -> ToolPlan | None:
        """The request's plan (``None`` without tools); what cannot be honoured is a 400."""
        if not tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, f"tools must have distinct function names, got {names}", "tools")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(
                    400, f"tool_choice names function {choice.function.name!r}, which is not in tools", "tool_choice"
                )
            return cls(tools, "named", function=choice.function.name, parallel=parallel)
        mode = choice or "auto"
        if mode == "auto" and parser is None:
            raise APIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        if mode != "auto" or parser is None:
            return cls(tools, mode, parallel=parallel)
        # the parser reads this request's tools' parameter schemas (GLM-4.5's and Qwen3-Coder's typed values)
        parameters = {t.function.name: t.function.parameters for t in tools}
        return cls(tools, mode, parser=parser.for_tools(parameters), parallel=parallel)

    def tools_json(self) -> str:
        return tools_json(self.tools)

    def constraint(self) -> pb.StructuredOutput | None:
        """The grammar of ``required`` and of a named function; ``None`` for the others."""
        if self.mode == "named":
            function = next(t.function for t in self.tools if t.function.name == self.function)
            return pb.StructuredOutput(json_schema=json.dumps(function.parameters or _ANY_OBJECT))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": t.function.parameters or _ANY_OBJECT},
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return pb.StructuredOutput(json_schema=json.dumps(schema))

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output."""
        if self.mode == "named":
            return None, [ToolCall(self.function or "", text)]
        if self.mode == "required":
            try:
                return None, [ToolCall.from_json(call, ("parameters",)) for call in json.loads(text)]
            except ValueError:  # cut by max_tokens: no whole call
                return text, []
        if self.mode == "auto" and self.parser is not None:
            content, calls = self.parser.extract(text)
            return content, calls[: None if self.parallel else 1]
        return text, []

    @property
    def reads_whole_output(self) -> bool:
        """The calls are parsed from the whole output, reasoning and all, not from its content (harmony's, whose
        messages each name their channel); the parser's content is then the answer's."""
        return self.mode == "auto" and self.parser is not None and self.parser.reasoning_parser is not None

    def finish_reason(self, calls: list[ToolCall], finish_reason: str | None) -> str | None:
        """``tool_calls`` when the model called tools on its own and stopped (a named call, which the
        caller asked for, keeps ``stop``, as OpenAI and vLLM)."""
        return "tool_calls" if calls and finish_reason == "stop" and self.mode != "named" else finish_reason

    def stream(self) -> ToolStream:
        return ToolStream(self)


@dataclass
class ToolStream:
    """One streamed choice: its text deltas become content deltas and tool-call deltas."""

    plan: ToolPlan
    _named: ToolCall | None = None
    _parsed: StreamingToolCalls | None = field(default=None)
    _required: RequiredCalls | None = field(default=None)

    def __post_init__(self) -> None:
        max_calls = None if self.plan.parallel else 1
        if self.plan.mode == "auto" and self.plan.parser is not None:
            self._parsed = self.plan.parser.stream()
            self._parsed.calls.max_calls = max_calls
        elif self.plan.mode == "required":
            self._required = RequiredCalls(max_calls)

    def feed(self, text: str) -> dict[str, Any]:
        """The chunk's ``delta`` fields for this piece of text (``{}``: nothing to send yet)."""
        if self.plan.mode == "named":
            if self._named is None:
                self._named = ToolCall(self.plan.function or "", "")
                return {
                    "tool_calls": [
                        {"index": 0, **self._named.as_openai()}
                        | {"function": {"name": self._named.name, "arguments": text}}
                    ]
                }
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if self._required is not None:
            calls = self._required.feed(text)
            return {"tool_calls": calls} if calls else {}
        if self._parsed is not None:
            content = self._parsed.feed(text)
            fields: dict[str, Any] = {"content": content} if content else {}
            if calls := self._parsed.call_deltas():
                fields["tool_calls"] = calls
            return fields
        return {"content": text} if text else {}

    def finish(self) -> tuple[dict[str, Any], list[ToolCall]]:
        """The last ``delta`` fields once the output ended, and the calls it made."""
        if self.plan.mode == "named":
            return {}, [self._named] if self._named is not None else []
        if self._required is not None:
            return self._required.finish(self.plan)
        if self._parsed is None:
            return {}, []
        content, calls = self._parsed.finish()
        calls = calls[: None if self.plan.parallel else 1]
        delta: dict[str, Any] = {"content": content} if content else {}
        if deltas := self._parsed.calls.settle(calls):
            delta["tool_calls"] = deltas
        return delta, calls


class RequiredCalls(StreamedCalls[CallScanner]):
    """The ``required`` tool choice's output (a JSON array of ``{"name", "parameters"}`` objects) streamed as
    tool-call deltas."""

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(CallScanner(("parameters",), call_depth=1), max_calls)

    def finish(self, plan: ToolPlan) -> tuple[dict[str, Any], list[ToolCall]]:
        """The last delta and the calls. An output cut before its calls were whole (``max_tokens``, a stop
        string) has no calls; what was streamed of them stays, and no content follows."""
        content, calls = plan.extract(self.scanner.text)
        if not calls:
            return ({"content": content} if content and not self.started else {}), []
        deltas = self.settle(calls)
        return ({"tool_calls": deltas} if deltas else {}), calls


def tools_json(tools: list[Tool]) -> str:
    """The tools as the chat template takes them."""
    return json.dumps([t.model_dump(exclude_none=True) for t in tools])
