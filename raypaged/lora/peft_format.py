"""Reading a PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors`` or ``.bin``).

The result keeps the checkpoint's layout (one A and B per projection of each layer, the
scale folded into B); ``layout`` turns it into the model's fused, sharded slots. Anything
that would change the adapter's forward beyond ``scale * x A^T B^T`` is refused by name.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# every architecture's projections (Phi-3's qkv_proj and gate_up_proj are fused in its checkpoint, and so in its
# adapters: layout.checkpoint_shapes has each model's own)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}
_UNSUPPORTED_MODULES = ("embed_tokens", "lm_head")
# config fields that change the forward (or the saved layout) when set: field -> what it is
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable_token_indices",
    "layer_replication": "layer_replication",
    "alpha_pattern": "alpha_pattern",
    "target_parameters": "LoRA on parameters (target_parameters, as of a mixture of experts' expert weights)",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "BD-LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(" + "|".join(PROJECTIONS) + r")\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One projection's adapter: ``delta = x @ lora_a.T @ lora_b.T``, the scale already in ``lora_b``."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True, slots=True)
class PeftAdapter:
    """An adapter as its checkpoint holds it: ``weights[(layer_index, projection)]``, e.g. ``(0, "q_proj")``."""

    name: str
    rank: int  # the largest rank of any projection
    base_model_name_or_path: str | None
    weights: dict[tuple[int, str], LoRAWeights]


def read_peft_adapter(name: str, path: str | Path, max_lora_rank: int) -> PeftAdapter:
    """The adapter in folder ``path``; ``ValueError`` naming ``name`` and the problem when it cannot be served."""
    folder = Path(path)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {folder}")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {name!r}: {config_file} is not valid JSON ({e})") from None
    _check_config(name, config, max_lora_rank)
    tensors = _read_tensors(name, folder)
    scale_of = _scaling(config)
    matches = {key: _KEY.search(key) for key in tensors}
    unsupported = [key for key, match in matches.items() if match is None]
    if unsupported:  # the most specific reason of any of them
        raise ValueError(f"LoRA adapter {name!r}: {min(map(_why_unsupported, unsupported))[1]}")
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, match in matches.items():
        assert match is not None
        layer, parent, projection, which = match.groups()
        if _PARENT[projection] != parent:
            raise ValueError(f"LoRA adapter {name!r}: weight {key!r} targets a module the model lacks")
        pairs.setdefault((int(layer), projection), {})[which] = tensors[key]
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: the checkpoint holds no LoRA weights")
    weights = {}
    for (layer, projection), pair in sorted(pairs.items(), key=lambda kv: (kv[0][0], PROJECTIONS.index(kv[0][1]))):
        where = f"layer {layer} {projection}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise ValueError(f"LoRA adapter {name!r}: {where} has no {missing} weight")
        lora_a, lora_b = pair["A"], pair["B"]
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != lora_b.shape[1]:
            raise ValueError(
                f"LoRA adapter {name!r}: {where} lora_A {list(lora_a.shape)} and lora_B {list(lora_b.shape)} "
                "do not share a rank"
            )
        rank = lora_a.shape[0]
        if rank > max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_lora_rank}")
        # in fp32 whatever the checkpoint's dtype: the scale is folded in before any cast to the model's
        weights[(layer, projection)] = LoRAWeights(lora_a.float(), lora_b.float() * scale_of(rank))
    return PeftAdapter(name, max(w.rank for w in weights.values()), config.get("base_model_name_or_path"), weights)


def _check_config(name: str, config: dict[str, Any], max_lora_rank: int) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported (only LORA)")
    bias = config.get("bias", "none")
    if bias != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {bias!r} is not supported (only 'none')")
    for field, what in _REFUSED_FIELDS.items():
        if config.get(field):
            raise ValueError(f"LoRA adapter {name!r}: {what} is not supported")
    rank = config.get("r", 8)
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_lora_rank}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            _check_target(name, target)


def _check_target(name: str, target: str) -> None:
    module = target.rsplit(".", 1)[-1]
    if module in PROJECTIONS:
        return
    if module in _UNSUPPORTED_MODULES:
        raise ValueError(
            f"LoRA adapter {name!r}: LoRA on {module!r} is not supported (supported: {', '.join(PROJECTIONS)})"
        )
    raise ValueError(
        f"LoRA adapter {name!r} targets module {target!r}, which the model lacks "
        f"(LoRA applies to {', '.join(PROJECTIONS)})"
    )


def _why_unsupported(key: str) -> tuple[int, str]:  # (0 for a named feature, the reason)
    if "lora_magnitude_vector" in key:
        return 0, f"DoRA weight {key!r} is not supported"
    if "lora_embedding_" in key:
        return 0, f"LoRA on embeddings ({key!r}) is not supported"
    if "modules_to_save" in key:
        return 0, f"modules_to_save weight {key!r} is not supported"
    if ".lora_B.bias" in key:
        return 0, f"LoRA bias {key!r} is not supported"
    for module in _UNSUPPORTED_MODULES:
        if f"{module}.lora_" in key:
            return 0, f"LoRA on {module!r} ({key!r}) is not supported (supported: {', '.join(PROJECTIONS)})"
    return 1, f"weight {key!r} targets a module the model lacks (LoRA applies to {', '.join(PROJECTIONS)})"


def _scaling(config: dict[str, Any]) -> Callable[[int], float]:
    alpha = config.get("lora_alpha", 8)
    if config.get("use_rslora", False):
        return lambda rank: alpha / math.sqrt(rank)
    return lambda rank: alpha / rank


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    safetensors_file, bin_file = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {folder}")
