"""The input gate: hard limits on what one request may ask for, checked before any expensive work.

HTTP, gRPC and the ``LLM`` API refuse oversized or out-of-range input through
these functions and nothing else. Every refusal is an :class:`InputError` (a
``ValueError``) that names the field, the limit and the flag that raises it;
the servers answer it as HTTP 400 (``param`` = the field) or gRPC
``INVALID_ARGUMENT``. Counts are checked before contents, so a request with a
million entries is refused after reading one length, not after a scan.

This module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from raypaged.sampling_params import SamplingParams

# characters of prompt text allowed per token of max_model_len when --max-prompt-chars is not given
PROMPT_CHARS_PER_TOKEN = 32


class InputError(ValueError):
    """A request refused by the input gate; ``param`` is the request field at fault."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Per-request caps; each field is the flag of the same name (``--max-logprobs`` ...).

    ``max_prompt_chars`` ``None`` means ``PROMPT_CHARS_PER_TOKEN * max_model_len``.
    """

    max_logprobs: int = 20  # top logprobs per token (vLLM's --max-logprobs)
    max_num_samples: int = 128  # n and best_of
    max_stop_strings: int = 64
    max_stop_string_chars: int = 256  # characters of one stop string
    max_stop_token_ids: int = 1024
    max_chat_messages: int = 1024
    max_prompt_chars: int | None = None  # characters of text before tokenization (prompt, all messages)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_chars":
                continue
            least = -1 if f.name == "max_logprobs" else 1  # max_logprobs -1: the vocabulary size (vLLM's)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{flag(f.name)} must be an integer of at least {least}, got {value!r}")

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len


def flag(name: str) -> str:
    """The command-line flag of a limit field."""
    return "--" + name.replace("_", "-")


def check_count(param: str, count: int, limit: int, limit_name: str, what: str = "entries") -> None:
    """``count`` of ``param`` must not exceed ``limit`` (the ``limit_name`` flag raises it)."""
    if count > limit:
        raise InputError(param, f"{param} has {count} {what}, more than the limit of {limit} ({flag(limit_name)})")


def check_token_ids(param: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Every id in ``[0, vocab_size)``; the caller has already bounded ``len(token_ids)``."""
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise InputError(param, f"{param} must be token ids in [0, {vocab_size}), got {token_id}")


def check_prompt_len(num_tokens: int, max_model_len: int) -> None:
    """A prompt of ``num_tokens`` that leaves room for at least one generated token."""
    if num_tokens == 0:
        raise InputError("prompt", "prompt must not be empty")
    if num_tokens >= max_model_len:
        raise InputError(
            "prompt",
            f"prompt has {num_tokens} tokens, which leaves no room to generate within max_model_len "
            f"{max_model_len} (--max-model-len)",
        )


def check_pooling_len(num_tokens: int, max_model_len: int) -> None:
    """A pooling model's input of ``num_tokens``: it may fill ``max_model_len`` (nothing is generated after it)."""
    if num_tokens == 0:
        raise InputError("input", "the input must not be empty")
    if num_tokens > max_model_len:
        raise InputError(
            "input",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_tokens} tokens in the input for embedding generation. Please reduce the length of the input.",
        )


def check_prompt_ids(token_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    """A prompt that leaves room for at least one generated token, with every id in the vocabulary."""
    check_prompt_len(len(token_ids), max_model_len)
    check_token_ids("prompt", token_ids, vocab_size)


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """A prompt plus the tokens asked for must fit the context (vLLM's wording); ``None`` fills what is left."""
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise InputError(
            "max_tokens",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion.",
        )


def check_text(param: str, num_chars: int, limits: InputLimits, max_model_len: int) -> None:
    """Text to tokenize (a prompt, or a conversation's characters) within ``--max-prompt-chars``."""
    limit = limits.prompt_chars(max_model_len)
    if num_chars > limit:
        raise InputError(
            param,
            f"{param} has {num_chars} characters, more than the limit of {limit} (--max-prompt-chars) "
            f"before tokenization",
        )


def check_messages(num_messages: int, num_chars: int, limits: InputLimits, max_model_len: int) -> None:
    """A conversation: at least one and at most ``--max-chat-messages`` turns, its text within
    ``--max-prompt-chars``."""
    if num_messages == 0:
        raise InputError("messages", "messages must not be empty")
    check_count("messages", num_messages, limits.max_chat_messages, "max_chat_messages", "messages")
    check_text("messages", num_chars, limits, max_model_len)


def check_stop_counts(num_stop: int, num_stop_token_ids: int, limits: InputLimits) -> None:
    """The sizes of the stop lists, before they are copied anywhere."""
    check_count("stop", num_stop, limits.max_stop_strings, "max_stop_strings", "stop strings")
    check_count("stop_token_ids", num_stop_token_ids, limits.max_stop_token_ids, "max_stop_token_ids", "ids")


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A request's own priority means something only under the priority policy (vLLM refuses it too)."""
    if priority and scheduling_policy != "priority":
        raise InputError(
            "priority", f"priority {priority} needs --scheduling-policy priority (this engine schedules fcfs)"
        )


def check_sampling(params: SamplingParams, vocab_size: int, limits: InputLimits) -> None:
    """Everything a request's ``SamplingParams`` may ask of the engine, against the limits and the vocabulary."""
    check_count("n", params.n, limits.max_num_samples, "max_num_samples", "samples")
    if params.best_of is not None:
        check_count("best_of", params.best_of, limits.max_num_samples, "max_num_samples", "samples")
    limit = vocab_size if limits.max_logprobs == -1 else min(limits.max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        asked = vocab_size if value == -1 else value
        if asked is not None and asked > limit:
            shown = f"-1 (the whole vocabulary, {vocab_size})" if value == -1 else str(value)
            raise InputError(
                name,
                f"{name} {shown} is more than the limit of {limit} (--max-logprobs, at most the vocabulary size "
                f"{vocab_size})",
            )
    if params.logprob_token_ids:
        if params.logprobs is None:
            raise InputError(
                "logprob_token_ids",
                "logprob_token_ids needs logprobs (a completion's count, or a chat's logprobs: true)",
            )
        check_count("logprob_token_ids", len(params.logprob_token_ids), limit, "max_logprobs", "token ids")
        check_token_ids("logprob_token_ids", params.logprob_token_ids, vocab_size)
    check_stop_counts(len(params.stop), len(params.stop_token_ids), limits)
    longest = params.max_stop_len
    if longest > limits.max_stop_string_chars:
        raise InputError(
            "stop",
            f"stop has a string of {longest} characters, more than the limit of {limits.max_stop_string_chars} "
            f"({flag('max_stop_string_chars')})",
        )
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    check_token_ids("logit_bias", list(params.logit_bias or ()), vocab_size)
    check_token_ids("allowed_token_ids", params.allowed_token_ids or (), vocab_size)
    check_count("bad_words", len(params.bad_words or ()), limits.max_stop_strings, "max_stop_strings", "words")
    longest = max((len(w) for w in params.bad_words or ()), default=0)
    if longest > limits.max_stop_string_chars:
        raise InputError(
            "bad_words",
            f"bad_words has a word of {longest} characters, more than the limit of {limits.max_stop_string_chars} "
            f"({flag('max_stop_string_chars')})",
        )
