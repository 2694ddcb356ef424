"""Checkpoints that keep every expert of a layer in stacked tensors (gpt-oss, Llama 4, Qwen3-VL-MoE), under the names of
raypaged's mixture-of-experts layers: each expert's tensors come out as a Mixtral expert's under Qwen-MoE's names
(``mlp.experts.<e>.gate_proj.weight``, ...), the router's as ``mlp.gate``.

transformers' stacked form: ``experts.gate_up_proj`` ``[E, hidden, 2I]`` (applied as ``x @ W``; gpt-oss interleaves
gate and up column by column, Llama 4 puts gate's I columns first), ``experts.down_proj`` ``[E, I, hidden]``, and
gpt-oss's ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, hidden]``. gpt-oss's published checkpoints
hold the two weights as MXFP4 instead (``*_blocks``/``*_scales`` in the weights' ``[E, out, in]`` form),
dequantized here to the model's dtype. Llama 4 calls its MLP ``feed_forward``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from raypaged.quantization import mxfp4

STACKED_EXPERT_TYPES = ("gpt_oss", "llama4_text", "qwen3_vl_moe_text")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_RENAMES = {
    "gpt_oss": ((".mlp.router.", ".mlp.gate."),),
    "llama4_text": ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.", ".mlp.")),
    "qwen3_vl_moe_text": (),
}


def expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], model_type: str, dtype: torch.dtype, hidden_size: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` of a ``STACKED_EXPERT_TYPES`` checkpoint with the stacked expert tensors split into each expert's
    (MXFP4 ones dequantized to ``dtype`` once both their blocks and scales have come) and the MLP and router renamed;
    the others as they are. Qwen3-VL-MoE's come either way: ``[E, in, out]`` as published, or ``[E, out, in]`` as
    transformers 5 saves them, told apart by which side is ``hidden_size``."""
    interleaved = model_type == "gpt_oss"
    pending: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 weight's name -> its blocks or scales so far
    for name, tensor in weights:
        for old, new in _RENAMES[model_type]:
            name = name.replace(old, new)
        match = _STACKED.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, projection, kind = match[1], match[2], match[3] or ""
        if kind in ("_blocks", "_scales"):
            parts = pending.setdefault(f"{prefix}.{projection}", {})
            parts[kind] = tensor
            if len(parts) < 2:
                continue
            del pending[f"{prefix}.{projection}"]
            weight = mxfp4.dequantize(parts["_blocks"], parts["_scales"], dtype)  # [E, out, in]
            yield from _experts(prefix, projection, "weight", weight, False, interleaved)
        elif kind == "_bias":
            yield from _experts(prefix, projection, "bias", tensor, False, interleaved)
        else:
            transposed = model_type != "qwen3_vl_moe_text" or _stored_in_out(projection, tensor, hidden_size)
            yield from _experts(prefix, projection, "weight", tensor, transposed, interleaved)
    if pending:
        name, parts = next(iter(pending.items()))
        lacking = "_scales" if "_blocks" in parts else "_blocks"
        raise ValueError(f"checkpoint has {name}{next(iter(parts))} but not {name}{lacking}")


def _stored_in_out(projection: str, stacked: torch.Tensor, hidden_size: int) -> bool:
    """Whether a stacked weight is ``[E, in, out]``: gate_up's ``[E, hidden, 2I]`` (not ``[E, 2I, hidden]``), down's
    ``[E, I, hidden]`` (not ``[E, hidden, I]``); the published form where both sides are the hidden size."""
    if projection == "down_proj":
        return stacked.shape[2] == hidden_size
    return stacked.shape[1] == hidden_size


def _experts(
    prefix: str, projection: str, kind: str, stacked: torch.Tensor, transposed: bool, interleaved: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert's tensors of one stacked ``[E, ...]`` tensor: a weight as ``[out, in]`` (``transposed``: stored
    ``[E, in, out]``), gate_up's rows split into gate_proj and up_proj (``interleaved``: the even and odd rows; else
    the first and second halves)."""
    for index, tensor in enumerate(stacked):
        if transposed:
            tensor = tensor.t()
        base = f"{prefix}.{index}"
        if projection == "down_proj":
            yield f"{base}.down_proj.{kind}", tensor.contiguous()
            continue
        gate, up = (tensor[0::2], tensor[1::2]) if interleaved else tensor.chunk(2)
        yield f"{base}.gate_proj.{kind}", gate.contiguous()
        yield f"{base}.up_proj.{kind}", up.contiguous()
