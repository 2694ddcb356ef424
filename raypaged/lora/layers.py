"""LoRA attached to a built model by wrapping its linears, whatever their class.

``LoRALinear(base)`` returns ``base(x)`` plus each token's adapter product from its slot.
A row-parallel base (input features sharded) sums its ranks' shares in one all-reduce; its
LoRA term rides in the same one: each rank adds ``(x_shard A_shard^T) B^T`` to its share
before the all-reduce (the product is linear in the shards, so the sum is the unsharded
``x A^T B^T``), and the base's bias is added once after. Every rank must see the same mapping
(the driver sends one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from raypaged.lora.layout import LoRATarget, find_targets, target_rank
from raypaged.lora.ops import LoRAMapping, lora_bgmv, lora_expand, lora_shrink, static_bgmv_mapping
from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.parallel import RowParallelLinear, TensorParallel
from raypaged.quantization.linear import QuantLinear


@dataclass(slots=True)
class LoRAStep:
    """The mapping every wrapped linear of one model reads; set before each forward."""

    mapping: LoRAMapping | None = None


class StaticSlots:
    """The slot buffer CUDA graphs record the LoRA product with (BGMV at the slots' full rank):
    a graph is recorded under :meth:`recording`, and each replay first :meth:`fill` s the buffer
    from the step's BGMV mapping, so one graph serves any adapters in any slots."""

    def __init__(self, step: LoRAStep, rows: int, device: torch.device) -> None:
        self.step = step
        self.token_ids = torch.arange(rows, dtype=torch.long, device=device)
        self.slot_of = torch.full((rows,), -1, dtype=torch.long, device=device)

    @contextlib.contextmanager
    def recording(self, rows: int) -> Iterator[None]:
        """The model's linears read the buffer's first ``rows`` rows (the step's mapping is set aside)."""
        saved = self.step.mapping
        self.step.mapping = static_bgmv_mapping(self.token_ids[:rows], self.slot_of[:rows])
        try:
            yield
        finally:
            self.step.mapping = saved

    def fill(self, rows: int, padded: int) -> None:
        """The step's slots into the first ``rows`` rows (none: the base model's ``-1``), ``-1`` up to ``padded``."""
        mapping = self.step.mapping
        if mapping is not None and mapping.slot_of is not None:
            self.slot_of[:rows].copy_(mapping.slot_of)
        else:
            self.slot_of[:rows].fill_(-1)
        self.slot_of[rows:padded].fill_(-1)


class LoRALinear(nn.Module):
    """``base(x) + x A_s^T B_s^T`` for each token's slot ``s``; slots hold zeros until written.

    A step reads only the first ``max(slot_ranks)`` rank columns of its active slots, so a linear
    none of them adapts costs nothing beyond its base (identical on every rank: the same adapters).
    A BGMV mapping reads every rank column (``lora_bgmv``); a static one (recorded in a CUDA graph)
    runs even when no slot adapts the linear, since the graph replays for whatever is placed later.
    """

    lora_a: torch.Tensor  # [num_slots, in_features, rank]
    lora_b: torch.Tensor  # [num_slots, rank, out_features]

    def __init__(
        self,
        base: nn.Module,
        target: LoRATarget,
        num_slots: int,
        max_lora_rank: int,
        step: LoRAStep,
        tp: TensorParallel,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.target = target
        self.step = step
        self.tp = tp
        rank = target_rank(target, max_lora_rank)
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, target.in_features, rank, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "lora_b", torch.zeros(num_slots, rank, target.out_features, dtype=dtype, device=device), persistent=False
        )
        self.slot_ranks = [0] * num_slots  # rank columns each slot's adapter fills here (0: not adapted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
        mapping = self.step.mapping
        if mapping is None or mapping.is_empty:
            return self.base(x)
        if mapping.num_tokens != x.shape[0]:
            raise RuntimeError(f"the LoRA mapping is for {mapping.num_tokens} tokens but the step has {x.shape[0]}")
        rank = self.lora_a.shape[2] if mapping.static else max(self.slot_ranks[slot] for slot in mapping.slot_ids)
        if rank == 0:
            return self.base(x)
        # a row-parallel base (build_linear's for o_proj, down_proj): the LoRA term joins its share before the reduce
        row_base = self.base if self.target.row_parallel else None
        assert row_base is None or isinstance(row_base, (RowParallelLinear, QuantLinear))
        y = self.base(x) if row_base is None else row_base.partial(x)
        if mapping.slot_of is not None:
            lora_bgmv(y, x, self.lora_a, self.lora_b, mapping)
        else:
            lora_expand(y, lora_shrink(x, self.lora_a[:, :, :rank], mapping), self.lora_b[:, :rank], mapping)
        return y if row_base is None else row_base.reduce(y)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write ``(A^T [in, r], B^T [r, out])`` into ``slot`` (zeros past rank ``r``); ``None`` zeroes it."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_ranks[slot] = 0
        if weights is not None:
            a_t, b_t = weights
            self.lora_a[slot, :, : a_t.shape[1]].copy_(a_t)
            self.lora_b[slot, : b_t.shape[0]].copy_(b_t)
            self.slot_ranks[slot] = a_t.shape[1]


@dataclass(frozen=True, slots=True)
class LoRAModel:
    """A model with its linears wrapped: ``linears`` by target path, all reading ``step``."""

    targets: list[LoRATarget]
    linears: dict[str, LoRALinear]
    step: LoRAStep


def attach_lora(
    model: LlamaForCausalLM,
    num_slots: int,
    max_lora_rank: int,
    tp: TensorParallel,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRAModel:
    """Wrap every LoRA target of ``model`` (after its weights are loaded: parameter names change)."""
    targets = find_targets(model, tp)
    step = LoRAStep()
    linears = {}
    for target in targets:
        parent_path, name = target.path.rsplit(".", 1)
        parent = model.get_submodule(parent_path)
        linear = LoRALinear(getattr(parent, name), target, num_slots, max_lora_rank, step, tp, dtype, device)
        setattr(parent, name, linear)
        linears[target.path] = linear
    return LoRAModel(targets, linears, step)
