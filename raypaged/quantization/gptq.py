"""``--quantization gptq``: GPTQ checkpoints (``quant_method: gptq``), 4 or 8 bits, any group size,
with or without act-order (``desc_act``), symmetric or not (zeros are stored either way)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raypaged.quantization.base import LinearMethod, QuantizationConfig, is_ignored, known_keys
from raypaged.quantization.wna16 import GPTQMethod

# fields of GPTQ configs that describe how the checkpoint was made, not how it is read
_PROVENANCE = {
    "damp_percent",
    "true_sequential",
    "static_groups",
    "model_name_or_path",
    "model_file_base_name",
    "quantizer",
    "pack_dtype",
    "meta",
    "damp_auto_increment",
    "mse",
    "v2",
    "v2_alpha",
    "hyb_act",
    "act_group_aware",
    "tokenizer",
    "dataset",
    "use_cuda_fp16",
    "use_exllama",
    "exllama_config",
    "max_input_length",
    "cache_block_outputs",
    "batch_size",
    "module_name_preceding_first_block",
    "modules_in_block_to_quantize",
    "backend",
    "format",
    "lm_head",
}


@dataclass(frozen=True, slots=True)
class GPTQConfig(QuantizationConfig):
    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str = "gptq"
    modules_to_not_convert: tuple[str, ...] = ()
    name = "gptq"

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> GPTQConfig:
        known_keys(
            "gptq",
            config,
            {
                "quant_method",
                "bits",
                "group_size",
                "desc_act",
                "sym",
                "checkpoint_format",
                "modules_to_not_convert",
                "dynamic",
            }
            | _PROVENANCE,
        )
        if config.get("dynamic"):
            raise ValueError("gptq dynamic (per-module bits and group sizes) is not supported")
        if config.get("lm_head"):
            raise ValueError("gptq lm_head true (a quantized LM head) is not supported")
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"gptq bits {bits} is not supported (supported: 4, 8)")
        group_size = int(config.get("group_size", 128))
        if group_size != -1 and group_size < 1:
            raise ValueError(f"gptq group_size {group_size} is not supported (a positive size or -1)")
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
        return cls(
            bits,
            group_size,
            bool(config.get("desc_act", False)),
            bool(config.get("sym", True)),
            fmt,
            tuple(config.get("modules_to_not_convert") or ()),
        )

    def linear_method(self, part_names: tuple[str, ...]) -> LinearMethod | None:
        if is_ignored(part_names, self.modules_to_not_convert, "gptq", substring=True):
            return None
        return GPTQMethod(self.bits, self.group_size, self.desc_act, 1 if self.checkpoint_format == "gptq" else 0)
