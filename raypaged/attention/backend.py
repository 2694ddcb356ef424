"""Which paged-attention implementation a model runs: plain torch, the CPU decode kernel, or the CUDA kernels.

All implement the same three operations on the same cache layout
(``[num_blocks, num_kv_heads, block_size, head_dim]`` per layer), and one driver,
:meth:`AttentionBackend.forward`, runs a flattened step through either: the step's
K/V are written to their slots (:meth:`AttentionBackend.attend` is the same without the
write, when the caller has written the K/V itself), then the single-token decodes attend
in one batched call. The prefill spans: with a ``varlen_prefill`` operation (CUDA, and the
``cpu`` backend's C kernel), all of them in one call that reads each span's context through its
block table, its own K/V of this step included (written just before); without one (torch, the
reference), each span on its own, a span with nothing cached before it (a whole prompt) over its
fresh K/V, with no gather from the cache. The ``cpu`` backend is torch's but for attention, which
reads the cache through the block tables in C (``cpu_ops``: decode and varlen prefill) instead of
gathering it, and it brings the C versions of the model step's fused elementwise ops (``FusedOps``;
the CUDA ones with ``$RAYPAGED_FUSED_KERNELS``). A step whose spans do not form one packed batch with
covering block tables (see ``build_varlen_prefill``) takes the per-span path.

KV cache dtype: the CUDA kernels read a cache of the model's dtype, and with ``$RAYPAGED_FP8_KV_KERNELS`` an fp8
e4m3 one (``--kv-cache-dtype fp8``, narrowed and widened in the kernels); the CPU kernels float32, fp8 e4m3 and bf16
ones; torch any (``cuda_cache_unsupported_reason``, ``cpu_unsupported_reason``).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from raypaged import envs
from raypaged.attention import cpu_fused, cpu_ops, torch_ops
from raypaged.attention.metadata import AttentionMetadata
from raypaged.kernels.checks import BLOCK_SIZES as CUDA_BLOCK_SIZES
from raypaged.kernels.checks import HEAD_SIZES as CUDA_HEAD_SIZES

logger = logging.getLogger("raypaged")

BACKENDS = ("auto", "torch", "cpu", "cuda")


@dataclass(frozen=True, slots=True)
class FusedOps:
    """The fused path's elementwise step ops on one device, with the contracts of
    ``raypaged.kernels.fused_ops`` (CUDA) and ``raypaged.attention.cpu_fused`` (CPU): the input and
    post-attention norms with their residual adds, SiLU-and-multiply, rotary with the K/V cache write."""

    rms_norm: Callable[..., torch.Tensor]  # (x, weight, eps) -> normed copy
    fused_add_rms_norm: Callable[..., None]  # (x, residual, weight, eps): residual += x; x = norm(residual)
    silu_and_mul: Callable[..., torch.Tensor]  # (x [tokens, 2d]) -> [tokens, d]
    rotary_and_cache: Callable[..., None]  # (positions, q, k, v, cos_sin, key_cache, value_cache, slot_mapping)


CPU_FUSED = FusedOps(
    cpu_fused.rms_norm, cpu_fused.fused_add_rms_norm, cpu_fused.silu_and_mul, cpu_fused.rotary_and_cache
)


@dataclass(slots=True)
class KVScales:
    """One layer's fp8 KV cache scales (per tensor, as vLLM's ``k_scale``/``v_scale``): the cache holds
    ``key / k`` and ``value / v``, narrowed. From the checkpoint, from ``--calculate-kv-scales`` (the first
    step's ``max |key| / 200`` and ``max |value| / 100``), or 1.0. A cache of the model's dtype keeps 1.0."""

    k: float = 1.0
    v: float = 1.0

    @property
    def unit(self) -> bool:
        return self.k == 1.0 and self.v == 1.0

    def set(self, k: float, v: float) -> None:
        """Each scale rounded to float32, as the kernels and torch's float32 arithmetic take it."""
        self.k, self.v = _float32(k), _float32(v)


def _float32(x: float) -> float:
    if not (x > 0.0 and x != float("inf")):
        raise ValueError(f"a KV cache scale must be positive and finite, got {x}")
    return float(torch.tensor(x, dtype=torch.float32))


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    reshape_and_cache: Callable[..., None]
    decode: Callable[..., torch.Tensor]  # paged_attention_decode(query, key_cache, value_cache, tables, lens, scale)
    paged_prefill: Callable[..., torch.Tensor]  # (query, key_cache, value_cache, block_ids, context_len, scale)
    # (query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, scale, max_query_len, out=):
    # every prefill span of a step in one call; None: the per-span loop
    varlen_prefill: Callable[..., torch.Tensor] | None = None
    fused_ops: FusedOps | None = None  # the model step's fused elementwise ops on this device; None: plain torch
    windows: bool = False  # whether decode and the prefills take sliding_window and softcap (torch_ops' do)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], this step's
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self.write_cache(key, value, key_cache, value_cache, meta.slot_mapping, kv_scales)
        return self.attend(query, key, value, key_cache, value_cache, meta, scale, kv_scales)

    def write_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None:
        """``reshape_and_cache`` of ``key / k_scale`` and ``value / v_scale`` (``kv_scales``: an fp8 cache's)."""
        if kv_scales is not None and not kv_scales.unit:
            key, value = key / kv_scales.k, value / kv_scales.v
        self.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
        causal: bool = True,
    ) -> torch.Tensor:
        """:meth:`forward` once this step's K/V are already in their slots (the CUDA model path
        writes them with the rotary kernel, ``raypaged.kernels.rotary_and_cache``).

        ``kv_scales`` (an fp8 cache's) fold into what reads the cache: q . (k_scale K) = (q . K) k_scale, so the
        kernels take ``scale * k_scale``, and softmax(.) (v_scale V) = v_scale softmax(.) V, so their output is
        multiplied by ``v_scale``; the kernels read the stored values as they are. A whole prompt's span attends
        over this step's own K/V, unscaled.

        ``sliding_window`` (a query sees at most that many of the newest keys), ``softcap`` (Gemma 2's tanh cap
        of the scores), ``sinks`` (gpt-oss's per-head sink logits) and ``chunk`` (Llama 4's chunked attention: a
        query sees the keys of its own chunk of that many positions) are options of the torch attention ops only
        (``windows``). ``causal`` False: bidirectional attention over whole prompts (EmbeddingGemma's), in the torch
        ops (a one-token prompt is a decode row: its one key is itself either way)."""
        options: dict[str, Any] = {}
        if sliding_window is not None or softcap is not None or sinks is not None or chunk is not None:
            if not self.windows:
                raise ValueError(
                    f"the {self.name} attention backend has no sliding-window, soft-capped, sink or chunked attention"
                )
            options = {"sliding_window": sliding_window, "softcap": softcap}
            if sinks is not None:
                options["sinks"] = sinks
            if chunk is not None:
                options["chunk"] = chunk
        k_scale, v_scale = (1.0, 1.0) if kv_scales is None else (kv_scales.k, kv_scales.v)
        # multiplied in float32, as cpu_step.c multiplies them
        cached_scale = scale if k_scale == 1.0 else float(numpy.float32(scale) * numpy.float32(k_scale))
        num_decodes = meta.num_decode_tokens
        if num_decodes == query.shape[0] and not meta.prefills:
            out = self.decode(
                query,
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                cached_scale,
                **options,
            )
            return _times(out, v_scale)
        out = torch.empty_like(query)
        if num_decodes:
            out[:num_decodes] = self.decode(
                query[:num_decodes],
                key_cache,
                value_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                cached_scale,
                **options,
            )
        image_blocks = any(span.image_blocks for span in meta.prefills)
        if image_blocks and not self.windows:
            raise ValueError(f"the {self.name} attention backend has no bidirectional attention over images")
        if (
            self.varlen_prefill is not None
            and not options
            and causal
            and not image_blocks
            and (varlen := meta.varlen_prefill(key_cache.shape[2])) is not None
        ):
            rows = slice(varlen.query_start, varlen.query_start + varlen.num_tokens)
            self.varlen_prefill(
                query[rows],
                key_cache,
                value_cache,
                varlen.cu_seqlens_q,
                varlen.context_lens,
                varlen.block_tables,
                cached_scale,
                varlen.max_query_len,
                out=out[rows],
            )
            return _times(out, v_scale)
        if num_decodes:
            _times(out[:num_decodes], v_scale)
        for span in meta.prefills:
            end = span.query_start + span.query_len
            q = query[span.query_start : end]
            span_options = {**options, "image_blocks": span.image_blocks} if span.image_blocks else options
            if span.context_len == span.query_len:  # nothing cached before it: its own K/V are the context
                out[span.query_start : end] = torch_ops.prefill_attention(
                    q, key[span.query_start : end], value[span.query_start : end], scale, causal=causal, **span_options
                )
            elif not causal:
                raise ValueError("bidirectional attention takes whole prompts: a prompt was cut into chunks")
            else:
                span_out = self.paged_prefill(
                    q, key_cache, value_cache, span.block_ids, span.context_len, cached_scale, **span_options
                )
                out[span.query_start : end] = _times(span_out, v_scale)
        return out


def _times(out: torch.Tensor, v_scale: float) -> torch.Tensor:
    """``out`` multiplied in place by an fp8 cache's ``v_scale`` (nothing to do at 1.0)."""
    return out if v_scale == 1.0 else out.mul_(v_scale)


TORCH = AttentionBackend(
    "torch",
    torch_ops.reshape_and_cache,
    torch_ops.paged_attention_decode,
    torch_ops.paged_attention_prefill,
    windows=True,
)

# the decode kernel takes the attention options (windows, chunks, sinks, soft-capping); a step with them runs its
# prefill spans in the torch ops
CPU = AttentionBackend(
    "cpu",
    torch_ops.reshape_and_cache,
    cpu_ops.paged_attention_decode,
    torch_ops.paged_attention_prefill,
    cpu_ops.paged_prefill_attention,
    CPU_FUSED,
    windows=True,
)


def cuda_backend(fp8_cache: bool = False) -> AttentionBackend:
    """The CUDA kernels; ``fp8_cache``: over an fp8 e4m3 KV cache, where the model step's fused ops stay off (their
    rotary kernel writes a cache of the model's dtype only: the K/V go through ``reshape_and_cache``'s fp8 kernel)."""
    from raypaged import kernels

    def decode(query: torch.Tensor, *args) -> torch.Tensor:
        # the model's q is a view of its fused qkv rows (strided); the decode kernel reads packed rows
        return kernels.paged_attention_decode(query.contiguous(), *args)

    fused = FusedOps(kernels.rms_norm, kernels.fused_add_rms_norm, kernels.silu_and_mul, kernels.rotary_and_cache)
    use_fused = envs.fused_kernels()
    if use_fused and fp8_cache:
        logger.info(
            "the fused CUDA kernels are off over an fp8 KV cache (their rotary kernel writes the model's dtype)"
        )
        use_fused = False
    return AttentionBackend(
        "cuda",
        kernels.reshape_and_cache,
        decode,
        kernels.paged_attention_prefill,
        kernels.paged_prefill_attention if envs.varlen_prefill() else None,
        fused if use_fused else None,
    )


def cuda_cache_unsupported_reason(dtype: torch.dtype, cache_dtype: torch.dtype | None) -> str | None:
    """Why the CUDA kernels cannot read a KV cache of ``cache_dtype`` (None: the model's) for a model of ``dtype``,
    or None when they can: a cache of the model's dtype always, an fp8 e4m3 one with ``$RAYPAGED_FP8_KV_KERNELS=1``
    (off by default until ``benchmarks/gpu_check.py`` has run their tests on a device), no other."""
    if cache_dtype is None or cache_dtype == dtype:
        return None
    name = str(cache_dtype).removeprefix("torch.")
    if cache_dtype == torch.float8_e4m3fn:
        if envs.fp8_kv_kernels():
            return None
        return f"the KV cache is {name} (its kernels run with $RAYPAGED_FP8_KV_KERNELS=1)"
    return f"the KV cache is {name} (the kernels read caches of the model's dtype and float8_e4m3fn ones)"


def cuda_unsupported_reason(
    device: torch.device,
    head_size: int,
    block_size: int,
    dtype: torch.dtype | None = None,
    cache_dtype: torch.dtype | None = None,
) -> str | None:
    """Why the CUDA kernels cannot run this model (``dtype``) over this KV cache (``cache_dtype``, by default the
    model's) here, or None when they can."""
    from raypaged.kernels import host

    if device.type != host.device_type():  # cpu where the kernels run on the host (tests)
        return f"the device is {device.type}"
    if dtype is not None and (reason := cuda_cache_unsupported_reason(dtype, cache_dtype)) is not None:
        return reason
    if head_size not in CUDA_HEAD_SIZES:
        return f"head size {head_size} has no kernel (supported: {', '.join(map(str, CUDA_HEAD_SIZES))})"
    if block_size not in CUDA_BLOCK_SIZES:
        return f"block size {block_size} has no kernel (supported: {', '.join(map(str, CUDA_BLOCK_SIZES))})"
    if not host.enabled() and importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'raypaged[cuda]')"
    return None


def cpu_unsupported_reason(
    device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype | None = None
) -> str | None:
    """Why the CPU kernels cannot run this model (``dtype``) over this KV cache (``cache_dtype``, by default the
    model's) here, or None when they can."""
    if device.type != "cpu":
        return f"the device is {device.type}"
    if dtype != torch.float32:
        return f"the model runs in {str(dtype).removeprefix('torch.')} (the kernel reads float32)"
    if cache_dtype is not None and cache_dtype not in cpu_ops.CACHE_DTYPES:
        return (
            f"the KV cache is {str(cache_dtype).removeprefix('torch.')} (the kernels read float32, float8_e4m3fn "
            f"and bfloat16 caches)"
        )
    return cpu_ops.unavailable_reason()


def select_backend(
    name: str,
    device: torch.device,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """``auto``: the CUDA kernels wherever they can run, on CPU the CPU kernels, else torch; ``cpu`` and
    ``cuda`` insist. ``dtype`` is the model's; ``cache_dtype`` the KV cache's, by default the model's (the
    CUDA kernels read a cache of the model's dtype, and an fp8 e4m3 one with ``$RAYPAGED_FP8_KV_KERNELS=1``:
    ``cuda_cache_unsupported_reason``)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "torch":
        return TORCH
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        reason = cpu_unsupported_reason(device, dtype, cache_dtype)
        if reason is None:
            return CPU
        if name == "cpu":
            raise ValueError(f"attention_backend 'cpu' cannot run: {reason}")
        if dtype == torch.float32:
            logger.warning("paged attention runs in torch, not the CPU kernels: %s", reason)
        return TORCH
    reason = cuda_unsupported_reason(device, head_size, block_size, dtype, cache_dtype)
    if reason is None:
        return cuda_backend(fp8_cache=cache_dtype == torch.float8_e4m3fn and cache_dtype != dtype)
    if name == "cuda":
        raise ValueError(f"attention_backend 'cuda' cannot run: {reason}")
    if device.type == "cuda":
        logger.warning("paged attention runs in torch, not the CUDA kernels: %s", reason)
    return TORCH
