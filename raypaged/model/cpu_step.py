"""A step's decoder layers in one C call (``attention/cpu_step.c``): on CPU, where the model runs the CPU
backend's fused path on packed weights, fp32 or bf16 (``cpu_gemm.c``) or W8A8 int8 (``cpu_int8.c``). A step is its
decode tokens and its prefill spans (whole prompts, chunks, prefix-cache hits), in any mix.

The C loop calls the kernels the fused path calls one Python call at a time, in the same order, so it gives
the same bits; what it saves is the Python between them (module calls, views, argument checks, ctypes): about
3 ms of SmolLM2's 26 ms decode step at 32 sequences on 2 cores, and the same in every step that carries a
prefill. A model it cannot run (another backend or dtype, otherwise quantized linears, tensor parallelism)
keeps the Python path: :func:`unsupported_reason` says why. With LoRA, a step in which some token has an
adapter runs layer by layer; the others run here. So does a step whose prefill spans are not one varlen batch
(``AttentionMetadata.varlen_prefill``: the memory profile's, which writes no cache).
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
from raypaged.model.mla import MlaAttention
from raypaged.model.moe import SparseMoeBlock
from raypaged.model.parallel import RowParallelLinear
from raypaged.quantization.linear import QuantLinear
from raypaged.quantization.w8a8 import PackedInt8Weight, W8A8Method

if TYPE_CHECKING:
    from raypaged.lora.layers import LoRAStep
    from raypaged.model.llama import LayerKVCache, LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
STEP_SCRATCH_ERROR = "the one-call CPU step could not allocate its scratch memory (int8 or bf16 GEMMs, q/k norms)"


class _Linear(ctypes.Structure):  # cpu_step.c: struct step_linear
    _fields_ = [
        ("weight", _P),
        ("bias", _P),
        ("colsum", _P),
        ("weight_scale", _P),
        ("input_scale", ctypes.c_float),
        ("bf16", ctypes.c_int),
    ]


class _Layer(ctypes.Structure):  # cpu_step.c: struct step_layer
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        *[(name, _Linear) for name in ("qkv", "o", "gate_up", "down")],
        ("k_cache", _P),
        ("v_cache", _P),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("nope", ctypes.c_int),
    ]


class _Shape(ctypes.Structure):  # cpu_step.c: struct step_shape
    _fields_ = [
        *[
            (name, _I64)
            for name in (
                "hidden",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "rotary_dim",
                "intermediate",
                "block_size",
                "num_blocks",
                "max_positions",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("residual_scale", ctypes.c_float),
        ("cache_format", ctypes.c_int),
    ]


class _Prefill(ctypes.Structure):  # cpu_step.c: struct step_prefill
    _fields_ = [
        ("cu_seqlens_q", _P),
        ("context_lens", _P),
        ("block_tables", _P),
        *[(name, _I64) for name in ("table_stride", "table_width", "num_spans", "query_start", "num_tokens")],
    ]


def _layers(model: LlamaModel) -> list[LlamaDecoderLayer]:
    return cast("list[LlamaDecoderLayer]", list(model.layers))


def _attn(layer: LlamaDecoderLayer) -> LlamaAttention:
    """The layer's attention: q/k/v projections in every model the step runs (``unsupported_reason`` refuses
    latent attention)."""
    return cast("LlamaAttention", layer.self_attn)


def _mlp(layer: LlamaDecoderLayer) -> LlamaMLP:
    """The layer's MLP: a plain one in every model the step runs (``unsupported_reason`` refuses experts)."""
    return cast("LlamaMLP", layer.mlp)


def _linears(model: LlamaModel) -> list[tuple[nn.Module, ...]]:
    """Each layer's (qkv, o, gate_up, down) modules as they are now."""
    return [
        (_attn(layer).qkv_proj, _attn(layer).o_proj, _mlp(layer).gate_up_proj, _mlp(layer).down_proj)
        for layer in _layers(model)
    ]


def _holders(model: LlamaModel) -> list[tuple[dict[str, nn.Module | None], str]]:
    """Where each layer's attention and MLP, and their four projections, are held: the ``_modules`` entries
    that replacing any of them (``setattr``, as attach_lora does) writes"""
    holders: list[tuple[dict[str, nn.Module | None], str]] = []
    for layer in _layers(model):
        holders += [(layer._modules, "self_attn"), (layer._modules, "mlp")]
        holders += [(layer.self_attn._modules, name) for name in ("qkv_proj", "o_proj")]
        holders += [(layer.mlp._modules, name) for name in ("gate_up_proj", "down_proj")]
    return holders


def _base(linear: nn.Module) -> nn.Module:
    """The projection itself: a LoRA-wrapped one's base (whose output it is in a step with no adapter)"""
    from raypaged.lora.layers import LoRALinear  # here: raypaged.lora imports the model

    return linear.base if isinstance(linear, LoRALinear) else linear


def _lora_steps(model: LlamaModel) -> list[LoRAStep]:
    """The LoRA step records the model's wrapped linears read (one per attach_lora), each ``.mapping``"""
    from raypaged.lora.layers import LoRALinear

    steps: list[LoRAStep] = []
    for linears in _linears(model):
        for linear in linears:
            if isinstance(linear, LoRALinear) and not any(linear.step is step for step in steps):
                steps.append(linear.step)
    return steps


def _linear_reason(linear: nn.Module, row_parallel: bool, gate_up: bool) -> str | None:
    """Why one projection cannot run in the one call: it must be packed for cpu_gemm.c, fp32 or bf16 (a gate | up
    packed gated), or W8A8 int8 packed for cpu_int8.c's VNNI GEMM, and not sharded; a LoRA-wrapped one is
    judged by its base (the one call runs only steps with no adapter: :meth:`CpuStep.adapters_active`)."""
    linear = _base(linear)
    if type(linear) is QuantLinear:
        method = linear.method
        if not isinstance(method, W8A8Method) or method.dtype != torch.int8:
            kind = f"W8A8 {method.dtype}" if isinstance(method, W8A8Method) else type(method).__name__
            return f"a linear is quantized as {kind}, not W8A8 int8"
        if not isinstance(linear.weight, PackedInt8Weight):
            return "an int8 weight is not packed for cpu_int8.c (no VNNI)"
        if linear.weight.gated != gate_up:
            return "the gate | up weight is not packed gated"
        if method.static and not float(cast(torch.Tensor, linear.input_scale)) > 0:
            return "a static input scale is not positive"
        if linear.tp.size != 1:
            return "the model is sharded (tensor parallelism)"
        return None
    if type(linear) is not (RowParallelLinear if row_parallel else Linear):
        return f"a linear is {type(linear).__name__}, of a kind the one call does not run"
    weight = linear.weight
    if not isinstance(weight, PackedWeight):
        return "a linear's weight is not packed for cpu_gemm.c"
    if weight.gated != gate_up:
        return "the gate | up weight is not packed gated"
    if isinstance(linear, RowParallelLinear) and linear.tp.size != 1:
        return "the model is sharded (tensor parallelism)"
    return None


def _linear_fields(entry: ctypes.Structure, linear: nn.Module) -> None:
    """``entry`` (a ``_Linear``) pointed at ``linear``'s tensors"""
    weight, bias = cast(torch.Tensor, linear.weight), cast("torch.Tensor | None", linear.bias)
    entry.weight, entry.bias = weight.data_ptr(), None if bias is None else bias.data_ptr()
    entry.colsum = entry.weight_scale = None
    entry.input_scale = 0.0
    entry.bf16 = int(isinstance(weight, PackedWeight) and weight.bf16)
    if isinstance(linear, QuantLinear):
        entry.colsum = cast(PackedInt8Weight, weight).colsum.data_ptr()
        entry.weight_scale = cast(torch.Tensor, linear.weight_scale).data_ptr()
        if cast(W8A8Method, linear.method).static:
            entry.input_scale = float(cast(torch.Tensor, linear.input_scale))


def unsupported_reason(model: LlamaModel) -> str | None:
    """Why :class:`CpuStep` cannot run ``model``'s steps, or None when it can."""
    if model.fused_ops is not CPU_FUSED or not model.layers:
        return "the model does not run the CPU backend's fused ops"
    if not cpu_ops.builds():
        return "the CPU kernels do not build"
    layers = _layers(model)
    first = layers[0]
    if any(isinstance(layer.mlp, SparseMoeBlock) for layer in layers):
        return "the model's layers hold experts"
    if any(isinstance(layer.self_attn, MlaAttention) for layer in layers):
        return "the model's attention is DeepSeek's latent attention"
    for layer in layers:
        attn, mlp = _attn(layer), _mlp(layer)
        if attn.attn_backend.decode is not cpu_ops.paged_attention_decode:
            return f"the attention backend is {attn.attn_backend.name}"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, model.norm]
        norms += [norm for norm in (attn.q_norm, attn.k_norm) if norm is not None]
        if (attn.q_norm is None) != (attn.k_norm is None):
            return "the layer normalizes only one of q and k"
        if attn.rotary.interleaved:
            return "the rotary is interleaved (the C rotary rotates halves)"
        if attn.rotary is not first.self_attn.rotary or any(norm.eps != first.input_layernorm.eps for norm in norms):
            return "the layers differ in rotary or norm epsilon"
        if layer.residual_multiplier != first.residual_multiplier or attn.scale != first.self_attn.scale:
            return "the layers differ in residual multiplier or attention scale"
        for linear, row_parallel, gate_up in (
            (attn.qkv_proj, False, False),
            (attn.o_proj, True, False),
            (mlp.gate_up_proj, False, True),
            (mlp.down_proj, True, False),
        ):
            if (reason := _linear_reason(linear, row_parallel, gate_up)) is not None:
                return reason
    return None


class CpuStep:
    """``LlamaModel``'s layers and final norm for a step, built once (:meth:`build`)."""

    def __init__(self, model: LlamaModel) -> None:
        # the model is passed to each call, not kept: the model keeps this, and a cycle between them would hold
        # its weights (and the KV caches, were they kept here) until the cyclic garbage collector ran
        self.linears = _linears(model)
        self.held = [(holder, name, holder[name]) for holder, name in _holders(model)]  # as they are now
        self.lora_steps = _lora_steps(model)
        # prefill spans run through cpu_prefill.c only where the layers would run them through it too
        self.prefills_in_c = all(
            layer.self_attn.attn_backend.varlen_prefill is cpu_ops.paged_prefill_attention for layer in _layers(model)
        )
        layers = _layers(model)
        first = layers[0].self_attn
        self.cos_sin = first.rotary.cos_sin
        self.dims = (
            model.norm.weight.shape[0],
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            _mlp(layers[0]).intermediate_size,
        )
        self.eps, self.scale = layers[0].input_layernorm.eps, first.scale
        self.rotary_dim, self.residual_scale = first.rotary.rotary_dim, layers[0].residual_multiplier
        self.cache_ptrs: list[int] = []  # the caches the layer table points at
        self.layers = (_Layer * len(model.layers))()
        self.shape = _Shape()

    @staticmethod
    def build(model: LlamaModel) -> CpuStep | None:
        return None if unsupported_reason(model) is not None else CpuStep(model)

    def still_applies(self) -> bool:
        """Whether the model's layers still hold the modules it was built on (LoRA wraps the linears later: then
        build again). Read from the holders' dicts: through ``nn.Module.__getattr__`` this took 140 us a step."""
        return all(holder[name] is module for holder, name, module in self.held)

    def adapters_active(self) -> bool:
        """Whether this step's LoRA mapping gives any token an adapter (then the layers run it, one by one)."""
        return any(step.mapping is not None and not step.mapping.is_empty for step in self.lora_steps)

    def _point_at(self, model: LlamaModel, kv_caches: list[LayerKVCache], cache_ptrs: list[int]) -> None:
        key_cache = kv_caches[0][0]
        shape = self.shape
        shape.hidden, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate = self.dims
        shape.block_size, shape.num_blocks = key_cache.shape[2], key_cache.shape[0]
        shape.max_positions, shape.eps, shape.scale = self.cos_sin.shape[0], self.eps, self.scale
        shape.rotary_dim, shape.residual_scale = self.rotary_dim, self.residual_scale
        shape.cache_format = cpu_ops.cache_format(key_cache.dtype)
        for entry, layer, (qkv, o, gate_up, down), (k, v) in zip(
            self.layers, _layers(model), self.linears, kv_caches, strict=True
        ):
            for name, cache in (("k_cache", k), ("v_cache", v)):
                if not cache.is_contiguous() or cache.shape != key_cache.shape or cache.dtype != key_cache.dtype:
                    raise ValueError(f"every layer's {name} must be contiguous and shaped {tuple(key_cache.shape)}")
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            q_norm, k_norm = layer.self_attn.q_norm, layer.self_attn.k_norm
            entry.q_norm = None if q_norm is None else q_norm.weight.data_ptr()
            entry.k_norm = None if k_norm is None else k_norm.weight.data_ptr()
            for name, linear in (("qkv", qkv), ("o", o), ("gate_up", gate_up), ("down", down)):
                _linear_fields(getattr(entry, name), _base(linear))
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
            entry.k_scale, entry.v_scale = layer.self_attn.kv_scales.k, layer.self_attn.kv_scales.v
            entry.nope = int(not layer.self_attn.rotates)
        self.cache_ptrs = cache_ptrs

    def runs(self, meta: AttentionMetadata, block_size: int) -> bool:
        """Whether the step's attention is one the C loop runs: decodes, and prefill spans that make one varlen
        batch right after them (the layers' own condition for the varlen kernel) where the backend's varlen
        kernel is cpu_prefill.c's, and no span attends to images both ways."""
        if not meta.prefills:
            return True
        if not self.prefills_in_c or any(span.image_blocks for span in meta.prefills):
            return False
        varlen = meta.varlen_prefill(block_size)
        return varlen is not None and varlen.query_start == meta.num_decode_tokens

    def run(
        self,
        model: LlamaModel,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # x: the embeddings [num_tokens, hidden] -> the final norm's output, in x
        cache_ptrs = [cache.data_ptr() for layer in kv_caches for cache in layer]
        if cache_ptrs != self.cache_ptrs:
            self._point_at(model, kv_caches, cache_ptrs)
        hidden, heads, kv_heads, head_dim, intermediate = self.dims
        tokens, decodes = x.shape[0], meta.num_decode_tokens
        tables, lens, slots = meta.decode_block_tables, meta.decode_context_lens.contiguous(), meta.slot_mapping
        if tables.stride(1) != 1:
            tables = tables.contiguous()
        for name, index, rows in (("positions", positions, tokens), ("slot_mapping", slots, tokens)):
            if index.dtype != torch.long or index.shape != (rows,) or not index.is_contiguous():
                raise ValueError(f"{name} must be {rows} contiguous longs, got {index.dtype} {tuple(index.shape)}")
        if lens.dtype != torch.long or lens.shape != (decodes,):
            raise ValueError(f"context lengths must be {decodes} longs, got {lens.dtype} {tuple(lens.shape)}")
        if tables.dtype != torch.long or tables.shape[0] != decodes or x.shape[1] != hidden or not x.is_contiguous():
            raise ValueError(
                f"a step of {tokens} tokens ({decodes} decodes) takes contiguous [{tokens}, {hidden}] embeddings and "
                f"long block tables of {decodes} rows, got {tuple(x.shape)} and {tables.dtype} {tuple(tables.shape)}"
            )
        block_size, num_blocks = self.shape.block_size, self.shape.num_blocks
        prefill, varlen = None, meta.varlen_prefill(block_size) if meta.prefills else None
        spans: tuple[torch.Tensor, ...] = ()
        if meta.prefills:
            if varlen is None or varlen.query_start != decodes or decodes + varlen.num_tokens != tokens:
                raise ValueError(
                    f"the prefill spans of a step of {tokens} tokens ({decodes} decodes) are not one varlen batch "
                    "right after its decodes"
                )
            spans = (
                varlen.cu_seqlens_q.contiguous(),
                varlen.context_lens.contiguous(),
                varlen.block_tables.contiguous(),
            )
            prefill = _Prefill(
                *(index.data_ptr() for index in spans),
                spans[2].stride(0),
                spans[2].shape[1],
                spans[0].shape[0] - 1,
                varlen.query_start,
                varlen.num_tokens,
            )
        residual = torch.empty(tokens, hidden)
        qkv = torch.empty(tokens, (heads + 2 * kv_heads) * head_dim)
        attn = torch.empty(tokens, heads * head_dim)
        h = torch.empty(tokens, intermediate)
        status = cpu_ops.library().raypaged_step_layers(
            ctypes.addressof(self.layers),
            len(self.layers),
            ctypes.addressof(self.shape),
            model.norm.weight.data_ptr(),
            x.data_ptr(),
            residual.data_ptr(),
            tokens,
            positions.data_ptr(),
            slots.data_ptr(),
            self.cos_sin.data_ptr(),
            decodes,
            tables.data_ptr(),
            tables.stride(0),
            tables.shape[1],
            lens.data_ptr(),
            None if prefill is None else ctypes.addressof(prefill),
            qkv.data_ptr(),
            attn.data_ptr(),
            h.data_ptr(),
            torch.get_num_threads(),
        )
        if status == -20:
            raise MemoryError(STEP_SCRATCH_ERROR)
        if status <= -30 and varlen is not None:
            cu_seqlens_q, context_lens, varlen_tables = spans
            cpu_ops.raise_for_prefill_status(
                status + 30, varlen.num_tokens, cu_seqlens_q, context_lens, varlen_tables, block_size, num_blocks
            )
        if status <= -10:
            cpu_fused.raise_for_rotary_status(status + 10, self.cos_sin.shape[0], num_blocks, block_size)
        cpu_ops.raise_for_status("decode", status, lens, tables, block_size, num_blocks)
        return x
