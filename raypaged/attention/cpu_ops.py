"""Paged attention on CPU without a gather copy: decode (``cpu_decode.c``) and every prefill span of a step in
one call (``cpu_prefill.c``), built with the host's C compiler into one library with the fused step ops of
``cpu_fused.c`` (wrapped by ``cpu_fused``), the float ends of the int8 linear (``cpu_int8.c``, wrapped in
``raypaged.quantization.w8a8``), the fp32 linear on packed weights (``cpu_gemm.c``, wrapped in
``raypaged.model.layers``), a step's layers in one call (``cpu_step.c``, wrapped in
``raypaged.model.cpu_step``) and sampling: greedy rows' argmax and log-probability, and every row's draw with its raw
logprobs (``cpu_sample.c``, in ``raypaged.worker.sampler``).

The torch path (``torch_ops.paged_attention_decode``) copies every sequence's K/V blocks into a
dense tensor before SDPA, so each cached token is read, written and read again. The C kernel reads
each K and V row once, through the block table, for all query heads of its KV head.

It is compiled once per machine (``cc -O3 -march=native -fopenmp``, a second or two) into
``$RAYPAGED_CACHE_DIR/cpu_kernels/``, keyed by the source, the flags, the compiler and the CPU, and
loaded with ctypes. Its OpenMP runtime is torch's own ``libgomp.so.1`` (already loaded, same soname),
so kernel and torch share one thread pool; it runs with ``torch.get_num_threads()`` threads.
Where no compiler is found or the build fails, :func:`unavailable_reason` says why and the torch
path runs instead (``--attention-backend auto``; linears through oneDNN) or startup fails
(``--attention-backend cpu``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from raypaged import envs
from raypaged.attention import torch_ops

logger = logging.getLogger("raypaged")

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu_decode.c",
        "cpu_prefill.c",
        "cpu_fused.c",
        "cpu_int8.c",
        "cpu_gemm.c",
        "cpu_step.c",
        "cpu_sample.c",
    )
)
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # every header the sources may include: in the cache key
# -fno-trapping-math: no kernel reads the floating-point exception flags, and without it GCC keeps branches
# around float arithmetic that could trap (the fp8 narrowing would not vectorize on AVX2)
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-std=gnu11",
    "-ffp-contract=fast",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# the argument types laid out as the C parameter lists are, not one per line
# fmt: off
_SIGNATURES = {  # symbol: (argument types, result type)
    "raypaged_paged_decode": ((_PTR, _I64, _I64, _PTR, _PTR, _INT, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64,
                               _I64, _I64, _F32, _INT), _INT),
    "raypaged_paged_decode_windowed": ((_PTR, _I64, _I64, _PTR, _PTR, _INT, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR,
                                        _F32, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _INT), _INT),
    "raypaged_paged_prefill": ((_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR,
                                _I64, _I64, _I64, _I64, _I64, _F32, _INT), _INT),
    "raypaged_quantize_int8_f32": ((_PTR, _I64, _I64, _I64, _F32, _PTR, _PTR, _INT), None),
    "raypaged_int8_scale_f32": ((_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT), None),
    "raypaged_int8_gemm_panel_width": ((), _INT),
    "raypaged_pack_weight_int8": ((_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT), None),
    "raypaged_int8_linear_f32": ((_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT,
                                  _INT), _INT),
    "raypaged_rms_norm_f32": ((_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _F32, _INT), None),
    "raypaged_fused_add_rms_norm_f32": ((_PTR, _PTR, _PTR, _I64, _I64, _F32, _INT), None),
    "raypaged_silu_and_mul_f32": ((_PTR, _PTR, _I64, _I64, _INT), None),
    "raypaged_gemm_panel_width": ((), _INT),
    "raypaged_pack_weight_f32": ((_PTR, _I64, _I64, _I64, _PTR, _INT), None),
    "raypaged_linear_f32": ((_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT), None),
    "raypaged_gemm_bf16_pairs": ((), _INT),
    "raypaged_pack_weight_bf16": ((_PTR, _I64, _I64, _I64, _PTR, _INT), None),
    "raypaged_linear_bf16": ((_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT), _INT),
    "raypaged_rotary_and_cache_f32": ((_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _INT, _F32,
                                       _F32, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _INT), _INT),
    "raypaged_step_layers": ((_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64,
                              _PTR, _PTR, _PTR, _PTR, _PTR, _INT), _INT),
    "raypaged_greedy_f32": ((_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT), _INT),
    "raypaged_sample_f32": ((_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64,
                             _PTR, _PTR, _PTR, _INT), _INT),
    "raypaged_dequantize_fp8_f32": ((_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _INT), None),
    "raypaged_fake_quantize_fp8_f32": ((_PTR, _I64, _I64, _I64, _I64, _F32, _F32, _PTR, _INT), None),
    "raypaged_dequantize_w4_packed_f32": ((_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _INT), None),
}
# fmt: on


class KernelUnavailable(RuntimeError):
    """The C kernel cannot be built or loaded here; the message says why."""


def compiler() -> str | None:
    """``$CC``, else the first of cc, gcc, clang on the PATH."""
    if cc := os.environ.get("CC"):
        return shutil.which(cc)
    return next((path for name in ("cc", "gcc", "clang") if (path := shutil.which(name))), None)


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(wanted))


def _build(cc: str, target: Path, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # several processes (Ray shards) may build at once: each writes its own file, then renames it
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            names = ", ".join(source.name for source in SOURCES[:-1]) + f" and {SOURCES[-1].name}"
            raise KernelUnavailable(f"{Path(cc).name} failed to build {names}: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The built kernels (building them on first use); raises :class:`KernelUnavailable`. ``extra_flags`` go
    after :data:`FLAGS` and into the cache key: ``("-mno-avx512f",)`` builds the 8-wide (AVX2) loops on a
    machine with AVX-512, as the tests do."""
    flags = (*FLAGS, *extra_flags)
    cc = compiler()
    if cc is None:
        raise KernelUnavailable("no C compiler found (set $CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from e
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, *flags, version, _cpu_identity()]).encode()).hexdigest()
    target = envs.cache_dir() / "cpu_kernels" / f"cpu_kernels-{key[:16]}.so"
    if not target.exists():
        logger.info("building the CPU kernels (paged decode attention, fused step ops) with %s into %s", cc, target)
        _build(cc, target, flags)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {target}: {e}") from e
    for symbol, (argtypes, restype) in _SIGNATURES.items():
        fn = getattr(lib, symbol)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def unavailable_reason() -> str | None:
    """Why the C kernel cannot run here, or None when it can."""
    try:
        library()
    except KernelUnavailable as e:
        return str(e)
    return None


@functools.cache
def builds() -> bool:
    """Whether the kernels build and load here (:func:`unavailable_reason` is None), found out once per
    process: what the per-call paths (the fp32 and int8 linears) ask, instead of trying the build again."""
    return unavailable_reason() is None


# the KV cache dtypes the kernels read and write, by their code in cpu_cache.h (enum cache_format); fp8: K/V divided
# by their layer's scales, then narrowed; bf16: a bf16 model's (layers.bf16_linears_on_cpu), rounded to nearest even
CACHE_FORMATS = {torch.float32: 0, torch.float8_e4m3fn: 1, torch.bfloat16: 2}
CACHE_DTYPES = tuple(CACHE_FORMATS)


def cache_format(dtype: torch.dtype) -> int:
    """The kernels' code of a cache of ``dtype`` (one of :data:`CACHE_DTYPES`)."""
    return CACHE_FORMATS[dtype]


def _check_query_and_caches(
    kernel: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> int:
    """The checks the decode and prefill kernels share; returns the caches' format (:func:`cache_format`)."""
    if query.dtype != torch.float32 or key_cache.dtype not in CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"the CPU {kernel} kernel reads a float32 query from float32, float8_e4m3fn or bfloat16 caches, got "
            f"query {query.dtype}, caches {key_cache.dtype} and {value_cache.dtype}"
        )
    if query.device.type != "cpu" or key_cache.device.type != "cpu":
        raise ValueError(f"the CPU {kernel} kernel runs on CPU tensors, got {query.device} and {key_cache.device}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = key_cache.shape[1], key_cache.shape[3]
    if value_cache.shape != key_cache.shape or cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit caches {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()) or query.stride(2) != 1:
        raise ValueError(f"the CPU {kernel} kernel needs contiguous caches and a query with contiguous rows")
    return cache_format(key_cache.dtype)


def raise_for_status(
    kernel: str, status: int, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, num_blocks: int
) -> None:
    """The decode and prefill kernels' shared failures (-1 memory, -2 a context past its table, -3 a bad block id)."""
    if status == -1:
        raise MemoryError(f"the CPU {kernel} kernel could not allocate its scratch memory")
    if status == -2:
        raise ValueError(
            f"a context length ({int(context_lens.max())}) is beyond its block table "
            f"({block_tables.shape[1]} blocks of {block_size})"
        )
    if status == -3:
        raise ValueError(f"a block table holds a block id outside the cache's {num_blocks} blocks")


def paged_attention_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] long
    context_lens: torch.Tensor,  # [num_seqs] long
    scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """``torch_ops.paged_attention_decode`` read through the block tables, for fp32 on CPU, with its options:
    ``sliding_window`` and ``chunk`` (Llama 4's attention chunks) as each sequence's first visible position,
    ``sinks`` (gpt-oss's per-head sink logits) and ``softcap`` (Gemma 2's) inside the kernel."""
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    form = _check_query_and_caches("decode", query, key_cache, value_cache)
    if block_tables.dtype != torch.long or context_lens.dtype != torch.long:
        raise ValueError(
            f"block tables and context lengths must be long, got {block_tables.dtype} and {context_lens.dtype}"
        )
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"{num_seqs} queries but block tables {tuple(block_tables.shape)} and context lengths "
            f"{tuple(context_lens.shape)}"
        )
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
    if num_seqs == 0:
        return out
    starts = torch_ops.first_visible(context_lens, sliding_window, chunk)
    starts = None if starts is None else starts.contiguous()  # held here while the kernel reads it
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must hold one logit per query head ({num_heads}), got {tuple(sinks.shape)}")
        sinks = sinks.to(torch.float32).contiguous()
    status = library().raypaged_paged_decode_windowed(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        form,
        num_blocks,
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        context_lens.data_ptr(),
        None if starts is None else starts.data_ptr(),
        None if sinks is None else sinks.data_ptr(),
        0.0 if softcap is None else float(softcap),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        block_size,
        head_dim,
        scale,
        torch.get_num_threads(),
    )
    raise_for_status("decode", status, context_lens, block_tables, block_size, num_blocks)
    return out


def paged_prefill_attention(
    query: torch.Tensor,  # [total_q_tokens, num_heads, head_dim]; rows may be strided (a view of qkv)
    key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [num_spans + 1] int32: span s owns query rows cu[s]..cu[s+1]-1
    context_lens: torch.Tensor,  # [num_spans] int32: tokens in the cache, this step's included
    block_tables: torch.Tensor,  # [num_spans, max_blocks] long, padded
    scale: float,
    max_query_len: int,  # unused here (the CUDA kernel's grid size); the same signature
    out: torch.Tensor | None = None,  # [total_q_tokens, num_heads, head_dim] contiguous, written in place
) -> torch.Tensor:
    """``raypaged.kernels.paged_prefill_attention``'s contract for fp32 on CPU: query token i of span s
    sits at position ``context_lens[s] - query_len_s + i`` and sees the cache up to it, read through the
    span's block table. Offsets, lengths and block ids are checked before anything is read."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    form = _check_query_and_caches("prefill", query, key_cache, value_cache)
    if cu_seqlens_q.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.dtype != torch.long:
        raise ValueError(
            f"cu_seqlens_q and context_lens must be int32 and block_tables long, got "
            f"{cu_seqlens_q.dtype}, {context_lens.dtype} and {block_tables.dtype}"
        )
    num_spans = cu_seqlens_q.shape[0] - 1
    if (
        cu_seqlens_q.dim() != 1
        or num_spans < 0
        or context_lens.shape != (num_spans,)
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_spans
    ):
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)}, context_lens {tuple(context_lens.shape)} and "
            f"block_tables {tuple(block_tables.shape)} do not describe the same spans"
        )
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    elif out.shape != query.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous float32 tensor of {tuple(query.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    if num_spans == 0:
        return out
    cu_seqlens_q, context_lens = cu_seqlens_q.contiguous(), context_lens.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    status = library().raypaged_paged_prefill(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        num_tokens,
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        form,
        num_blocks,
        cu_seqlens_q.data_ptr(),
        context_lens.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        out.data_ptr(),
        num_spans,
        num_heads,
        num_kv_heads,
        block_size,
        head_dim,
        scale,
        torch.get_num_threads(),
    )
    raise_for_prefill_status(status, num_tokens, cu_seqlens_q, context_lens, block_tables, block_size, num_blocks)
    return out


def raise_for_prefill_status(
    status: int,
    num_tokens: int,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_blocks: int,
) -> None:
    """The prefill kernel's failures: its own (-4, -5) and those it shares with the decode kernel."""
    if status == -4:
        raise ValueError(
            f"cu_seqlens_q {cu_seqlens_q.tolist()} does not ascend within the query's {num_tokens} rows "
            f"with at least one token per span"
        )
    if status == -5:
        raise ValueError(
            f"a span's query is longer than its context (cu_seqlens_q {cu_seqlens_q.tolist()}, "
            f"context_lens {context_lens.tolist()})"
        )
    raise_for_status("prefill", status, context_lens, block_tables, block_size, num_blocks)
