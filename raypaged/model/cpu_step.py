"""A decode-only step's decoder layers in one C call (``attention/cpu_step.c``): fp32 on CPU, where the model
runs the CPU backend's fused path on packed weights.

The C loop calls the kernels the fused path calls one Python call at a time, in the same order, so it gives
the same bits; what it saves is the Python between them (module calls, views, argument checks, ctypes): about
3 ms of SmolLM2's 26 ms decode step at 32 sequences on 2 cores, and 2.5 of 13 at one sequence. A model it
cannot run (another backend or dtype, quantized or LoRA-wrapped linears, tensor parallelism, Qwen3's q/k
norms) keeps the Python path: :func:`unsupported_reason` says why.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from raypaged.attention import cpu_fused, cpu_ops
from raypaged.attention.backend import CPU_FUSED
from raypaged.attention.metadata import AttentionMetadata
from raypaged.model.layers import Linear, PackedWeight
from raypaged.model.parallel import RowParallelLinear

if TYPE_CHECKING:
    from raypaged.model.llama import LayerKVCache, LlamaDecoderLayer, LlamaModel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Layer(ctypes.Structure):  # cpu_step.c: struct decode_layer
    _fields_ = [
        (name, _P)
        for name in (
            "input_norm",
            "post_norm",
            "qkv",
            "qkv_bias",
            "o",
            "o_bias",
            "gate_up",
            "gate_up_bias",
            "down",
            "down_bias",
            "k_cache",
            "v_cache",
        )
    ]


class _Shape(ctypes.Structure):  # cpu_step.c: struct decode_shape
    _fields_ = [
        *[
            (name, _I64)
            for name in (
                "hidden",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "intermediate",
                "block_size",
                "num_blocks",
                "max_positions",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("fp8", ctypes.c_int),
    ]


def _layers(model: LlamaModel) -> list[LlamaDecoderLayer]:
    return cast("list[LlamaDecoderLayer]", list(model.layers))


def _linears(model: LlamaModel) -> list[tuple[nn.Module, ...]]:
    """Each layer's (qkv, o, gate_up, down) modules as they are now."""
    return [
        (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for layer in _layers(model)
    ]


def unsupported_reason(model: LlamaModel) -> str | None:
    """Why :class:`CpuDecodeStep` cannot run ``model``'s decode steps, or None when it can."""
    if model.fused_ops is not CPU_FUSED or not model.layers:
        return "the model does not run the CPU backend's fused ops"
    if not cpu_ops.builds():
        return "the CPU kernels do not build"
    layers = _layers(model)
    first = layers[0]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.attn_backend.decode is not cpu_ops.paged_attention_decode:
            return f"the attention backend is {attn.attn_backend.name}"
        if attn.q_norm is not None:
            return "the model normalizes q and k per head"
        norms = (layer.input_layernorm, layer.post_attention_layernorm, model.norm)
        if attn.rotary is not first.self_attn.rotary or any(norm.eps != first.input_layernorm.eps for norm in norms):
            return "the layers differ in rotary or norm epsilon"
        linears = (attn.qkv_proj, mlp.gate_up_proj, attn.o_proj, mlp.down_proj)
        if tuple(map(type, linears)) != (Linear, Linear, RowParallelLinear, RowParallelLinear):
            return "a linear is quantized or LoRA-wrapped"
        weights = [linear.weight for linear in linears]
        if not all(isinstance(weight, PackedWeight) for weight in weights):
            return "a linear's weight is not packed for cpu_gemm.c"
        if [cast(PackedWeight, weight).gated for weight in weights] != [False, True, False, False]:
            return "the gate | up weight is not packed gated"
        if cast(RowParallelLinear, attn.o_proj).tp.size != 1:
            return "the model is sharded (tensor parallelism)"
    return None


class CpuDecodeStep:
    """``LlamaModel``'s layers and final norm for a decode-only step, built once (:meth:`build`)."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.linears = _linears(model)
        layers = _layers(model)
        first = layers[0].self_attn
        self.cos_sin = first.rotary.cos_sin
        self.dims = (
            model.norm.weight.shape[0],
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            layers[0].mlp.intermediate_size,
        )
        self.eps, self.scale = layers[0].input_layernorm.eps, first.scale
        self.caches: list[LayerKVCache] | None = None
        self.layers = (_Layer * len(model.layers))()
        self.shape = _Shape()

    @staticmethod
    def build(model: LlamaModel) -> CpuDecodeStep | None:
        return None if unsupported_reason(model) is not None else CpuDecodeStep(model)

    def still_applies(self) -> bool:
        """Whether the model's linears are still those it was built on (LoRA wraps them later)."""
        return self.linears == _linears(self.model)

    def _point_at(self, kv_caches: list[LayerKVCache]) -> None:
        key_cache = kv_caches[0][0]
        shape = self.shape
        shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate = self.dims
        shape.block_size, shape.num_blocks = key_cache.shape[2], key_cache.shape[0]
        shape.max_positions, shape.eps, shape.scale = self.cos_sin.shape[0], self.eps, self.scale
        shape.fp8 = int(key_cache.dtype != torch.float32)
        for entry, layer, (qkv, o, gate_up, down), (k, v) in zip(
            self.layers, _layers(self.model), self.linears, kv_caches, strict=True
        ):
            for name, cache in (("k_cache", k), ("v_cache", v)):
                if not cache.is_contiguous() or cache.shape != key_cache.shape or cache.dtype != key_cache.dtype:
                    raise ValueError(f"every layer's {name} must be contiguous and shaped {tuple(key_cache.shape)}")
            tensors = {
                "input_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                **{
                    f"{name}{part}": getattr(module, attr)
                    for name, module in (("qkv", qkv), ("o", o), ("gate_up", gate_up), ("down", down))
                    for part, attr in (("", "weight"), ("_bias", "bias"))
                },
                "k_cache": k,
                "v_cache": v,
            }
            for name, tensor in tensors.items():
                setattr(entry, name, None if tensor is None else tensor.data_ptr())
        self.caches = kv_caches

    def run(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache], meta: AttentionMetadata
    ) -> torch.Tensor:  # x: the embeddings [num_seqs, hidden] -> the final norm's output, in x
        if kv_caches is not self.caches:
            self._point_at(kv_caches)
        hidden, heads, kv_heads, head_dim, intermediate = self.dims
        tokens = x.shape[0]
        tables, lens, slots = meta.decode_block_tables, meta.decode_context_lens.contiguous(), meta.slot_mapping
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        for name, index in (("positions", positions), ("slot_mapping", slots), ("context lengths", lens)):
            if index.dtype != torch.long or index.shape != (tokens,) or not index.is_contiguous():
                raise ValueError(f"{name} must be {tokens} contiguous longs, got {index.dtype} {tuple(index.shape)}")
        if tables.dtype != torch.long or tables.shape[0] != tokens or x.shape[1] != hidden or not x.is_contiguous():
            raise ValueError(
                f"a decode step of {tokens} sequences takes contiguous [{tokens}, {hidden}] embeddings and long block "
                f"tables of {tokens} rows, got {tuple(x.shape)} and {tables.dtype} {tuple(tables.shape)}"
            )
        residual = torch.empty(tokens, hidden)
        qkv = torch.empty(tokens, (heads + 2 * kv_heads) * head_dim)
        attn = torch.empty(tokens, heads * head_dim)
        h = torch.empty(tokens, intermediate)
        status = cpu_ops.library().raypaged_decode_layers(
            ctypes.addressof(self.layers),
            len(self.layers),
            ctypes.addressof(self.shape),
            self.model.norm.weight.data_ptr(),
            x.data_ptr(),
            residual.data_ptr(),
            tokens,
            positions.data_ptr(),
            slots.data_ptr(),
            self.cos_sin.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            tables.shape[1],
            lens.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            h.data_ptr(),
            torch.get_num_threads(),
        )
        block_size, num_blocks = self.shape.block_size, self.shape.num_blocks
        if status <= -10:
            cpu_fused.raise_for_rotary_status(status + 10, self.cos_sin.shape[0], num_blocks, block_size)
        cpu_ops.raise_for_status("decode", status, lens, tables, block_size, num_blocks)
        return x
