"""Incremental detokenization that never emits a broken UTF-8 character."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from raypaged.inputs.tokenizer import is_mistral

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, O(1) per token.

    Fast tokenizers stream through ``tokenizers``' ``DecodeStream`` (seeded with the
    prompt's last tokens, so the first output token gets its context, such as a
    leading space); others decode a short window (``prefix_offset:``) and compare it
    with the decoding of its already-emitted part. Either way a token that ends
    inside a UTF-8 character emits nothing until the next token completes it;
    ``flush`` gives what is still held (as replacement characters).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Mistral's tokenizer (mistral_common) takes no spaces option: spaced_decode puts them in
        mistral = is_mistral(tokenizer)
        self._mistral_spaces = mistral and not skip_special_tokens and spaces_between_special_tokens
        self._special = frozenset(tokenizer.all_special_ids) if self._mistral_spaces else frozenset()
        self._decode_options = {"skip_special_tokens": skip_special_tokens}
        if not mistral:
            self._decode_options["spaces_between_special_tokens"] = spaces_between_special_tokens
        fast = getattr(tokenizer, "is_fast", False)
        # streamed: an added token right after another shows its bare content (no space before it), as vLLM
        self._joined: dict[int, str] | None = None
        if not (skip_special_tokens or spaces_between_special_tokens) and fast:
            self._joined = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._last_added = False
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens) if fast else None
        self._backend: Tokenizer | None = tokenizer.backend_tokenizer if fast else None
        self._held: list[int] = []  # streamed tokens whose text the stream still holds
        # the window decoder's state (slow tokenizers)
        self.token_ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: list[int]) -> str:
        if self._mistral_spaces:
            return spaced_decode(self.tokenizer, ids, self._special)
        return self.tokenizer.decode(ids, **self._decode_options)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        if self._stream is None:
            self.token_ids.extend(new_token_ids)
            return self._emit(final=False)
        backend = self._backend
        assert backend is not None, "set with the stream"
        if len(new_token_ids) == 1 and self._joined is None:  # the common case: one token, no join rule
            piece = self._stream.step(backend, new_token_ids[0])
            if piece is None:
                self._held.append(new_token_ids[0])
                return ""
            self._held.clear()
            return piece
        pieces = []
        for token_id in new_token_ids:
            piece = self._stream.step(backend, token_id)
            if self._joined is not None:
                added = self._joined.get(token_id)
                if added is not None and self._last_added:
                    piece = added
                self._last_added = added is not None
            if piece is None:
                self._held.append(token_id)
            else:
                self._held.clear()
                pieces.append(piece)
        return "".join(pieces)

    def flush(self) -> str:
        """At the end of generation: whatever is held back, replacement characters included."""
        if self._stream is None:
            return self._emit(final=True)
        held, self._held = self._held, []
        return self._decode(held) if held else ""

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return delta


def spaced_decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], special: frozenset[int]) -> str:
    """Special tokens (``special``: their ids) kept and set apart by spaces, as Hugging Face's
    ``spaces_between_special_tokens`` does: each special token and each run of others decoded on its own, joined by
    single spaces (for tokenizers that take no such option, as Mistral's)."""
    parts: list[str] = []
    run: list[int] = []
    for token_id in ids:
        if token_id in special:
            if run:
                parts.append(tokenizer.decode(run))
                run = []
            parts.append(tokenizer.decode([token_id]))
        else:
            run.append(token_id)
    if run:
        parts.append(tokenizer.decode(run))
    return " ".join(part for part in parts if part)
