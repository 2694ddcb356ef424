"""A smaller model of the same tokenizer proposes drafts greedily, on the target's worker.

Its K/V live in a cache of its own with the target's block ids: the target's block tables
index both, so the scheduler's allocation, copy-on-write, swapping and prefix sharing cover the
draft's cache too (every block op runs on both). The scheduler keeps ``num_spec_tokens``
lookahead slots past each sampling sequence's tokens, where the draft writes while it proposes.

Each sequence remembers up to where its draft K/V is right (``valid``) and which tokens it
wrote after that while guessing; the next proposal keeps the guesses the sequence's real
tokens confirm and recomputes from the first that differs, so a draft never reads K/V of a
rejected token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.model.llama import LlamaForCausalLM
from raypaged.worker.cache import KVCache


@dataclass(slots=True)
class _DraftState:
    valid: int = 0  # positions below this hold the draft's K/V of the sequence's real tokens
    guesses: list[int] = field(default_factory=list)  # tokens written at valid, valid + 1, ...


class DraftModelProposer:
    def __init__(
        self,
        model: torch.nn.Module,
        cache: KVCache,
        block_size: int,
        num_spec_tokens: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        assert isinstance(model, LlamaForCausalLM)  # what load_model builds
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.k = num_spec_tokens
        self.max_model_len = max_model_len
        self.device = device
        self._states: dict[str, _DraftState] = {}

    def forget(self, seq_id: str) -> None:
        """The sequence ended, or its blocks are about to be rebuilt (recompute, swap): start over."""
        self._states.pop(seq_id, None)

    @torch.inference_mode()
    def propose(self, seqs: list[tuple[str, list[int], list[int]]]) -> dict[str, list[int]]:
        """Drafts for each ``(seq_id, tokens, block_ids)``: ``tokens`` is everything it has (its
        newest token last), ``block_ids`` its table, holding its lookahead slots."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[tuple[int, int, int, list[int]]] = []
        plans: list[tuple[str, int, int, list[int]]] = []  # seq id, newest position, drafts to make, table
        for seq_id, tokens, block_ids in seqs:
            newest = len(tokens) - 1
            num_steps = min(self.k, len(block_ids) * bs - newest, self.max_model_len - newest)
            if num_steps < 1:
                continue
            state = self._states.setdefault(seq_id, _DraftState())
            valid = state.valid
            for guess in state.guesses:  # K/V written while guessing right stays right
                if valid >= newest or tokens[valid] != guess:
                    break
                valid += 1
            start = min(valid, newest)  # the newest token always runs: its logits give the first draft
            query_start = len(ids)
            for pos in range(start, newest + 1):
                ids.append(tokens[pos])
                positions.append(pos)
                slots.append(block_ids[pos // bs] * bs + pos % bs)
            spans.append((query_start, newest + 1 - start, newest + 1, block_ids[: -(-(newest + 1) // bs)]))
            plans.append((seq_id, newest, num_steps, block_ids))
            state.valid, state.guesses = newest + 1, []
        if not plans:
            return {}
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros((0, 0), dtype=torch.long, device=self.device),
            decode_context_lens=self._tensor([]),
            prefills=[PrefillSpan(q0, n, end, self._tensor(table)) for q0, n, end, table in spans],
        )
        hidden = self.model(self._tensor(ids), self._tensor(positions), self.cache.layers, meta)
        last = self._tensor([q0 + n - 1 for q0, n, _, _ in spans])
        drafts = {
            seq_id: [token]
            for (seq_id, *_), token in zip(plans, self.model.compute_logits(hidden[last]).argmax(-1).tolist())
        }
        for step in range(1, max(num_steps for _, _, num_steps, _ in plans)):
            batch = [(seq_id, newest + step, table) for seq_id, newest, num_steps, table in plans if step < num_steps]
            tokens_in = [drafts[seq_id][-1] for seq_id, _, _ in batch]
            for (seq_id, _, _), token in zip(batch, tokens_in):
                self._states[seq_id].guesses.append(token)
            next_tokens = self._decode(tokens_in, batch)
            for (seq_id, _, _), token in zip(batch, next_tokens):
                drafts[seq_id].append(token)
        return drafts

    def _decode(self, tokens: list[int], batch: list[tuple[str, int, list[int]]]) -> list[int]:
        """One greedy token for each sequence of ``batch`` (seq id, position of its input token, table)."""
        bs = self.block_size
        width = max(-(-(pos + 1) // bs) for _, pos, _ in batch)
        tables = [table[:width] + [0] * (width - len(table[:width])) for _, _, table in batch]
        meta = AttentionMetadata(
            slot_mapping=self._tensor([table[pos // bs] * bs + pos % bs for _, pos, table in batch]),
            num_decode_tokens=len(batch),
            decode_block_tables=self._tensor(tables).view(len(batch), width),
            decode_context_lens=self._tensor([pos + 1 for _, pos, _ in batch]),
            prefills=[],
        )
        hidden = self.model(self._tensor(tokens), self._tensor([pos for _, pos, _ in batch]), self.cache.layers, meta)
        return self.model.compute_logits(hidden).argmax(-1).tolist()

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
