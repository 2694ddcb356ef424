"""The reference quantizer: a float checkpoint folder -> a quantized one, in each format's on-disk layout.

Round-to-nearest with min/max scales (no calibration data): the layouts, configs and numerics a
checkpoint of that format has, so tests and benchmarks have real checkpoints to load.

    python -m raypaged.quantization.quantizer SRC DST --scheme w8a8-int8
    python -m raypaged.quantization.quantizer SRC DST --scheme gptq --group-size 64 --act-order --asymmetric
    python -m raypaged.quantization.quantizer SRC DST --scheme fp8-block --weight-block-size 128 128
    python -m raypaged.quantization.quantizer SRC DST --scheme w8a8-fp8 --kv-cache-scales
    python -m raypaged.quantization.quantizer SRC DST --scheme kv-fp8

``--kv-cache-scales`` (and the kv-fp8 scheme, which quantizes no weights) adds each layer's static fp8 KV cache
scales, calibrated on a short text (``kv_scales.py``): the only part that reads data.

Act-order (GPTQ ``desc_act``) orders input features by decreasing squared column norm of the
weights that share the input (q/k/v, gate/up), a data-free stand-in for GPTQ's Hessian diagonal.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from raypaged.model.loader import iter_checkpoint
from raypaged.quantization.packing import AWQ_ORDER, pack
from raypaged.quantization.w8a8 import FP8, FP8_MAX, expand_columns

SCHEMES = ("fp8", "fp8-block", "w8a8-int8", "w8a8-fp8", "w8a8-fp8-block", "w4a16", "gptq", "awq", "kv-fp8")
# the schemes whose checkpoints may carry fp8 KV cache scales (vLLM reads them from fp8 and compressed-tensors ones);
# kv-fp8: those scales alone, the weights as they are (a compressed-tensors config with only a kv_cache_scheme)
KV_SCALE_SCHEMES = ("fp8", "fp8-block", "w8a8-int8", "w8a8-fp8", "w8a8-fp8-block", "w4a16", "kv-fp8")
BLOCK_SCHEMES = ("fp8-block", "w8a8-fp8-block")
# the linears quantized: Llama-family parts, and Phi-3's fused qkv_proj and gate_up_proj (quantized whole)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj")
_MIXTRAL_EXPERT = ("w1", "w2", "w3")  # gate, down, up
# -> the part naming the group
_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}


def rtn(
    w: torch.Tensor, bits: int, symmetric: bool, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest over the last dim of ``w``: (unsigned q, scale, zero) with ``w ~ (q - zero) * scale``,
    ``q`` in [0, 2**bits); symmetric: zero = 2**(bits-1), scale = amax / (2**(bits-1) - 0.5)."""
    maxq = (1 << bits) - 1
    if symmetric:
        scale = w.abs().amax(-1, keepdim=True) / (maxq / 2)
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        low, high = w.amin(-1, keepdim=True).clamp(max=0), w.amax(-1, keepdim=True).clamp(min=0)
        scale = (high - low) / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.round(-low / scale).clamp(min_zero, maxq)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
    return q.to(torch.int32), scale, zero.to(torch.int32)


def quantize_8bit(w: torch.Tensor, dtype: torch.dtype, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) of int8 or fp8 e4m3 with one scale per output channel ([N, 1]) or per tensor ([])."""
    amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    top = 127.0 if dtype == torch.int8 else FP8_MAX
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / top)
    scaled = w / scale
    q = torch.round(scaled).clamp(-128, 127) if dtype == torch.int8 else scaled.clamp(-FP8_MAX, FP8_MAX)
    return q.to(dtype), scale


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 weight [N, K], float32 scale [ceil(N / block_n), ceil(K / block_k)]): one scale per tile,
    amax / 448 (1 for an all-zero tile); edge tiles cover what is left."""
    (n, k), (bn, bk) = w.shape, block
    rows, cols = -(-n // bn), -(-k // bk)
    tiles = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n)).view(rows, bn, cols, bk)
    amax = tiles.abs().amax((1, 3))
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    per_weight = expand_columns(scale.repeat_interleave(bn, 0)[:n], bk, k)
    return (w / per_weight).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_packed(w: torch.Tensor, group_size: int, symmetric: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized 4-bit: weight_packed, weight_scale (, weight_zero_point), weight_shape."""
    n, k = w.shape
    q, scale, zero = rtn(w.reshape(n, k // group_size, group_size), 4, symmetric)
    out = {
        "weight_packed": pack(q.reshape(n, k), 4, 1),
        "weight_scale": scale[..., 0].to(w.dtype),
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        out["weight_zero_point"] = pack(zero[..., 0], 4, 0)
    return out


def quantize_gptq(
    w: torch.Tensor, group_size: int, symmetric: bool, order: torch.Tensor | None, bits: int = 4
) -> dict[str, torch.Tensor]:
    """GPTQ v1, 4 or 8 bits: qweight [K/pack, N], qzeros [G, N/pack] (zero - 1), scales [G, N] fp16,
    g_idx [K] (pack = 32 / bits). ``order``: the act-order permutation of input features (groups run
    along it), None for k // group."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = torch.arange(k, dtype=torch.int32) // group_size
    grouped = w[:, order].reshape(n, k // group_size, group_size)
    _, scale, zero = rtn(grouped, bits, symmetric, min_zero=1)  # v1 stores zero - 1: zero 0 cannot be written
    scale, zero = scale[..., 0].t(), zero[..., 0].t()  # [G, N]
    scales16 = scale.to(torch.float16)
    per_input = scales16.float()[g_idx.long()]  # [K, N]: quantize with the scales as stored
    maxq = (1 << bits) - 1
    q = torch.clamp(torch.round(w.t() / per_input) + zero[g_idx.long()], 0, maxq).to(torch.int32)
    return {"qweight": pack(q, bits, 0), "qzeros": pack(zero - 1, bits, 1), "scales": scales16, "g_idx": g_idx}


def quantize_awq(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM, 4-bit with zeros: qweight [K, N/8], qzeros [G, N/8] (AWQ order), scales [G, N] fp16."""
    n, k = w.shape
    _, scale, zero = rtn(w.reshape(n, k // group_size, group_size), 4, symmetric=False)
    scales16 = scale[..., 0].t().to(torch.float16)  # [G, N]
    zero = zero[..., 0].t()
    per_input = scales16.float().repeat_interleave(group_size, 0)
    q = torch.clamp(torch.round(w.t() / per_input) + zero.repeat_interleave(group_size, 0), 0, 15).to(torch.int32)
    return {"qweight": pack(q, 4, 1, AWQ_ORDER), "qzeros": pack(zero, 4, 1, AWQ_ORDER), "scales": scales16}


def quantization_config(
    scheme: str,
    group_size: int,
    symmetric: bool,
    act_order: bool,
    bits: int = 4,
    block: tuple[int, int] = (128, 128),
) -> dict[str, Any]:
    """The config.json ``quantization_config`` of a checkpoint the quantizer writes (without KV cache scales)."""
    if scheme == "kv-fp8":
        return {
            "quant_method": "compressed-tensors",
            "format": "dense",
            "quantization_status": "compressed",
            "config_groups": {},
            "ignore": [],
            "kv_cache_scheme": None,
        }
    if scheme == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    if scheme == "gptq":
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group_size,
            "desc_act": act_order,
            "sym": symmetric,
            "checkpoint_format": "gptq",
        }
    if scheme == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if scheme == "w4a16":
        fmt = "pack-quantized"
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "group",
            "group_size": group_size,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        inputs = None
    else:  # the W8A8 formats: int8 or fp8 weights per channel (fp8 also in blocks), activations per token (group)
        kind = "int" if scheme == "w8a8-int8" else "float"
        blocks = scheme == "w8a8-fp8-block"
        fmt = f"{kind}-quantized"
        weights = {
            "num_bits": 8,
            "type": kind,
            "symmetric": True,
            "strategy": "block" if blocks else "channel",
            **({"block_structure": list(block)} if blocks else {}),
            "group_size": None,
            "dynamic": False,
            "actorder": None,
            "observer": "minmax",
        }
        inputs = {
            "num_bits": 8,
            "type": kind,
            "symmetric": True,
            "strategy": "group" if blocks else "token",
            **({"group_size": block[1]} if blocks else {}),
            "dynamic": True,
            "observer": None,
        }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": fmt,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def act_orders(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per projection weight name: the act-order permutation shared by the projections of one input."""
    importance: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        module, proj = _projection(name)
        if proj is not None:
            key = f"{module}.{_SHARED_INPUT.get(proj, proj)}"
            importance[key] = importance.get(key, 0) + w.float().pow(2).sum(0)
    orders = {}
    for name in tensors:
        module, proj = _projection(name)
        if proj is not None:
            orders[name] = torch.argsort(
                importance[f"{module}.{_SHARED_INPUT.get(proj, proj)}"], descending=True, stable=True
            )
    return orders


def _projection(name: str) -> tuple[str, str | None]:
    """(module prefix, projection) of a projection's ``weight`` (Mixtral's experts' ``w1``, ``w2`` and ``w3`` too);
    (name, None) for any other tensor."""
    module, _, proj = name[: -len(".weight")].rpartition(".")
    projection = proj in PROJECTIONS or (proj in _MIXTRAL_EXPERT and ".block_sparse_moe.experts." in module)
    return (module, proj) if name.endswith(".weight") and projection else (name, None)


def quantize_tensors(
    tensors: dict[str, torch.Tensor],
    scheme: str,
    group_size: int = 128,
    symmetric: bool = True,
    act_order: bool = False,
    bits: int = 4,
    block: tuple[int, int] = (128, 128),
) -> dict[str, torch.Tensor]:
    """Every projection weight replaced by its quantized tensors; other tensors as they are."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    orders = act_orders(tensors) if act_order else {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module, proj = _projection(name)
        if proj is None or scheme == "kv-fp8":
            out[name] = tensor
            continue
        w = tensor.to(torch.float32)
        g = w.shape[1] if group_size == -1 else group_size
        if scheme == "fp8":
            parts = dict(zip(("weight", "weight_scale"), quantize_8bit(w, FP8, per_tensor=True)))
        elif scheme in BLOCK_SCHEMES:
            weight, scale = quantize_fp8_blocks(w, block)
            # fp8 checkpoints (DeepSeek-V3, Qwen3) store the scale as weight_scale_inv in float32,
            # compressed-tensors as weight_scale in the model's dtype
            parts = (
                {"weight": weight, "weight_scale_inv": scale}
                if scheme == "fp8-block"
                else {"weight": weight, "weight_scale": scale.to(tensor.dtype)}
            )
        elif scheme in ("w8a8-int8", "w8a8-fp8"):
            weight, scale = quantize_8bit(w, torch.int8 if scheme == "w8a8-int8" else FP8, per_tensor=False)
            parts = {"weight": weight, "weight_scale": scale.to(tensor.dtype)}
        elif scheme == "w4a16":
            parts = quantize_packed(w, g, symmetric)
            parts["weight_scale"] = parts["weight_scale"].to(tensor.dtype)
        elif scheme == "gptq":
            parts = quantize_gptq(w, g, symmetric, orders.get(name), bits)
        else:
            parts = quantize_awq(w, g)
        out.update({f"{module}.{proj}.{key}": value.contiguous() for key, value in parts.items()})
    return out


def quantize_checkpoint(
    src: Path,
    dst: Path,
    scheme: str,
    group_size: int = 128,
    symmetric: bool = True,
    act_order: bool = False,
    smoothquant: float | None = None,
    bits: int = 4,
    block: tuple[int, int] = (128, 128),
    kv_cache_scales: bool = False,
) -> Path:
    """Write ``dst``: ``src``'s files with the projections quantized and a ``quantization_config``;
    ``smoothquant``: first smooth the activations with this alpha (see ``smoothquant.py``); ``kv_cache_scales``
    (always with kv-fp8): each layer's fp8 KV cache scales too (see ``kv_scales.py``)."""
    kv_cache_scales = kv_cache_scales or scheme == "kv-fp8"
    if kv_cache_scales and scheme not in KV_SCALE_SCHEMES:
        raise ValueError(
            f"KV cache scales go with fp8 and compressed-tensors checkpoints ({', '.join(KV_SCALE_SCHEMES)}), "
            f"not {scheme}"
        )
    if act_order and scheme != "gptq":
        raise ValueError("act_order is a gptq option")
    if bits not in (4, 8) or (bits != 4 and scheme != "gptq"):
        raise ValueError(f"bits {bits}: the quantizer writes 4-bit w4a16/awq and 4- or 8-bit gptq")
    if min(block) < 1:
        raise ValueError(f"the weight block size must be positive, got {list(block)}")
    if not symmetric and scheme not in ("w4a16", "gptq"):
        raise ValueError(f"asymmetric is a w4a16 and gptq option ({scheme} is written as its format has it)")
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    tensors = dict(iter_checkpoint(src))
    config = json.loads((src / "config.json").read_text())
    if smoothquant is not None:
        from raypaged.quantization.smoothquant import input_maxima, smooth

        tensors = smooth(tensors, input_maxima(src), config["num_hidden_layers"], smoothquant)
    quantized = quantize_tensors(tensors, scheme, group_size, symmetric, act_order, bits, block)
    quant_config = quantization_config(scheme, group_size, symmetric, act_order, bits, block)
    if kv_cache_scales:
        from raypaged.quantization.compressed_tensors import KV_CACHE_SCHEME
        from raypaged.quantization.kv_scales import kv_maxima, kv_scale_tensors

        quantized.update(kv_scale_tensors(kv_maxima(src)))
        if quant_config["quant_method"] == "compressed-tensors":
            quant_config["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path, help="a float model folder (safetensors)")
    parser.add_argument("dst", type=Path, help="the quantized model folder to write")
    parser.add_argument("--scheme", required=True, choices=SCHEMES)
    parser.add_argument("--group-size", type=int, default=128, help="4-bit schemes: inputs per scale (-1: all)")
    parser.add_argument("--asymmetric", action="store_true", help="w4a16 and gptq: zero points (awq always has them)")
    parser.add_argument("--act-order", action="store_true", help="gptq: desc_act, groups along a permutation")
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8], help="gptq: 4 or 8 bits (others: 4)")
    parser.add_argument(
        "--weight-block-size",
        type=int,
        nargs=2,
        default=[128, 128],
        metavar=("N", "K"),
        help="fp8-block, w8a8-fp8-block: output rows and input columns per weight scale",
    )
    parser.add_argument(
        "--smoothquant",
        type=float,
        default=None,
        metavar="ALPHA",
        help="smooth activation outliers into the weights first (W8A8: 0.5 is usual)",
    )
    parser.add_argument(
        "--kv-cache-scales",
        action="store_true",
        help="add each layer's static fp8 KV cache scales, calibrated on a short text (kv-fp8: always)",
    )
    args = parser.parse_args(argv)
    quantize_checkpoint(
        args.src,
        args.dst,
        args.scheme,
        args.group_size,
        not args.asymmetric,
        args.act_order,
        args.smoothquant,
        args.bits,
        tuple(args.weight_block_size),
        args.kv_cache_scales,
    )
    print(f"wrote {args.dst}")


if __name__ == "__main__":
    main()
