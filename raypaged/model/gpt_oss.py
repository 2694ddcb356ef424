"""gpt-oss's checkpoint tensors under the names of raypaged's mixture-of-experts layers.

transformers keeps every expert of a layer in stacked tensors: ``mlp.experts.gate_up_proj`` ``[E, hidden, 2I]``
(applied as ``x @ W``, gate and up interleaved column by column), ``gate_up_proj_bias`` ``[E, 2I]``,
``down_proj`` ``[E, I, hidden]`` and ``down_proj_bias`` ``[E, hidden]``; the published checkpoints hold the two
weights as MXFP4 instead (``gate_up_proj_blocks``/``_scales`` ``[E, 2I, hidden/32, ...]`` and
``down_proj_blocks``/``_scales`` ``[E, hidden, I/32, ...]``, the weights' ``[out, in]`` form), dequantized here to
the model's dtype. Each expert's tensors come out as a Mixtral expert's under Qwen-MoE's names
(``mlp.experts.<e>.gate_proj.weight``, ...), the router's (``mlp.router``) as ``mlp.gate``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from raypaged.quantization import mxfp4

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with gpt-oss's stacked expert tensors split into each expert's (MXFP4 ones dequantized to
    ``dtype`` once both their blocks and scales have come) and the router renamed; the others as they are."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 weight's name -> its blocks or scales so far
    for name, tensor in weights:
        match = _STACKED.match(name)
        if match is None:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        prefix, projection, kind = match[1], match[2], match[3] or ""
        if kind in ("_blocks", "_scales"):
            parts = pending.setdefault(f"{prefix}.{projection}", {})
            parts[kind] = tensor
            if len(parts) < 2:
                continue
            del pending[f"{prefix}.{projection}"]
            weight = mxfp4.dequantize(parts["_blocks"], parts["_scales"], dtype)  # [E, out, in]
            yield from _experts(prefix, projection, "weight", weight, transposed=False)
        elif kind == "_bias":
            yield from _experts(prefix, projection, "bias", tensor, transposed=False)
        else:
            yield from _experts(prefix, projection, "weight", tensor, transposed=True)
    if pending:
        name, parts = next(iter(pending.items()))
        lacking = "_scales" if "_blocks" in parts else "_blocks"
        raise ValueError(f"checkpoint has {name}{next(iter(parts))} but not {name}{lacking}")


def _experts(
    prefix: str, projection: str, kind: str, stacked: torch.Tensor, transposed: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expert's tensors of one stacked ``[E, ...]`` tensor: a weight as ``[out, in]`` (``transposed``: stored
    ``[E, in, out]``), gate_up's rows de-interleaved into gate_proj (even) and up_proj (odd)."""
    for index, tensor in enumerate(stacked):
        if transposed:
            tensor = tensor.t()
        base = f"{prefix}.{index}"
        if projection == "down_proj":
            yield f"{base}.down_proj.{kind}", tensor.contiguous()
        else:
            yield f"{base}.gate_proj.{kind}", tensor[0::2].contiguous()
            yield f"{base}.up_proj.{kind}", tensor[1::2].contiguous()
