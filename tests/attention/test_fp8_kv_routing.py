"""Which attention backend an fp8 KV cache gets on a CUDA device (no GPU needed: the selection functions are
called directly, cupy's presence faked): torch unless ``$RAYPAGED_FP8_KV_KERNELS=1``, then the CUDA kernels for
an e4m3 cache (with the fused ops off: their rotary kernel writes the model's dtype); e5m2 stays on torch."""

import importlib.util
import logging
import re

import pytest
import torch

from raypaged import envs
from raypaged.attention.backend import (
    TORCH,
    cuda_cache_unsupported_reason,
    cuda_unsupported_reason,
    select_backend,
)

CUDA = torch.device("cuda")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OFF = "the KV cache is float8_e4m3fn (its kernels run with $RAYPAGED_FP8_KV_KERNELS=1)"
NEVER = "the KV cache is float8_e5m2 (the kernels read caches of the model's dtype and float8_e4m3fn ones)"


@pytest.fixture
def cupy_installed(monkeypatch):
    """cuda_unsupported_reason asks importlib whether cupy is there: say yes."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: object() if name == "cupy" else find_spec(name, *args)
    )


@pytest.fixture(autouse=True)
def defaults(monkeypatch):
    for name in ("RAYPAGED_FP8_KV_KERNELS", "RAYPAGED_FUSED_KERNELS", "RAYPAGED_VARLEN_PREFILL"):
        monkeypatch.delenv(name, raising=False)


def test_the_switch_is_off_by_default(monkeypatch):
    assert envs.fp8_kv_kernels() is False
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")
    assert envs.fp8_kv_kernels() is True
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "yes")
    with pytest.raises(ValueError, match=r"^\$RAYPAGED_FP8_KV_KERNELS must be 0 or 1, got 'yes'$"):
        envs.fp8_kv_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_reasons(monkeypatch, dtype):
    assert cuda_cache_unsupported_reason(dtype, None) is None
    assert cuda_cache_unsupported_reason(dtype, dtype) is None
    assert cuda_cache_unsupported_reason(dtype, E4M3) == OFF
    assert cuda_cache_unsupported_reason(dtype, E5M2) == NEVER
    other = torch.float16 if dtype != torch.float16 else torch.float32
    assert cuda_cache_unsupported_reason(dtype, other) == (
        f"the KV cache is {str(other).removeprefix('torch.')} (the kernels read caches of the model's dtype and "
        f"float8_e4m3fn ones)"
    )
    assert cuda_unsupported_reason(CUDA, 64, 16, dtype, E4M3) == OFF
    assert cuda_unsupported_reason(torch.device("cpu"), 64, 16, dtype, E4M3) == "the device is cpu"
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")
    assert cuda_cache_unsupported_reason(dtype, E4M3) is None
    assert cuda_cache_unsupported_reason(dtype, E5M2) == NEVER


@pytest.mark.usefixtures("cupy_installed")
def test_without_the_switch_an_fp8_cache_on_cuda_runs_in_torch(caplog):
    assert select_backend("auto", CUDA, 64, 16, torch.float16).name == "cuda"  # the model's dtype: the kernels
    with caplog.at_level(logging.WARNING, logger="raypaged"):
        assert select_backend("auto", CUDA, 64, 16, torch.float16, E4M3) is TORCH
    assert caplog.messages == [f"paged attention runs in torch, not the CUDA kernels: {OFF}"]
    assert select_backend("torch", CUDA, 64, 16, torch.float16, E4M3) is TORCH
    with pytest.raises(ValueError, match=rf"^attention_backend 'cuda' cannot run: {re.escape(OFF)}$"):
        select_backend("cuda", CUDA, 64, 16, torch.float16, E4M3)


@pytest.mark.usefixtures("cupy_installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_with_the_switch_an_e4m3_cache_on_cuda_runs_in_the_kernels(monkeypatch, caplog, dtype):
    from raypaged import kernels

    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "1")
    monkeypatch.setenv("RAYPAGED_VARLEN_PREFILL", "1")
    with caplog.at_level(logging.INFO, logger="raypaged"):
        backend = select_backend("auto", CUDA, 128, 16, dtype, E4M3)
    assert backend.name == "cuda"
    assert backend.reshape_and_cache is kernels.reshape_and_cache
    assert backend.varlen_prefill is kernels.paged_prefill_attention
    assert backend.fused_ops is None  # rotary_and_cache writes the model's dtype: K/V go through reshape_and_cache
    assert caplog.messages == [
        "the fused CUDA kernels are off over an fp8 KV cache (their rotary kernel writes the model's dtype)"
    ]
    assert select_backend("cuda", CUDA, 128, 16, dtype, E4M3).name == "cuda"
    assert select_backend("auto", CUDA, 128, 16, dtype).fused_ops is not None  # the model's dtype: fused as before
    assert select_backend("auto", CUDA, 128, 16, dtype, E5M2) is TORCH  # e5m2 stays on torch
    assert select_backend("auto", CUDA, 48, 16, dtype, E4M3) is TORCH  # a head size with no kernel falls back


@pytest.mark.parametrize(("kv_cache_dtype", "accepted"), [("fp8", True), ("fp8_e4m3", True), ("fp8_e5m2", False)])
def test_attention_backend_cuda_takes_an_e4m3_cache_only_with_the_kernels_on(
    kv_cache_dtype, accepted, monkeypatch, smollm2_dir
):
    from raypaged.config import EngineConfig

    message = (
        f"--kv-cache-dtype {kv_cache_dtype} runs in the torch attention backend: --attention-backend cuda reads a "
        "cache of the model's dtype (and an fp8 e4m3 one with RAYPAGED_FP8_KV_KERNELS=1)"
    )
    options = dict(model=str(smollm2_dir), kv_cache_dtype=kv_cache_dtype, attention_backend="cuda")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        EngineConfig(**options)
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")
    if accepted:
        assert EngineConfig(**options).kv_cache_dtype == kv_cache_dtype
    else:
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            EngineConfig(**options)
