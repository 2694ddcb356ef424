"""The model's fused path (taken with an attention backend that brings fused ops) against its plain
path, on CPU, with the ops' torch references (tests/fused_reference.py), so what is checked here is
the wiring: the residual stream carried beside each layer's output, the q/k norms, rotary written to
the cache in the attention layer, and AttentionBackend.attend. Both paths must give the same bits.
The ops themselves are checked against the same references in tests/attention/test_cpu_fused.py (C)
and tests/gpu/test_fused_kernels.py (CUDA)."""

import dataclasses

import pytest
import torch

from raypaged import kernels
from raypaged.attention.backend import CPU, CPU_FUSED, TORCH, FusedOps, cuda_backend
from tests import fused_reference as ref
from tests.model.conftest import tiny_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("architecture", ["llama", "qwen3", "phi3", "granite"])
def test_fused_path_gives_the_plain_paths_bits(architecture, dtype):
    config = tiny_config(architecture)
    model = ref.random_model(config, dtype, "cpu")
    calls: dict[str, int] = {}
    plain_hidden, plain_caches = ref.run_steps(model, TORCH, "cpu")
    assert model.model.fused_ops is None and not calls
    fused_hidden, fused_caches = ref.run_steps(
        model, ref.fused_torch_backend(ref.counting(ref.REFERENCE_OPS, calls)), "cpu"
    )
    assert model.model.fused_ops is not None
    steps, layers = len(ref.STEPS), config.num_hidden_layers
    assert calls == dict(
        rms_norm=steps * (1 + (2 * layers if architecture == "qwen3" else 0)),  # first norm (+ q/k norms)
        fused_add_rms_norm=steps * 2 * layers,  # post-attention, next layer's input, the final norm
        silu_and_mul=steps * layers,
        rotary_and_cache=steps * layers,
    )
    ref.assert_same_steps((fused_hidden, fused_caches), (plain_hidden, plain_caches))


def test_the_backends_fused_ops_select_the_fused_path():
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    assert model.model.fused_ops is None
    model.set_attention_backend(ref.fused_torch_backend())
    assert model.model.fused_ops is ref.REFERENCE_OPS
    model.set_attention_backend(CPU)
    assert model.model.fused_ops is CPU_FUSED
    model.set_attention_backend(TORCH)
    assert model.model.fused_ops is None


def test_the_cuda_fused_kernels_are_off_unless_the_environment_turns_them_on(monkeypatch):
    monkeypatch.delenv("RAYPAGED_FUSED_KERNELS", raising=False)
    assert cuda_backend().fused_ops is None
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "0")
    assert cuda_backend().fused_ops is None
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "1")
    assert cuda_backend().fused_ops == FusedOps(
        kernels.rms_norm, kernels.fused_add_rms_norm, kernels.silu_and_mul, kernels.rotary_and_cache
    )
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "yes")
    with pytest.raises(ValueError, match=r"\$RAYPAGED_FUSED_KERNELS must be 0 or 1, got 'yes'"):
        cuda_backend()


def test_the_cuda_fused_kernels_on_cpu_tensors_fail_in_their_checks(monkeypatch):
    """The CUDA ops need CUDA tensors; on CPU the first wrapper says so."""
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "1")
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        ref.run_steps(model, dataclasses.replace(TORCH, fused_ops=cuda_backend().fused_ops), "cpu")
