"""Prompt-lookup (n-gram) proposals: the tokens that followed an earlier occurrence of the sequence's
last ``n`` tokens, for the longest ``n`` in ``[min_n, max_n]`` that occurs: the latest occurrence
followed by ``k`` tokens, else the earliest (the longest continuation there is)."""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (prompt then output), ``[]`` when its
    last ``min_n`` tokens never occurred before. One vectorized pass finds where the last token
    occurred; each longer n-gram only checks those places, one comparison per token of it."""
    length = len(tokens)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier n-gram could end (each has a follower)
    matched = ends
    found: list[tuple[int, np.ndarray]] = []
    for n in range(1, min(max_n, length - 1) + 1):
        if n > 1:
            matched = matched[matched >= n - 1]
            matched = matched[tokens[matched - (n - 1)] == tokens[length - n]]
        if not matched.size:
            break
        if n >= min_n:
            found.append((n, matched))
    if not found:
        return []
    _, hits = found[-1]  # the longest n that occurs
    whole = hits[hits + 1 + k <= length]
    start = int(whole[-1] if whole.size else hits[0]) + 1
    return tokens[start : start + k].tolist()


class NgramProposer:
    """Keeps each sequence's tokens in a growing numpy buffer (appends only), so a proposal costs
    the lookups, not a copy of the whole sequence."""

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}

    def propose(self, seq_id: str, prompt_token_ids: list[int], output_token_ids: list[int], k: int) -> list[int]:
        """At most ``k`` drafts for ``seq_id``, whose tokens are now the prompt then the output (an
        extension of what it had; anything shorter starts its buffer over)."""
        buffer, size = self._buffers.get(seq_id, (None, 0))
        num_prompt = len(prompt_token_ids)
        total = num_prompt + len(output_token_ids)
        if buffer is None or total < size or total > len(buffer):
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if buffer is not None and size <= total:
                grown[:size] = buffer[:size]
            else:
                size = 0
            buffer = grown
        if size < num_prompt:
            buffer[size:num_prompt] = prompt_token_ids[size:]
            size = num_prompt
        buffer[size:total] = output_token_ids[size - num_prompt :]
        self._buffers[seq_id] = (buffer, total)
        return propose_ngram(buffer[:total], min(k, self.k), self.min_n, self.max_n)

    def forget(self, seq_id: str) -> None:
        self._buffers.pop(seq_id, None)
