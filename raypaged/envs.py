"""Every environment variable raypaged reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

_Number = TypeVar("_Number", int, float)


def cache_dir() -> Path:
    """Where converted models are cached: ``$RAYPAGED_CACHE_DIR`` or ``~/.cache/raypaged``."""
    return Path(os.environ.get("RAYPAGED_CACHE_DIR") or Path.home() / ".cache" / "raypaged")


def log_level() -> str:
    """Default log level of the ``raypaged`` logger: ``$RAYPAGED_LOG_LEVEL`` or ``info``."""
    return os.environ.get("RAYPAGED_LOG_LEVEL", "info")


def api_key() -> str | None:
    """The gateway's API key when ``--api-key`` is not given: ``$RAYPAGED_API_KEY`` (keeps the key
    out of the process list), or ``None`` for no key."""
    return os.environ.get("RAYPAGED_API_KEY") or None


def _positive(name: str, parse: type[_Number]) -> _Number | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"${name} must be a positive {parse.__name__}, got {raw!r}")
    return value


def cpu_threads_per_shard() -> int | None:
    """Torch/OpenMP/MKL threads of every CPU shard actor: ``$RAYPAGED_CPU_THREADS_PER_SHARD``, or
    ``None`` for the default, max(1, cores of the shard's node // shards placed on that node)."""
    return _positive("RAYPAGED_CPU_THREADS_PER_SHARD", int)


def cpu_kv_cache_space() -> float | None:
    """GiB of KV cache per CPU worker when no flag sizes it: ``$RAYPAGED_CPU_KVCACHE_SPACE`` (vLLM's
    ``VLLM_CPU_KVCACHE_SPACE``), read where the worker runs."""
    return _positive("RAYPAGED_CPU_KVCACHE_SPACE", float)


def step_timeout_s() -> float:
    """Seconds the driver waits for one step of a Ray shard group before treating the group as
    lost (a hung shard): ``$RAYPAGED_STEP_TIMEOUT_S`` or 120."""
    return _positive("RAYPAGED_STEP_TIMEOUT_S", float) or 120.0


STEP_CHANNELS = ("auto", "shm", "graph")


def step_channel() -> str:
    """How the driver sends each step to its Ray shards: ``$RAYPAGED_STEP_CHANNEL``, one of
    ``auto`` (the default: shared memory when every shard runs on the driver's node, else a Ray
    Compiled Graph), ``shm`` (shared memory, an error if a shard is on another node) or ``graph``."""
    value = os.environ.get("RAYPAGED_STEP_CHANNEL") or "auto"
    if value not in STEP_CHANNELS:
        raise ValueError(f"$RAYPAGED_STEP_CHANNEL must be one of {', '.join(STEP_CHANNELS)}, got {value!r}")
    return value


def _switch(name: str, default: str = "0") -> bool:
    value = os.environ.get(name) or default
    if value not in ("0", "1"):
        raise ValueError(f"${name} must be 0 or 1, got {value!r}")
    return value == "1"


def engine_process() -> bool:
    """Whether ``raypaged serve`` runs its engines in a child process of their own, linked to the gateway's
    process by a socket pair (``raypaged.serving.engine_process``): ``$RAYPAGED_ENGINE_PROCESS``, ``1`` (the
    default) or ``0`` (engines and gateway in one process, one interpreter lock, as before)."""
    return _switch("RAYPAGED_ENGINE_PROCESS", default="1")


def kernels_on_host() -> bool:
    """Whether the CUDA kernels' wrappers take CPU tensors and run the kernels built for the host CPU
    (``raypaged.kernels.host``, for tests without a GPU): ``$RAYPAGED_KERNELS_ON_HOST``, ``0`` (the default) or
    ``1``."""
    return _switch("RAYPAGED_KERNELS_ON_HOST")


def host_kernels_sanitize() -> str | None:
    """The sanitizer the kernels built for the host are compiled with: ``$RAYPAGED_HOST_KERNELS_SANITIZE``, unset
    (none) or ``address`` (AddressSanitizer; the process must start with its runtime in ``LD_PRELOAD``)."""
    value = os.environ.get("RAYPAGED_HOST_KERNELS_SANITIZE") or None
    if value not in (None, "address"):
        raise ValueError(f"$RAYPAGED_HOST_KERNELS_SANITIZE must be unset or address, got {value!r}")
    return value


# Off by default: these kernels compile and their tests exist (tests/gpu), but they have not yet
# run on a device; benchmarks/gpu_check.py turns them on, runs those tests and times them.
def fused_kernels() -> bool:
    """Whether the model step runs the fused CUDA kernels (``raypaged.kernels.fused_ops``) where the
    CUDA attention backend runs: ``$RAYPAGED_FUSED_KERNELS``, ``0`` (the default: the norms,
    SiLU-mul, rotary and cache write in torch, with the CUDA attention kernels) or ``1``."""
    return _switch("RAYPAGED_FUSED_KERNELS")


def varlen_prefill() -> bool:
    """Whether the CUDA attention backend runs a step's prefill spans in one varlen kernel call per
    layer (``raypaged.kernels.paged_prefill_attention``): ``$RAYPAGED_VARLEN_PREFILL``, ``0`` (the
    default: span by span, a gather and SDPA for a span with cached context) or ``1``."""
    return _switch("RAYPAGED_VARLEN_PREFILL")


def fp8_kv_kernels() -> bool:
    """Whether an fp8 e4m3 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e4m3``) on a CUDA device runs in the
    CUDA attention kernels, which narrow K/V into it and widen them from it themselves (the ``*_fp8``
    kernels, ``kernels/fp8.cuh``): ``$RAYPAGED_FP8_KV_KERNELS``, ``0`` (the default: such a cache runs in
    the torch attention backend, K/V gathered and widened in torch every step) or ``1``. An fp8_e5m2 cache
    runs in torch either way."""
    return _switch("RAYPAGED_FP8_KV_KERNELS")


def lora_kernels() -> bool:
    """Whether LoRA steps run the BGMV CUDA kernels (``kernels/lora_bgmv.cu``) where the model is on
    a CUDA device, with the LoRA product recorded in the CUDA graphs (decode, and piecewise where
    those are on): ``$RAYPAGED_LORA_KERNELS``, ``0`` (the default: torch matmuls per active slot,
    and steps with adapters run eagerly) or ``1``."""
    return _switch("RAYPAGED_LORA_KERNELS")


def piecewise_graphs() -> bool:
    """Whether a step with prefill spans (and of at most 512 tokens) replays piecewise CUDA graphs
    (``raypaged.worker.piecewise_graphs``: all but the attention recorded, the attention eager)
    where the decode graphs are captured: ``$RAYPAGED_PIECEWISE_GRAPHS``, ``0`` (the default: such
    steps run eagerly) or ``1``."""
    return _switch("RAYPAGED_PIECEWISE_GRAPHS")


def w4a16_kernels() -> bool:
    """Whether 4-bit GPTQ, AWQ and compressed-tensors layers on a CUDA device run the CuPy W4A16 kernels
    (``raypaged.kernels.quant_ops``: the weight repacked once at load, a GEMV up to 8 rows, else a dequantize
    kernel and cuBLAS): ``$RAYPAGED_W4A16_KERNELS``, ``0`` (the default: every call dequantizes the weight in
    torch, then the float GEMM) or ``1``."""
    return _switch("RAYPAGED_W4A16_KERNELS")


def block_fp8_scaled_mm() -> bool:
    """Whether block-wise fp8 linears (``raypaged.quantization.block_fp8``) multiply through
    ``torch._scaled_mm`` with 1 x 128 block scales on a Hopper GPU: ``$RAYPAGED_BLOCK_FP8_SCALED_MM``,
    ``0`` (the default: the weight and the activations dequantized, then the float GEMM) or ``1``."""
    return _switch("RAYPAGED_BLOCK_FP8_SCALED_MM")


def tp_cuda_graphs() -> bool:
    """Whether CUDA graphs are captured under tensor parallelism (``--tensor-parallel-size`` above 1 on CUDA),
    the shards' all-reduces then through NCCL called directly (``raypaged.worker.nccl``), which a graph can record:
    ``$RAYPAGED_TP_CUDA_GRAPHS``, ``0`` (the default: under tensor parallelism every step runs eagerly, its
    all-reduces through torch.distributed) or ``1``. Its test needs two GPUs
    (``tests/gpu/test_tensor_parallel_cuda.py``)."""
    return _switch("RAYPAGED_TP_CUDA_GRAPHS")
