"""Where each projection's adapter goes in the model: fused into ``qkv_proj`` / ``gate_up_proj``
and sharded the way the base linear is.

A column-parallel linear (``qkv_proj``, ``gate_up_proj``) holds this rank's output rows of
each fused projection: its adapter keeps A whole and takes the same rows of B. A row-parallel
linear (``o_proj``, ``down_proj``) holds a slice of the input features: A takes those columns,
B stays whole (the partial ``x_shard A_shard^T`` products add up over the ranks).
A fused linear's adapter stacks its projections' ranks: A is ``[sum of ranks, in]`` and B is
block diagonal, so one product covers q, k and v whatever subset of them the adapter has. A Phi-3
adapter adapts ``qkv_proj`` and ``gate_up_proj`` as its checkpoint holds them, whole: one A, and each
part's rows of B from where the part starts in them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from raypaged.lora.peft_format import PROJECTIONS, PeftAdapter, read_peft_adapter
from raypaged.lora.request import LoRARequest
from raypaged.model.architecture import architecture_of
from raypaged.model.llama import LlamaForCausalLM, head_dim_of
from raypaged.model.parallel import TensorParallel

# fused linear -> the checkpoint projections it holds, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True, slots=True)
class ProjectionSlice:
    """One checkpoint projection inside a model linear on this rank."""

    projection: str  # "q_proj", ...
    in_start: int  # first input feature this rank holds
    in_len: int
    out_first_row: int  # first checkpoint output row this rank holds
    out_offset: int  # where those rows start in the model linear's output
    out_rows: int
    fused_start: int = 0  # where the projection's rows start in the fused linear (Phi-3's adapters adapt it whole)


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """A model linear that takes LoRA: ``path`` in the built model (``model.layers.{i}.{parent}.{name}``, ``i`` its
    place in a pipeline stage's layers), the model's ``layer_index`` (the adapter's layer)."""

    path: str
    layer_index: int
    name: str  # "qkv_proj", "o_proj", "gate_up_proj" or "down_proj"
    slices: tuple[ProjectionSlice, ...]
    in_features: int  # this rank's
    out_features: int  # this rank's
    row_parallel: bool  # input features sharded (o_proj, down_proj): the base all-reduces its output


def checkpoint_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection's checkpoint weight: the ones an adapter of the model may adapt (of a mixture
    of experts, the attention's)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * head_dim_of(config)
    kv_out = config.num_key_value_heads * head_dim_of(config)
    arch = architecture_of(config)
    attention = {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden)}
    attention["o_proj"] = (hidden, q_out)
    if arch.moe is not None:  # the attention's only: an MLP projection of these models is an expert's
        return attention
    if arch.fused_checkpoint:  # Phi-3: q, k and v fused too
        attention = {"qkv_proj": (q_out + 2 * kv_out, hidden), "o_proj": attention["o_proj"]}
    if arch.fused_gate_up:
        return attention | {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    return attention | {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def check_adapter_fits(adapter: PeftAdapter, config: PretrainedConfig) -> None:
    """``ValueError`` unless every weight of ``adapter`` has a layer and the shape of the model's
    projection (an adapter of another base model fails here); needs only the model's config."""
    shapes = checkpoint_shapes(config)
    for (layer, projection), weights in adapter.weights.items():
        if projection not in shapes:
            raise ValueError(
                f"LoRA adapter {adapter.name!r}: layer {layer} {projection} targets a module the model lacks (its "
                f"projections: {', '.join(sorted(shapes, key=PROJECTIONS.index))}){_trained_on(adapter)}"
            )
        if layer >= config.num_hidden_layers:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has weights for layer {layer} {projection}, but the model has "
                f"{config.num_hidden_layers} layers{_trained_on(adapter)}"
            )
        got = (weights.lora_b.shape[0], weights.lora_a.shape[1])
        if got != shapes[projection]:
            raise ValueError(
                f"LoRA adapter {adapter.name!r}: layer {layer} {projection} is {list(got)} (out, in) but the "
                f"model's is {list(shapes[projection])}{_trained_on(adapter)}"
            )


def read_checked_adapter(request: LoRARequest, config: PretrainedConfig, max_lora_rank: int) -> PeftAdapter:
    """``request``'s adapter read and checked against the model's config: every ``ValueError`` an
    adapter load can raise (an HTTP 400), without the model itself (the driver can call it)."""
    adapter = read_peft_adapter(request.lora_name, request.lora_path, max_lora_rank)
    check_adapter_fits(adapter, config)
    return adapter


def find_targets(model: LlamaForCausalLM, tp: TensorParallel) -> list[LoRATarget]:
    """Every linear of a built Llama-family ``model`` that takes LoRA, with its projections' shards. A pipeline
    stage's: its own layers (module paths by their place in the stage, adapter weights by the model's layer index)."""
    shapes = checkpoint_shapes(model.config)
    hidden = model.config.hidden_size
    targets = []
    layer: nn.Module
    parents = [("self_attn", "qkv_proj", "o_proj"), ("mlp", "gate_up_proj", "down_proj")]
    if model.architecture.moe is not None:  # see checkpoint_shapes
        parents = parents[:1]
    first_layer = model.model.first_layer
    for index, layer in enumerate(model.model.layers):
        layer_index = first_layer + index
        for parent_name, fused, row in parents:
            parent = getattr(layer, parent_name)
            slices = []
            for shard, projection in enumerate(FUSED[fused]):
                first_row, offset, rows = parent.fused_rows(shard)
                slices.append(
                    ProjectionSlice(projection, 0, hidden, first_row, offset, rows, parent.part_starts[shard])
                )
            prefix = f"model.layers.{index}.{parent_name}"
            targets.append(
                LoRATarget(
                    f"{prefix}.{fused}",
                    layer_index,
                    fused,
                    tuple(slices),
                    hidden,
                    sum(s.out_rows for s in slices),
                    row_parallel=False,
                )
            )
            in_start, in_len = tp.chunk(shapes[row][1])
            row_slice = ProjectionSlice(row, in_start, in_len, 0, 0, hidden)
            targets.append(
                LoRATarget(f"{prefix}.{row}", layer_index, row, (row_slice,), in_len, hidden, row_parallel=True)
            )
    return targets


def target_rank(target: LoRATarget, max_lora_rank: int) -> int:
    """Columns of the target's stacked A: room for every projection at the largest rank."""
    return len(target.slices) * max_lora_rank


def shard_adapter(
    adapter: PeftAdapter, targets: list[LoRATarget], dtype: torch.dtype
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``(A^T [in, rank], B^T [rank, out])`` for each target path the adapter touches
    (an adapter that passed :func:`check_adapter_fits`)."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for target in targets:
        whole = adapter.weights.get((target.layer_index, target.name)) if len(target.slices) > 1 else None
        if whole is not None:  # a Phi-3 adapter's qkv_proj or gate_up_proj: one A, each part's rows of B
            b_t = torch.zeros(whole.rank, target.out_features, dtype=dtype)
            for piece in target.slices:
                rows = whole.lora_b[piece.fused_start + piece.out_first_row :][: piece.out_rows]
                b_t[:, piece.out_offset : piece.out_offset + piece.out_rows] = rows.T
            out[target.path] = (whole.lora_a.T.to(dtype).contiguous(), b_t)  # column-parallel: every input feature
            continue
        present = [
            (s, adapter.weights[(target.layer_index, s.projection)])
            for s in target.slices
            if (target.layer_index, s.projection) in adapter.weights
        ]
        if not present:
            continue
        rank = sum(w.rank for _, w in present)
        a_t = torch.zeros(target.in_features, rank, dtype=dtype)
        b_t = torch.zeros(rank, target.out_features, dtype=dtype)
        column = 0
        for piece, weights in present:
            cols = slice(column, column + weights.rank)
            a_t[:, cols] = weights.lora_a[:, piece.in_start : piece.in_start + piece.in_len].T
            b_rows = weights.lora_b[piece.out_first_row : piece.out_first_row + piece.out_rows]
            b_t[cols, piece.out_offset : piece.out_offset + piece.out_rows] = b_rows.T
            column += weights.rank
        out[target.path] = (a_t, b_t)
    return out


def _trained_on(adapter: PeftAdapter) -> str:
    base = adapter.base_model_name_or_path
    return f" (the adapter was made for {base!r})" if base else ""
