"""Incremental detokenization that never emits a broken UTF-8 character."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is decoded over a short window (``prefix_offset:``) and compared with
    the decoding of the window's already-emitted part; a delta that ends in a
    replacement character is held back until the next token completes it.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # a few prompt tokens give the first output token its context (leading spaces)
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is held back, replacement characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT) and not final):
            return ""
        delta = full_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
