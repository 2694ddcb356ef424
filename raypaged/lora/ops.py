"""The batched LoRA product (Punica's segmented-GEMM idea) in torch: every token adds
``x A_s^T B_s^T`` of its own slot ``s`` in one pass over the step, never a forward per adapter.

Slot weights are stacked: ``lora_a: [num_slots, in, rank]`` (A transposed) and
``lora_b: [num_slots, rank, out]`` (B transposed, the scale folded in), zero past each
adapter's rank. A :class:`LoRAMapping` is built once per step from the tokens' slots and
read by every layer. It picks one of three paths (``benchmarks/results/lora_op.md``: SmolLM2's
projections at rank 16 on a shared 2-core CPU, where the pick is within 10% of the faster forced
path in 50 of 56 multi-slot cases, 54 in a quieter run, and the gather+bmm reference is
1.6-128x slower):

- every token on one slot: two plain matmuls;
- many slots or few tokens each: the slots' tokens gathered into a padded
  ``[slots, max_tokens, in]`` batch and two ``bmm`` (no per-slot call overhead);
- a skewed spread (one long prefill beside decodes, where padding would multiply the rows)
  or few slots with many tokens: a matmul pair per active slot over its sorted tokens.

The shrink (``x A^T``, ``[rows, rank]``) and expand (``h B^T`` added to ``y``) halves are
separate so a row-parallel layer can all-reduce the small product between them.

A BGMV mapping (:func:`build_bgmv_mapping`, where ``$RAYPAGED_LORA_KERNELS`` turns the CUDA
kernels of ``kernels/lora_bgmv.cu`` on) lists every token by its slot (``-1``: the base model)
and runs :func:`lora_bgmv` at the slots' full rank: its shapes depend on the token count only,
so a CUDA graph records it once and replays it for any adapters in any slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# the padded batch runs when PADDED_ROW_COST x its rows < adapter tokens + SLOT_COST_ROWS x active slots:
# a bmm row costs about 1.3 matmul rows and each slot's matmul pair about 16 rows of overhead (fitted on
# the 2-core CPU over the benchmark's spreads, benchmarks/results/lora_op.md)
PADDED_ROW_COST = 1.3
SLOT_COST_ROWS = 16
_NO_TOKENS = torch.zeros(0, dtype=torch.long)  # the index tensors of a mapping without adapter tokens (never read)


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    """The active slots' tokens as ``[num_active_slots, max_tokens]`` rows."""

    token_ids: torch.Tensor  # [num_active_slots * max_tokens] long: each row's token (0 for padding)
    rows: torch.Tensor  # [num_adapter_tokens] long: the row of each of the mapping's sorted token_ids


@dataclass(frozen=True, slots=True)
class LoRAMapping:
    """One step's token -> slot assignment, laid out for :func:`lora_shrink` and :func:`lora_expand`.

    ``slot_ids`` are the active slots in increasing order, ``segments[i]`` the ``(start, end)``
    of slot ``slot_ids[i]``'s tokens in ``token_ids`` (the adapter tokens sorted by slot).
    ``padded`` is ``None`` unless the padded batch path runs.

    A BGMV mapping has ``slot_of`` (each token's slot, ``-1`` for none) and no segments; a
    ``static`` one is recorded into a CUDA graph, so it runs whatever the slots hold.
    """

    num_tokens: int
    slot_ids: tuple[int, ...]
    segments: tuple[tuple[int, int], ...]
    token_ids: torch.Tensor  # [num_adapter_tokens] long (BGMV: every token, arange(num_tokens))
    slots_tensor: torch.Tensor  # [len(slot_ids)] long
    padded: PaddedBatch | None
    slot_of: torch.Tensor | None = None  # [num_tokens] long, BGMV mappings only
    static: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.slot_ids and not self.static

    @property
    def one_slot_for_all(self) -> bool:
        return self.slot_of is None and len(self.slot_ids) == 1 and self.segments[0][1] == self.num_tokens


def build_lora_mapping(token_slots: Sequence[int | None], device: torch.device | str = "cpu") -> LoRAMapping:
    """The mapping of a step whose token ``i`` reads slot ``token_slots[i]`` (``None``: the base model only)."""
    if token_slots.count(None) == len(token_slots):  # no adapter token: nothing built, nothing copied to the device
        return LoRAMapping(len(token_slots), (), (), _NO_TOKENS, _NO_TOKENS, None)
    by_slot: dict[int, list[int]] = {}
    for token, slot in enumerate(token_slots):
        if slot is not None:
            by_slot.setdefault(slot, []).append(token)
    slot_ids = tuple(sorted(by_slot))
    token_ids: list[int] = []
    segments = []
    for slot in slot_ids:
        segments.append((len(token_ids), len(token_ids) + len(by_slot[slot])))
        token_ids.extend(by_slot[slot])
    padded = None
    if len(slot_ids) > 1:
        max_tokens = max(end - start for start, end in segments)
        if PADDED_ROW_COST * len(slot_ids) * max_tokens < len(token_ids) + SLOT_COST_ROWS * len(slot_ids):
            ids = [0] * (len(slot_ids) * max_tokens)
            rows: list[int] = []
            for index, slot in enumerate(slot_ids):
                first = index * max_tokens
                ids[first : first + len(by_slot[slot])] = by_slot[slot]
                rows.extend(range(first, first + len(by_slot[slot])))
            padded = PaddedBatch(
                torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(rows, dtype=torch.long, device=device)
            )
    return LoRAMapping(
        len(token_slots),
        slot_ids,
        tuple(segments),
        torch.tensor(token_ids, dtype=torch.long, device=device),
        torch.tensor(slot_ids, dtype=torch.long, device=device),
        padded,
    )


def build_bgmv_mapping(token_slots: Sequence[int | None], device: torch.device | str = "cpu") -> LoRAMapping:
    """The BGMV mapping of a step whose token ``i`` reads slot ``token_slots[i]`` (``None``: the base model)."""
    slot_ids = tuple(sorted({slot for slot in token_slots if slot is not None}))
    if not slot_ids:
        return LoRAMapping(len(token_slots), (), (), _NO_TOKENS, _NO_TOKENS, None)
    flat = torch.tensor(
        [*range(len(token_slots)), *(-1 if slot is None else slot for slot in token_slots)],
        dtype=torch.long,
        device=device,
    )
    token_ids, slot_of = flat.split(len(token_slots))
    return LoRAMapping(len(token_slots), slot_ids, (), token_ids, _NO_TOKENS, None, slot_of)


def static_bgmv_mapping(token_ids: torch.Tensor, slot_of: torch.Tensor) -> LoRAMapping:
    """The mapping a CUDA graph records: ``token_ids`` is ``arange(n)``, ``slot_of`` a static buffer the
    graph's runner fills before each replay (``-1`` for the base model)."""
    return LoRAMapping(slot_of.shape[0], (), (), token_ids, _NO_TOKENS, None, slot_of, static=True)


def lora_bgmv(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping
) -> None:
    """``y[i] += x[i] A_s^T B_s^T`` for each token ``i`` with ``s = slot_of[i] >= 0`` of a BGMV
    ``mapping``, at the stacked weights' full rank (zero past each adapter's own). CUDA:
    ``kernels/lora_bgmv.cu``, one launch per half whatever the slots; elsewhere its torch
    equivalent, a gather of each token's weights."""
    slot_of = mapping.slot_of
    assert slot_of is not None, "lora_bgmv reads a BGMV mapping"
    from raypaged.kernels import loader

    if loader.on_device(y):
        from raypaged.kernels.lora_ops import lora_bgmv_expand, lora_bgmv_shrink

        h = lora_bgmv_shrink(x, lora_a, mapping.token_ids, slot_of)
        lora_bgmv_expand(y, h, lora_b, mapping.token_ids, slot_of)
        return
    slots = slot_of.clamp(min=0)
    h = torch.bmm(x.unsqueeze(1), lora_a[slots]) * (slot_of >= 0).view(-1, 1, 1).to(x.dtype)  # [n, 1, rank]
    y += torch.bmm(h, lora_b[slots]).squeeze(1)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """``x A_s^T`` per adapter token, in the layout of ``mapping``'s path.

    x: [num_tokens, in]; lora_a: [num_slots, in, rank] -> [num_tokens, rank] (one slot for all),
    [active slots, max_tokens, rank] (padded) or [num_adapter_tokens, rank] (sorted by slot).
    """
    if mapping.one_slot_for_all:
        return x @ lora_a[mapping.slot_ids[0]]
    if mapping.padded is not None:
        batch = x.index_select(0, mapping.padded.token_ids).view(len(mapping.slot_ids), -1, x.shape[1])
        return torch.bmm(batch, _active(lora_a, mapping))
    sorted_x = x.index_select(0, mapping.token_ids)
    h = sorted_x.new_empty(sorted_x.shape[0], lora_a.shape[2])
    for slot, (start, end) in zip(mapping.slot_ids, mapping.segments):
        torch.mm(sorted_x[start:end], lora_a[slot], out=h[start:end])
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping) -> None:
    """``y += h B_s^T`` per adapter token, ``h`` from :func:`lora_shrink`; tokens of no slot keep ``y``.

    y: [num_tokens, out]; lora_b: [num_slots, rank, out].
    """
    if mapping.one_slot_for_all:
        y.addmm_(h, lora_b[mapping.slot_ids[0]])
        return
    if mapping.padded is not None:
        out = torch.bmm(h, _active(lora_b, mapping)).view(-1, y.shape[1])
        y.index_add_(0, mapping.token_ids, out.index_select(0, mapping.padded.rows))
        return
    out = h.new_empty(h.shape[0], y.shape[1])
    for slot, (start, end) in zip(mapping.slot_ids, mapping.segments):
        torch.mm(h[start:end], lora_b[slot], out=out[start:end])
    y.index_add_(0, mapping.token_ids, out)


def add_lora(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping
) -> None:
    """``y[i] += x[i] A_s^T B_s^T`` for each token ``i`` with a slot ``s``, in place; the shapes checked
    (``LoRALinear`` calls the two halves directly with buffers shaped at construction)."""
    num_slots, in_features, rank = lora_a.shape
    if x.shape != (mapping.num_tokens, in_features) or y.shape != (mapping.num_tokens, lora_b.shape[2]):
        raise ValueError(
            f"x {list(x.shape)} and y {list(y.shape)} do not fit a mapping of {mapping.num_tokens} "
            f"tokens and lora_a {list(lora_a.shape)}, lora_b {list(lora_b.shape)}"
        )
    if lora_b.shape[:2] != (num_slots, rank):
        raise ValueError(f"lora_b {list(lora_b.shape)} does not match lora_a {list(lora_a.shape)}")
    if mapping.slot_ids and mapping.slot_ids[-1] >= num_slots:
        raise ValueError(f"the mapping reads slot {mapping.slot_ids[-1]} of {num_slots}")
    if mapping.slot_of is not None:
        lora_bgmv(y, x, lora_a, lora_b, mapping)
    elif not mapping.is_empty:
        lora_expand(y, lora_shrink(x, lora_a, mapping), lora_b, mapping)


def add_lora_reference(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, token_slots: Sequence[int | None]
) -> None:
    """:func:`add_lora` as one gather of each token's weights and two batched products (slow; the spec)."""
    rows = [i for i, slot in enumerate(token_slots) if slot is not None]
    if not rows:
        return
    index = torch.tensor(rows, device=x.device)
    slots = torch.tensor([token_slots[i] for i in rows], device=x.device)
    h = torch.bmm(x[index].unsqueeze(1), lora_a[slots])  # [n, 1, rank]
    y[index] += torch.bmm(h, lora_b[slots]).squeeze(1)


def _active(stacked: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    if len(mapping.slot_ids) == stacked.shape[0]:
        return stacked
    return stacked.index_select(0, mapping.slots_tensor)
