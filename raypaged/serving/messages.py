"""The ``Generate`` stream's messages as plain Python objects, for the in-process link.

Each class mirrors the ``generate.proto`` message of its name: the same fields in the same
order, repeated fields as lists, enums as their ints (``pb.FINISH_REASON_*``), and a field
with presence (an ``optional`` scalar, a message) as ``None`` while unset. ``HasField``
answers for those fields as protobuf's does, so the gateway reads either form with the same
code. ``DeltaTracker`` (``protocol.py``) builds its responses from this module or from
``generate_pb2``, whichever the link asks for: the classes take the same keyword arguments.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from raypaged.serving.proto import generate_pb2 as pb


class _Message:
    __slots__ = ()
    _PRESENCE: ClassVar[tuple[str, ...]] = ()  # the fields that are None while unset

    def HasField(self, name: str) -> bool:
        """Whether the field ``name`` (one that is ``None`` while unset) is set; ``ValueError`` for another."""
        if name not in self._PRESENCE:
            raise ValueError(f"{type(self).__name__}.HasField answers for {self._PRESENCE}, not {name!r}")
        return getattr(self, name) is not None


@dataclass(slots=True)
class TopLogprobs(_Message):
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CompletionDelta(_Message):
    _PRESENCE: ClassVar[tuple[str, ...]] = ("stop_token_id",)

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    stop_reason: str = ""
    finish_message: str = ""
    stop_token_id: int | None = None


@dataclass(slots=True)
class Usage(_Message):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class PromptLogprobs(_Message):
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class GenerateResponse(_Message):
    """``usage`` reads as zeros while unset, as protobuf's does (only the first response leaves it unset)."""

    _PRESENCE: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    request_id: str = ""
    outputs: list[CompletionDelta] = field(default_factory=list)
    finished: bool = False
    usage: Usage = field(default_factory=Usage)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)


def _pickled_by_position(cls: Any) -> None:  # a dataclass of this module
    """``cls`` pickles as its constructor's positional arguments (as its objects cross the engine process's
    link): half the cost, either way, of the slotted dataclass's own state dict."""
    first, *rest = (f.name for f in dataclasses.fields(cls))  # every class here has two or more fields
    fields = operator.attrgetter(first, *rest)
    cls.__reduce__ = lambda self: (cls, fields(self))


for _cls in (TopLogprobs, CompletionDelta, Usage, PromptLogprobs, GenerateResponse):
    _pickled_by_position(_cls)


class StreamMessages(Protocol):
    """What builds a ``Generate`` stream: this module (in process) or ``generate_pb2`` (gRPC). The members are
    read-only, so that either module, whose classes differ, is one."""

    @property
    def GenerateResponse(self) -> type: ...
    @property
    def CompletionDelta(self) -> type: ...
    @property
    def Usage(self) -> type: ...
    @property
    def TopLogprobs(self) -> type: ...
    @property
    def PromptLogprobs(self) -> type: ...


# what the gateway reads from a Generate stream, whichever link it came over
AnyResponse = GenerateResponse | pb.GenerateResponse
AnyDelta = CompletionDelta | pb.CompletionDelta
AnyUsage = Usage | pb.Usage
AnyTopLogprobs = TopLogprobs | pb.TopLogprobs
AnyPromptLogprobs = PromptLogprobs | pb.PromptLogprobs
