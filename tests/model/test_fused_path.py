"""The model's fused path (taken with the CUDA attention backend) against its plain path, on CPU:
the fused kernels are swapped for their torch references (tests/fused_reference.py), so what is
checked here is the wiring: the residual stream carried beside each layer's output, the q/k norms,
rotary written to the cache in the attention layer, and AttentionBackend.attend. Both paths must
give the same bits. The kernels themselves are checked against the same references in
tests/gpu/test_fused_kernels.py."""

import pytest
import torch

from raypaged import kernels
from raypaged.attention.backend import TORCH
from tests import fused_reference as ref

FUSED = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_cache")


@pytest.fixture
def torch_kernels(monkeypatch):
    """raypaged.kernels' fused functions as their torch references, counting calls."""
    calls = dict.fromkeys(FUSED, 0)

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return getattr(ref, name)(*args, **kwargs)
        return call

    for name in FUSED:
        monkeypatch.setattr(kernels, name, counted(name))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_fused_path_gives_the_plain_paths_bits(torch_kernels, architecture, dtype, monkeypatch):
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "1")
    config = ref.tiny_config(architecture)
    model = ref.random_model(config, dtype, "cpu")
    plain_hidden, plain_caches = ref.run_steps(model, TORCH, "cpu")
    assert not model.model.fused_kernels and not any(torch_kernels.values())
    fused_hidden, fused_caches = ref.run_steps(model, ref.fused_torch_backend(), "cpu")
    assert model.model.fused_kernels
    steps, layers = len(ref.STEPS), config.num_hidden_layers
    assert torch_kernels == dict(
        rms_norm=steps * (1 + (2 * layers if architecture == "qwen3" else 0)),  # first norm (+ q/k norms)
        fused_add_rms_norm=steps * 2 * layers,  # post-attention, next layer's input, the final norm
        silu_and_mul=steps * layers,
        rotary_and_cache=steps * layers,
    )
    for plain, fused in zip(plain_hidden, fused_hidden):
        assert torch.equal(plain, fused)
    for (plain_k, plain_v), (fused_k, fused_v) in zip(plain_caches, fused_caches):
        assert plain_k.abs().sum() > 0 and torch.equal(plain_k, fused_k) and torch.equal(plain_v, fused_v)


def test_only_the_cuda_backend_selects_the_fused_path(monkeypatch):
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "1")
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    assert not model.model.fused_kernels
    model.set_attention_backend(ref.fused_torch_backend())
    assert model.model.fused_kernels
    model.set_attention_backend(TORCH)
    assert not model.model.fused_kernels


def test_the_fused_path_is_off_unless_the_environment_turns_it_on(monkeypatch):
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    monkeypatch.delenv("RAYPAGED_FUSED_KERNELS", raising=False)
    model.set_attention_backend(ref.fused_torch_backend())
    assert not model.model.fused_kernels
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "0")
    model.set_attention_backend(ref.fused_torch_backend())
    assert not model.model.fused_kernels
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "yes")
    with pytest.raises(ValueError, match=r"\$RAYPAGED_FUSED_KERNELS must be 0 or 1, got 'yes'"):
        model.set_attention_backend(ref.fused_torch_backend())


def test_the_fused_path_on_cpu_tensors_fails_in_the_kernel_checks(monkeypatch):
    """With the real kernels the fused path needs CUDA tensors; on CPU the first wrapper says so."""
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", "1")
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        ref.run_steps(model, ref.fused_torch_backend(), "cpu")
