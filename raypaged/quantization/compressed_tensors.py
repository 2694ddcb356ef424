"""``--quantization compressed-tensors``: the format of llm-compressor's published checkpoints.

Read schemes (one per ``config_groups`` entry, chosen for a module by its ``targets``): W8A8 int8
(``int-quantized``: int8 weights with per-channel or per-tensor scales, int8 activations per token
or per tensor), W8A8 fp8 (``float-quantized``, the same in fp8 e4m3) and W4A16/W8A16
(``pack-quantized``: packed int weights with group or channel scales, symmetric or with zero points),
and W8A8 fp8 with block-wise weight scales (``FP8_BLOCK``: ``strategy: block``, activations per token and
group of the block's inputs). A ``kv_cache_scheme`` of static per-tensor fp8 K/V scales is read too, alone or
beside the groups: the checkpoint's ``k_scale``/``v_scale`` then scale an fp8 KV cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from raypaged.quantization.base import LinearMethod, QuantizationConfig, known_keys
from raypaged.quantization.block_fp8 import BlockFp8Method, block_shape
from raypaged.quantization.w8a8 import FP8, W8A8Method
from raypaged.quantization.wna16 import PackedMethod

_TOP_KEYS = {
    "quant_method",
    "format",
    "quantization_status",
    "config_groups",
    "ignore",
    "kv_cache_scheme",
    "global_compression_ratio",
    "sparsity_config",
    "transform_config",
    "version",
    "provider",
}
_ARG_KEYS = {
    "num_bits",
    "type",
    "symmetric",
    "strategy",
    "dynamic",
    "group_size",
    "block_structure",
    "actorder",
    "observer",
    "observer_kwargs",
    "scale_dtype",
    "zp_dtype",
}


@dataclass(frozen=True, slots=True)
class Scheme:
    """One config group's scheme, reduced to what the kernels need."""

    format: str  # int-quantized, float-quantized, pack-quantized
    bits: int
    group_size: int | None  # None: one scale per output channel (or per tensor for the 8-bit formats)
    symmetric: bool
    static_input: bool
    block: tuple[int, int] | None = None  # [block_n, block_k] of block-wise fp8 weight scales

    def method(self) -> LinearMethod:
        if self.block is not None:
            return BlockFp8Method(*self.block, scale_name="weight_scale")
        if self.format == "pack-quantized":
            return PackedMethod(self.bits, self.group_size, self.symmetric)
        return W8A8Method(torch.int8 if self.format == "int-quantized" else FP8, self.static_input)


def _args(where: str, args: dict[str, Any]) -> dict[str, Any]:
    known_keys(f"compressed-tensors {where}", args, _ARG_KEYS)
    if args.get("dynamic") not in (False, None) and where == "weights":
        raise ValueError("compressed-tensors weights dynamic true is not supported")
    if args.get("block_structure") is not None and (where != "weights" or args.get("strategy") != "block"):
        raise ValueError(f"compressed-tensors {where} block_structure {args['block_structure']} is not supported")
    return args


def parse_scheme(name: str, group: dict[str, Any], default_format: str | None) -> Scheme:
    """The scheme of config group ``name``; ``ValueError`` naming the part that is not supported."""
    fmt = group.get("format") or default_format
    weights = _args("weights", group.get("weights") or {})
    inputs = group.get("input_activations")
    if group.get("output_activations") is not None:
        raise ValueError(f"compressed-tensors {name}: output_activations quantization is not supported")
    if not weights:
        raise ValueError(f"compressed-tensors {name}: a config group without weights quantization is not supported")
    kind, bits, strategy = weights.get("type", "int"), int(weights.get("num_bits", 8)), weights.get("strategy")
    symmetric = bool(weights.get("symmetric", True))
    if weights.get("actorder") not in (None, "weight", "static"):
        raise ValueError(
            f"compressed-tensors {name}: weights actorder {weights['actorder']!r} (a stored g_idx) is not supported"
        )
    described = (
        f"format {fmt}, weights {kind}{bits} {strategy}"
        + (f" (group {weights.get('group_size')})" if strategy == "group" else "")
        + (f" {weights.get('block_structure')}" if strategy == "block" else "")
        + (
            ""
            if inputs is None
            else f", input_activations {inputs.get('type')}{inputs.get('num_bits')} {inputs.get('strategy')}"
        )
    )
    if (
        fmt == "pack-quantized"
        and inputs is None
        and kind == "int"
        and bits in (4, 8)
        and strategy in ("group", "channel")
    ):
        return Scheme(fmt, bits, int(weights["group_size"]) if strategy == "group" else None, symmetric, False)
    if (block := _fp8_block(fmt, kind, bits, symmetric, strategy, weights, inputs)) is not None:
        return Scheme("float-quantized", 8, None, True, False, block)
    kinds = {"int-quantized": "int", "float-quantized": "float"}  # the 8-bit formats' weight and input type
    if (
        fmt in kinds
        and inputs is not None
        and kind == kinds[fmt]
        and bits == 8
        and symmetric
        and strategy in ("channel", "tensor")
    ):
        inputs = _args("input_activations", inputs)
        dynamic_token = bool(inputs.get("dynamic")) and inputs.get("strategy") == "token"
        static_tensor = not inputs.get("dynamic") and inputs.get("strategy") == "tensor"
        if (
            inputs.get("type") == kind
            and int(inputs.get("num_bits", 0)) == 8
            and inputs.get("symmetric", True)
            and (dynamic_token or static_tensor)
        ):
            return Scheme(fmt, 8, None, True, static_tensor)
    raise ValueError(
        f"compressed-tensors scheme {name} ({described}) is not supported (supported: W8A8 int-quantized or "
        "float-quantized with channel/tensor weights and dynamic per-token or static per-tensor activations; "
        "W4A16/W8A16 pack-quantized with group or channel weights; float-quantized fp8 block weights with dynamic "
        "fp8 activations per group of the block's inputs)"
    )


def _fp8_block(
    fmt: str | None,
    kind: str,
    bits: int,
    symmetric: bool,
    strategy: str | None,
    weights: dict[str, Any],
    inputs: dict[str, Any] | None,
) -> tuple[int, int] | None:
    """[block_n, block_k] of an FP8_BLOCK scheme (fp8 weights in blocks, fp8 activations dynamic per token and
    group of block_k inputs), else None."""
    block = block_shape(weights.get("block_structure"))
    if block is None or not (
        fmt == "float-quantized" and kind == "float" and bits == 8 and symmetric and strategy == "block"
    ):
        return None
    inputs = _args("input_activations", inputs or {})
    if (
        inputs.get("type") == "float"
        and int(inputs.get("num_bits", 0)) == 8
        and inputs.get("symmetric", True)
        and inputs.get("dynamic")
        and inputs.get("strategy") == "group"
        and inputs.get("group_size") == block[1]
    ):
        return block
    return None


# the kv_cache_scheme read here, and the one the reference quantizer writes: static per-tensor fp8 K/V
KV_CACHE_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "strategy": "tensor",
    "dynamic": False,
    "group_size": None,
    "block_structure": None,
    "actorder": None,
    "observer": "minmax",
    "observer_kwargs": {},
}


def check_kv_cache_scheme(scheme: dict[str, Any]) -> None:
    """``kv_cache_scheme``: fp8 (8-bit float) K/V with one static symmetric scale per tensor (``KV_CACHE_SCHEME``'s
    values, the observer aside), or an error naming the field that differs (per-head scales, dynamic ones, int8)."""
    known_keys("compressed-tensors kv_cache_scheme", scheme, _ARG_KEYS)
    for key in ("num_bits", "type", "strategy", "dynamic", "symmetric"):
        value = KV_CACHE_SCHEME[key]
        if scheme.get(key, value) != value:
            raise ValueError(
                f"compressed-tensors kv_cache_scheme {key} {scheme[key]!r} is not supported (fp8 K/V with one static "
                "symmetric scale per tensor: num_bits 8, type float, strategy tensor, dynamic false)"
            )
    for key in ("group_size", "block_structure", "actorder"):
        if scheme.get(key) is not None:
            raise ValueError(f"compressed-tensors kv_cache_scheme {key} {scheme[key]!r} is not supported")


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern in (name, "Linear")


@dataclass(frozen=True, slots=True)
class CompressedTensorsConfig(QuantizationConfig):
    groups: tuple[tuple[tuple[str, ...], Scheme], ...]  # (targets, scheme), first match wins
    ignore: tuple[str, ...] = ()
    # kv_cache_scheme: static per-tensor fp8 K/V scales in the checkpoint (each attention's k_scale and v_scale,
    # which LlamaForCausalLM.load_weights reads; they apply to an fp8 KV cache, --kv-cache-dtype fp8)
    kv_cache_scales: bool = False
    name = "compressed-tensors"

    @classmethod
    def from_checkpoint(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        known_keys("compressed-tensors", config, _TOP_KEYS)
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(
                f"compressed-tensors quantization_status {status!r} is not supported (only compressed "
                "checkpoints: their weights are stored quantized)"
            )
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise ValueError(f"compressed-tensors {key} is not supported (got {config[key]})")
        kv_cache = config.get("kv_cache_scheme")
        if kv_cache:
            check_kv_cache_scheme(kv_cache)
        groups = config.get("config_groups") or {}
        if not groups and not kv_cache:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        parsed = tuple(
            (tuple(group.get("targets") or ()), parse_scheme(name, group, config.get("format")))
            for name, group in groups.items()
        )
        return cls(parsed, tuple(config.get("ignore") or ()), bool(kv_cache))

    def scheme_of(self, module_name: str) -> Scheme | None:
        if any(_matches(module_name, pattern) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(_matches(module_name, pattern) for pattern in targets):
                return scheme
        return None

    def linear_method(self, part_names: tuple[str, ...]) -> LinearMethod | None:
        schemes = {self.scheme_of(name) for name in part_names}
        if len(schemes) > 1:
            raise ValueError(
                f"compressed-tensors: the fused modules {', '.join(part_names)} have different schemes "
                "(one fused layer needs one)"
            )
        scheme = schemes.pop()
        return None if scheme is None else scheme.method()
