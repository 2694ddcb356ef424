"""A gRPC ``ChatMessages`` as the chat template's inputs (``inputs/chat_template.py`` renders them)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from raypaged.inputs.limits import InputError
from raypaged.serving.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from raypaged.engine.input_processor import InputProcessor


def chat_prompt_ids(inputs: InputProcessor, messages: pb.ChatMessages) -> list[int]:
    """Token ids of the conversation rendered with its template; bad input raises ``InputError``."""
    return inputs.chat_ids(
        [_turn(m) for m in messages.messages],
        tools=_json(messages.tools_json, "tools", list, None),
        documents=_json(messages.documents_json, "documents", list, None),
        chat_template=messages.chat_template or None,
        chat_template_kwargs=_json(messages.chat_template_kwargs_json, "chat_template_kwargs", dict, None),
        add_generation_prompt=messages.add_generation_prompt if messages.HasField("add_generation_prompt") else True,
        continue_final_message=messages.continue_final_message,
    )


def conversation_chars(messages: pb.ChatMessages) -> int:
    """Characters of everything a conversation sends to the template."""
    turns = sum(
        len(m.role)
        + len(m.content)
        + len(m.name)
        + len(m.tool_call_id)
        + sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
        for m in messages.messages
    )
    extras = (messages.tools_json, messages.chat_template, messages.chat_template_kwargs_json, messages.documents_json)
    return turns + sum(len(e) for e in extras)


def _turn(message: pb.ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content if message.HasField("content") else None}
    if message.name:
        turn["name"] = message.name
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls:  # templates take the arguments as an object, as vLLM passes them
        turn["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _json(c.arguments, "messages", dict, {})},
            }
            for c in message.tool_calls
        ]
    return turn


def _json(text: str, param: str, kind: type, empty: Any) -> Any:
    """``text`` parsed as JSON of type ``kind`` (``empty`` when there is no text)."""
    if not text:
        return empty
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise InputError(param, f"{param} must be a JSON {'object' if kind is dict else 'array'}")
    return value
