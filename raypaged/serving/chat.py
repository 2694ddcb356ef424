"""A gRPC ``ChatMessages`` as the chat template's inputs (``inputs/chat_template.py`` renders them)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from raypaged.inputs.limits import InputError
from raypaged.serving.proto import generate_pb2 as pb

if TYPE_CHECKING:
    from raypaged.engine.input_processor import InputProcessor


def chat_prompt_ids(inputs: InputProcessor, messages: pb.ChatMessages, add_special_tokens: bool = False) -> list[int]:
    """Token ids of the conversation rendered with its template (with the tokenizer's own special tokens too when
    ``add_special_tokens``); bad input raises ``InputError`` (a conversation with images too: only ``Generate``
    reads them, through ``chat_prompt_with_images``)."""
    if has_images(messages):
        raise InputError("messages", "messages with images are read by generation only (not tokenized or rendered)")
    turns = [_turn(m) for m in messages.messages]
    return inputs.chat_ids(turns, add_special_tokens=add_special_tokens, **_options(messages))


def has_images(messages: pb.ChatMessages) -> bool:
    return any(m.image_urls or any(p.WhichOneof("part") == "image_url" for p in m.parts) for m in messages.messages)


def chat_prompt_with_images(inputs: InputProcessor, messages: pb.ChatMessages) -> tuple[str, list[str]]:
    """The conversation rendered with its template, its images as placeholder lines, and the images' URLs in order
    (``InputProcessor.chat_with_images``)."""
    return inputs.chat_with_images([_turn(m) for m in messages.messages], **_options(messages))


def _options(messages: pb.ChatMessages) -> dict[str, Any]:
    return dict(
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
        + sum(len(p.text) for p in m.parts)
        + len(m.name)
        + len(m.tool_call_id)
        + sum(len(c.id) + len(c.name) + len(c.arguments) for c in m.tool_calls)
        for m in messages.messages
    )
    extras = (messages.tools_json, messages.chat_template, messages.chat_template_kwargs_json, messages.documents_json)
    return turns + sum(len(e) for e in extras)


def _turn(message: pb.ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role, "content": message.content if message.HasField("content") else None}
    if message.parts:
        if message.HasField("content") or message.image_urls:
            raise InputError("messages", "a message's parts are its whole content: send no content or image_urls")
        turn["content"] = [_part(p) for p in message.parts]
    elif message.image_urls:  # content parts, as the chat API's: the images, then the text
        images = [{"type": "image_url", "image_url": {"url": url}} for url in message.image_urls]
        turn["content"] = [*images, {"type": "text", "text": turn["content"] or ""}]
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


def _part(part: pb.ContentPart) -> dict[str, Any]:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "image_url" and part.image_url:
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    raise InputError("messages", "a content part is a text or an image_url (a non-empty URL)")


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
