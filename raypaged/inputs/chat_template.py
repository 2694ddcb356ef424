"""A conversation rendered to prompt token ids with a chat template, for ``LLM.chat`` and the servers.

The template gets what vLLM's gets: the turns (a speaker's ``name``, an assistant turn's
``tool_calls`` with object arguments, a tool turn's ``tool_call_id``), ``tools``, ``documents``,
``add_generation_prompt``, ``continue_final_message`` and extra variables. A template's own
error (``raise_exception``, e.g. roles must alternate) is an ``InputError`` with its message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raypaged.inputs.chat_format import resolve_content_format, with_content_format
from raypaged.inputs.limits import InputError
from raypaged.inputs.tokenizer import is_mistral

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from raypaged.config import EngineConfig

# template variables chat_template_kwargs may not replace: the request sets them its own way
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
    }
)


def render_chat(
    tokenizer: PreTrainedTokenizerBase, *args: Any, add_special_tokens: bool = False, **kwargs: Any
) -> list[int]:
    """The conversation's prompt token ids (``rendered``'s arguments): the chat template's text tokenized (its
    special tokens are the template's own: the tokenizer adds its own only with ``add_special_tokens``, as
    vLLM's), or Mistral's encoding (which writes them all: ``add_special_tokens`` is refused there)."""
    found = rendered(tokenizer, *args, **kwargs)
    if not isinstance(found, list):
        return tokenizer(found, add_special_tokens=add_special_tokens)["input_ids"]
    if add_special_tokens:
        raise InputError("add_special_tokens", "add_special_tokens: Mistral's chat encoding writes its special tokens")
    return found


def render_chat_text(tokenizer: PreTrainedTokenizerBase, *args: Any, **kwargs: Any) -> str:
    """The conversation's prompt as text (``rendered``'s arguments): the chat template's, or Mistral's encoding
    decoded."""
    found = rendered(tokenizer, *args, **kwargs)
    return tokenizer.decode(found) if isinstance(found, list) else found


def content_format_of(
    tokenizer: PreTrainedTokenizerBase,
    config: EngineConfig,
    chat_template: str | None = None,
    content_format: str | None = None,
) -> str:
    """``string`` or ``openai``: how turns reach ``chat_template`` (a request's own; else the server's or the
    tokenizer's), by ``content_format`` over ``--chat-template-content-format``."""
    template = chat_template if chat_template is not None else config.chat_template_text
    source = template if template is not None else tokenizer.chat_template
    return resolve_content_format(
        content_format or config.chat_template_content_format, source if isinstance(source, str) else None
    )


def rendered(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    config: EngineConfig,
    *,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    trusted: bool = False,
    content_format: str | None = None,
) -> str | list[int]:
    """``conversation`` rendered with the chat template (text); ``chat_template`` (a request's own) needs ``trusted``
    (the caller is the operator: ``LLM.chat``) or ``config.trust_request_chat_template``. With Mistral's tokenizer
    (``--tokenizer-mode mistral``), mistral_common's encoding of it (token ids), as vLLM's: the turns and ``tools``
    become Mistral's control tokens, and with no template to replace or feed, a ``chat_template``,
    ``chat_template_kwargs`` and ``documents`` are refused by name. ``content_format`` (``chat_format``'s, over
    ``--chat-template-content-format``): how each turn's content reaches the template. Bad input raises
    ``InputError``."""
    _check_turns(conversation, add_generation_prompt, continue_final_message)
    if is_mistral(tokenizer):
        for name, value in (
            ("chat_template", chat_template),
            ("chat_template_kwargs", {**(config.default_chat_template_kwargs or {}), **(chat_template_kwargs or {})}),
            ("documents", documents),
        ):
            if value:
                raise InputError(
                    name, f"{name} does not apply with Mistral's tokenizer: mistral_common encodes conversations itself"
                )
        try:
            ids = tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=False,
            )
        except Exception as exc:  # mistral_common's validation: roles out of order, a tool call without its id...
            raise InputError(
                "messages", f"Mistral's encoding refused the conversation: {type(exc).__name__}: {exc}"
            ) from None
        return list(ids)
    template = config.chat_template_text
    if chat_template:
        if not (trusted or config.trust_request_chat_template):
            raise InputError(
                "chat_template",
                "chat_template in a request is refused: start the server with --trust-request-chat-template "
                "to allow it",
            )
        template = chat_template
    if template is None and tokenizer.chat_template is None:
        raise InputError("messages", "this model's tokenizer has no chat template; use completions or --chat-template")
    kwargs = {**(config.default_chat_template_kwargs or {}), **(chat_template_kwargs or {})}
    if clash := sorted(_RESERVED_KWARGS & kwargs.keys()):
        raise InputError("chat_template_kwargs", f"chat_template_kwargs may not set {clash[0]!r}")
    # each turn's content as the template reads it (``content_format`` over --chat-template-content-format), as
    # vLLM renders it: a turn without content (an assistant's tool calls) gets "" or no part, never a None that
    # transformers would drop (and a template reading message['content'] fail on)
    conversation = with_content_format(conversation, content_format_of(tokenizer, config, template, content_format))
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            documents=documents,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # jinja2's TemplateError (raise_exception) and the template's own bugs
        raise InputError("messages", f"the chat template failed: {type(exc).__name__}: {exc}") from None
    return text


def _check_turns(conversation: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool) -> None:
    if not conversation:
        raise InputError("messages", "messages must not be empty")
    if continue_final_message and add_generation_prompt:
        raise InputError(
            "continue_final_message", "continue_final_message and add_generation_prompt cannot both be true"
        )
    if continue_final_message and conversation[-1].get("role") != "assistant":
        raise InputError("continue_final_message", "continue_final_message needs an assistant turn last")
