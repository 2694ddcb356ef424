"""An fp8 KV cache's per-layer scales (``KVScales``): the cache holds ``key / k_scale`` and ``value / v_scale``,
and attention reads what they stand for, ``stored * scale``, in every backend and step layout."""

import pytest
import torch

from raypaged.attention import cpu_fused, cpu_ops
from raypaged.attention.backend import CPU, TORCH, KVScales
from tests import fused_reference as ref

HEADS, KV_HEADS, DIM = 4, 2, 64
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.0137, 0.0061  # K/V of about 1-4 stored as about 70-300 (e4m3 reaches 448)


def step_tensors(seed: int, tokens: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, DIM, generator=gen)
    k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=gen) for _ in range(2))
    return q, k, v


def empty_cache(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (ref.NUM_BLOCKS, KV_HEADS, ref.BLOCK_SIZE, DIM)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def run(backend, steps, scales):
    """ref.STEPS through ``backend.forward`` over an fp8 cache with ``scales``: each step's output and the cache."""
    key_cache, value_cache = empty_cache(FP8)
    outs = []
    for index, step in enumerate(steps):
        _, meta = ref._step_meta(step, "cpu")
        q, k, v = step_tensors(index, meta.slot_mapping.shape[0])
        outs.append(backend.forward(q, k, v, key_cache, value_cache, meta, DIM**-0.5, scales))
    return outs, (key_cache, value_cache)


def reference(steps, k_scale, v_scale, fresh_exact):
    """The same steps over a float32 cache that holds what the fp8 one stands for: each K/V divided by its scale,
    rounded to fp8, times the scale; plain torch attention over it. ``fresh_exact``: a whole prompt attends over
    its own K/V as computed (the torch backend), else over the cache's (the CPU one: its varlen kernel reads
    every span from the cache)."""
    key_cache, value_cache = empty_cache(torch.float32)
    outs = []
    for index, step in enumerate(steps):
        _, meta = ref._step_meta(step, "cpu")
        q, k, v = step_tensors(index, meta.slot_mapping.shape[0])
        stored_k, stored_v = ((k / k_scale).to(FP8).float() * k_scale), ((v / v_scale).to(FP8).float() * v_scale)
        TORCH.reshape_and_cache(stored_k, stored_v, key_cache, value_cache, meta.slot_mapping)
        fresh = (k, v) if fresh_exact else (stored_k, stored_v)
        outs.append(TORCH.attend(q, *fresh, key_cache, value_cache, meta, DIM**-0.5))
    return outs


@pytest.mark.parametrize("name", ["torch", "cpu"])
def test_scaled_attention_reads_the_cache_times_its_scales(name):
    """ref.STEPS: two whole prompts (over their own fresh K/V), a decode beside a chunk over cached context, two
    decode-only steps."""
    if name == "cpu" and cpu_ops.unavailable_reason() is not None:
        pytest.skip("the CPU kernels do not build")
    backend = {"torch": TORCH, "cpu": CPU}[name]
    outs, (key_cache, value_cache) = run(backend, ref.STEPS, KVScales(K_SCALE, V_SCALE))
    expected = reference(ref.STEPS, K_SCALE, V_SCALE, fresh_exact=name == "torch")
    for got, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # the stored bytes: each step's K/V divided by the scales (all steps' slots are distinct)
    _, meta = ref._step_meta(ref.STEPS[0], "cpu")
    _, k, v = step_tensors(0, meta.slot_mapping.shape[0])
    slot = int(meta.slot_mapping[3])
    block, offset = slot // ref.BLOCK_SIZE, slot % ref.BLOCK_SIZE
    assert torch.equal(key_cache[block, :, offset].view(torch.uint8), (k[3] / K_SCALE).to(FP8).view(torch.uint8))
    assert torch.equal(value_cache[block, :, offset].view(torch.uint8), (v[3] / V_SCALE).to(FP8).view(torch.uint8))


def test_scales_keep_small_values_that_scale_one_loses():
    """K/V of about 1e-3 (below e4m3's normal range, 2^-6) lose most of their bits at scale 1.0; scaled into
    fp8's range they keep three mantissa bits (the largest error over the largest output, every step)."""
    steps = ref.STEPS

    def error(scales):
        key_cache, value_cache = empty_cache(FP8)
        worst = 0.0
        exact_k, exact_v = empty_cache(torch.float32)
        for index, step in enumerate(steps):
            _, meta = ref._step_meta(step, "cpu")
            q, k, v = step_tensors(index, meta.slot_mapping.shape[0])
            k, v = k * 1e-3, v * 1e-3
            got = TORCH.forward(q * 1e3, k, v, key_cache, value_cache, meta, DIM**-0.5, scales)
            want = TORCH.forward(q * 1e3, k, v, exact_k, exact_v, meta, DIM**-0.5)
            worst = max(worst, float(((got - want).abs().amax() / want.abs().amax())))
        return worst

    assert error(KVScales(4e-3 / 200, 4e-3 / 200)) < 0.1 and error(KVScales()) > 0.5  # measured 0.076 and 0.85


@pytest.mark.skipif(cpu_ops.unavailable_reason() is not None, reason="the CPU kernels do not build")
def test_rotary_and_cache_writes_the_scaled_keys_and_values():
    """cpu_fused.rotary_and_cache over an fp8 cache: the bytes of ``(rotated key / k_scale).to(fp8)`` and
    ``(value / v_scale).to(fp8)``, those of the torch path; a float32 cache takes no scales."""
    positions, meta = ref._step_meta(ref.STEPS[0], "cpu")
    q, k, v = step_tensors(0, positions.shape[0])
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")  # head_dim 64, as DIM
    cos_sin = model.model.layers[0].self_attn.rotary.cos_sin
    key_cache, value_cache = empty_cache(FP8)
    q_c, k_c = q.clone(), k.clone()
    cpu_fused.rotary_and_cache(
        positions, q_c, k_c, v, cos_sin, key_cache, value_cache, meta.slot_mapping, k_scale=K_SCALE, v_scale=V_SCALE
    )
    expected_k, expected_v = empty_cache(FP8)
    q_t, k_t = q.clone(), k.clone()
    ref.rotary_and_cache(positions, q_t, k_t, v, cos_sin, *empty_cache(torch.float32), meta.slot_mapping)
    TORCH.write_cache(k_t, v, expected_k, expected_v, meta.slot_mapping, KVScales(K_SCALE, V_SCALE))
    assert torch.equal(k_c, k_t) and torch.equal(q_c, q_t)
    assert torch.equal(key_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_v.view(torch.uint8))
    with pytest.raises(ValueError, match=r"K/V scales \(0.5, 1.0\) apply to an fp8 cache, not a float32 one"):
        cpu_fused.rotary_and_cache(
            positions, q, k, v, cos_sin, *empty_cache(torch.float32), meta.slot_mapping, k_scale=0.5
        )


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_a_scale_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="a KV cache scale must be positive and finite, got"):
        KVScales().set(1.0, bad)


def test_scales_are_kept_in_float32():
    scales = KVScales()
    scales.set(0.1, 1 / 3)
    assert scales.k == float(torch.tensor(0.1, dtype=torch.float32)) and scales.k != 0.1
    assert scales.v == float(torch.tensor(1 / 3, dtype=torch.float32))
    assert not scales.unit and KVScales().unit
