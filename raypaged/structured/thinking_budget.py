"""vLLM's ``thinking_token_budget``: a reasoning section holds at most that many tokens, then its end is forced.

A ``ThinkingBudget`` is a grammar matcher as the engine core drives them (``accept_token``,
``fill_next_token_bitmask``, ``rollback``, ``is_terminated``, ``fork``), so it rides the
structured-outputs path: its mask rows are filled on the mask thread while the forward runs,
drafts are checked against it, and beams fork it. It wraps the sequence's own grammar matcher,
if any, which sees every token.

The section is what follows the reasoning start (``<think>``, or ``--reasoning-config``'s
``reasoning_start_str``) up to its end: a prompt that ends inside a section (its last start
after its last end, as a DeepSeek-R1 template leaves it) has its tokens after the start
counted. Once the section holds ``budget`` tokens the end's tokens are the only ones allowed,
one after the other (continuing an end the model already began); then sampling is free again,
and a later section gets a budget of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_ALL = -1  # a bitmask word with every bit set: every token allowed
_HISTORY = 256  # states kept for rollback (speculative drafts are far fewer)


@dataclass(slots=True)
class _State:
    inside: bool  # within a reasoning section (its end not forced or seen yet)
    count: int  # the section's tokens so far
    forcing: int  # end tokens forced so far, -1 when not forcing
    tail: tuple[int, ...]  # the last tokens, enough to see a start or an end complete


class ThinkingBudget:
    """The budget of one sequence (``inner``: its grammar matcher, which sees every token too)."""

    def __init__(
        self, budget: int, start_ids: list[int], end_ids: list[int], prompt_ids: list[int], inner: Any = None
    ) -> None:
        if budget < 0:
            raise ValueError(f"thinking_token_budget must be at least 0, got {budget}")
        if not start_ids or not end_ids:
            raise ValueError("the reasoning section's start and end must each be at least one token")
        self.budget = budget
        self.start_ids = tuple(start_ids)
        self.end_ids = tuple(end_ids)
        self.inner = inner
        self._keep = max(len(self.start_ids), len(self.end_ids))
        last_start = _last_index(prompt_ids, self.start_ids)
        last_end = _last_index(prompt_ids, self.end_ids)
        inside = last_start > last_end
        count = len(prompt_ids) - last_start - len(self.start_ids) if inside else 0
        self._states = [_State(inside, count, -1, tuple(prompt_ids[-self._keep :]))]

    @property
    def forced_token(self) -> int | None:
        """The token the next one must be, ``None`` when sampling is free."""
        state = self._states[-1]
        if state.forcing >= 0:
            return self.end_ids[state.forcing]
        if state.inside and state.count >= self.budget:
            return self.end_ids[_end_begun(state.tail, self.end_ids)]
        return None

    def accept_token(self, token_id: int) -> bool:
        forced = self.forced_token
        if forced is not None and token_id != forced:
            return False
        if self.inner is not None and not self.inner.accept_token(token_id):
            return False
        state = self._states[-1]
        tail = (state.tail + (token_id,))[-self._keep :]
        if forced is not None:
            forcing = (state.forcing if state.forcing >= 0 else _end_begun(state.tail, self.end_ids)) + 1
            done = forcing == len(self.end_ids)
            self._states.append(_State(False, 0, -1, tail) if done else _State(True, state.count, forcing, tail))
        elif tail[-len(self.start_ids) :] == self.start_ids:
            self._states.append(_State(True, 0, -1, tail))
        elif tail[-len(self.end_ids) :] == self.end_ids:
            self._states.append(_State(False, 0, -1, tail))
        else:
            self._states.append(_State(state.inside, state.count + state.inside, -1, tail))
        if len(self._states) > 2 * _HISTORY:  # rollbacks go back a few drafts at most: keep the last states
            del self._states[:-_HISTORY]
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        forced = self.forced_token
        if forced is None:
            if self.inner is not None:
                self.inner.fill_next_token_bitmask(bitmask, index)
            else:
                bitmask[index].fill_(_ALL)
            return
        bitmask[index].fill_(0)
        bit = forced % 32
        bitmask[index, forced // 32] = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32: bit 31 is the sign

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > len(self._states) - 1:
            raise ValueError(f"cannot roll back {num_tokens} tokens, {len(self._states) - 1} accepted")
        if num_tokens:
            del self._states[-num_tokens:]
            if self.inner is not None:
                self.inner.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def fork(self) -> ThinkingBudget:
        twin = object.__new__(ThinkingBudget)
        twin.budget, twin.start_ids, twin.end_ids, twin._keep = self.budget, self.start_ids, self.end_ids, self._keep
        twin.inner = None if self.inner is None else self.inner.fork()
        twin._states = [self._states[-1]]
        return twin


def _last_index(ids: list[int], pattern: tuple[int, ...]) -> int:
    """Where the last occurrence of ``pattern`` in ``ids`` begins, -1 if none."""
    n = len(pattern)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == pattern:
            return i
    return -1


def _end_begun(tail: tuple[int, ...], end_ids: tuple[int, ...]) -> int:
    """How many of the end's first tokens ``tail`` already ends with (the model began the end itself)."""
    for k in range(min(len(tail), len(end_ids) - 1), 0, -1):
        if tail[-k:] == end_ids[:k]:
            return k
    return 0
