"""Structured-output request bodies: OpenAI's ``response_format`` and vLLM's ``structured_outputs``,
as the gRPC ``StructuredOutput`` the engine enforces."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raypaged.serving.gateway.errors import APIError
from raypaged.serving.proto import generate_pb2 as pb


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class LegacyStructure(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    begin: str
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``, plus vLLM's ``structural_tag`` (xgrammar's ``format``, or the
    older ``structures`` and ``triggers``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[LegacyStructure] | None = None
    triggers: list[str] | None = None

    def structured(self) -> pb.StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return pb.StructuredOutput(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            return pb.StructuredOutput(json_schema=json.dumps(self.json_schema.json_schema))
        if self.format is not None:
            return pb.StructuredOutput(structural_tag=json.dumps({"type": "structural_tag", "format": self.format}))
        if self.structures is None or self.triggers is None:
            raise APIError(
                400, "response_format structural_tag needs format, or structures and triggers", "response_format"
            )
        tags = [
            {"begin": s.begin, "content": {"type": "json_schema", "json_schema": s.json_schema or {}}, "end": s.end}
            for s in self.structures
        ]
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": self.triggers, "tags": tags}}
        return pb.StructuredOutput(structural_tag=json.dumps(tag))


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs``: one kind of constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool = False  # there is no fallback backend: honoured either way

    def structured(self) -> pb.StructuredOutput:
        if self.whitespace_pattern is not None:
            raise APIError(
                400,
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend",
                "structured_outputs",
            )
        # StructuredOutput's keyword arguments: its oneof's fields
        kinds: dict[str, Any] = {
            "json_schema": self.json_ if isinstance(self.json_, str) or self.json_ is None else json.dumps(self.json_),
            "regex": self.regex,
            "choice": None if self.choice is None else pb.StructuredChoices(choices=self.choice),
            "grammar": self.grammar,
            "json_object": self.json_object or None,
            "structural_tag": self.structural_tag,
        }
        given = {k: v for k, v in kinds.items() if v is not None}
        if len(given) != 1:
            names = [("json" if k == "json_schema" else k) for k in given] or "none"
            raise APIError(
                400,
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object or "
                f"structural_tag, got {names}",
                "structured_outputs",
            )
        message = pb.StructuredOutput(**given)
        if self.disable_any_whitespace is not None:
            message.disable_any_whitespace = self.disable_any_whitespace
        return message
