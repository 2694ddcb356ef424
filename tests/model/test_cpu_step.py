"""A step's layers in one C call (raypaged.model.cpu_step, attention/cpu_step.c: decodes, prefills and both
mixed) against the same model's layer-by-layer fused path: the same bits, the same errors, and the layer path
wherever the one call does not apply."""

import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn
from transformers import Qwen2Config

from raypaged.attention import cpu_ops
from raypaged.attention.backend import CPU, TORCH
from raypaged.lora.layers import attach_lora
from raypaged.lora.ops import build_lora_mapping
from raypaged.model import cpu_step
from raypaged.model.parallel import TensorParallel
from tests import fused_reference as ref
from tests.model.conftest import tiny_config

pytestmark = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None, reason="the CPU kernels do not build")


def packed_model(architecture):
    if architecture == "qwen2":  # biases on q, k and v
        config = ref.tiny_config("llama").to_dict()
        config.pop("model_type", None)
        config = Qwen2Config(**{k: v for k, v in config.items() if k in Qwen2Config().to_dict()})
    else:
        config = tiny_config(architecture)
    model = ref.random_model(config, torch.float32, "cpu")
    if architecture == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0, 0.5)
    model.pack_weights()
    return model


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "phi3", "granite", "smollm3"])
def test_steps_in_one_call_give_the_layer_paths_bits(architecture, one_call_runs, monkeypatch):
    """ref.STEPS: two fresh prompts, a decode with a chunk over its cached context, two decode-only steps (Phi-3:
    half of each head rotated; Granite: its attention scale and residual multiplier; SmolLM3: a NoPE layer)."""
    model = packed_model(architecture)
    got = ref.run_steps(model, CPU, "cpu")
    assert one_call_runs == [15, 4, 2, 2]
    expected = ref.run_steps_layer_by_layer(monkeypatch, model, CPU)
    assert len(one_call_runs) == 4
    ref.assert_same_steps(got, expected)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_bf16_weights_in_one_call_give_the_layer_paths_bits(architecture, one_call_runs, monkeypatch):
    """A bf16 model on CPU (layers.bf16_linears_on_cpu): the one call runs its bf16 linears over a bf16 cache, and
    the next projection's first panels prefetched are bf16 ones too."""
    model = ref.random_model(tiny_config(architecture), torch.float32, "cpu")
    model.pack_weights(bf16=True)
    got = ref.run_steps(model, CPU, "cpu", cache_dtype=torch.bfloat16)
    assert one_call_runs == [15, 4, 2, 2]
    expected = ref.run_steps_layer_by_layer(monkeypatch, model, CPU, cache_dtype=torch.bfloat16)
    ref.assert_same_steps(got, expected)
    assert got[1][0][0].dtype == torch.bfloat16
    fp32 = ref.random_model(tiny_config(architecture), torch.float32, "cpu")
    fp32.pack_weights()
    assert not torch.equal(ref.run_steps(fp32, CPU, "cpu")[0][0], got[0][0])  # the weights were rounded


def test_an_fp8_cache_with_kv_scales_gives_the_layer_paths_bits(one_call_runs, monkeypatch):
    """Each layer's own K/V scales: the one call divides what it writes and folds them into the attention as the
    layers do (AttentionBackend.attend), to the bit; the scales change the cache's bytes."""
    model = packed_model("llama")
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.kv_scales.set(0.01 * (index + 1), 0.004 * (index + 1))
    fp8 = torch.float8_e4m3fn
    hidden, caches = ref.run_steps(model, CPU, "cpu", cache_dtype=fp8)
    assert one_call_runs == [15, 4, 2, 2]
    expected_hidden, expected_caches = ref.run_steps_layer_by_layer(monkeypatch, model, CPU, cache_dtype=fp8)
    for step, expected_step in zip(hidden, expected_hidden, strict=True):
        assert torch.equal(step, expected_step)
    for layer, expected_layer in zip(caches, expected_caches, strict=True):
        for cache, expected_cache in zip(layer, expected_layer, strict=True):
            assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    for layer in model.model.layers:
        layer.self_attn.kv_scales.set(1.0, 1.0)
    _, unscaled = ref.run_steps(model, CPU, "cpu", cache_dtype=fp8)
    assert not torch.equal(unscaled[0][0].view(torch.uint8), caches[0][0].view(torch.uint8))


def test_prefills_go_layer_by_layer_where_the_backend_has_another_varlen_kernel(one_call_runs, monkeypatch):
    """A backend with the CPU decode kernel but no varlen prefill kernel (its spans one at a time): the decode-only
    steps still run in one call, the steps with spans layer by layer, and the bits are the layers' own."""
    model = packed_model("llama")
    backend = dataclasses.replace(CPU, varlen_prefill=None)
    got = ref.run_steps(model, backend, "cpu")
    assert one_call_runs == [2, 2]
    ref.assert_same_steps(got, ref.run_steps_layer_by_layer(monkeypatch, model, backend))


def test_a_step_whose_prefills_are_not_one_varlen_batch_runs_layer_by_layer(one_call_runs):
    """The memory profile's step writes no cache: its spans' block ids do not cover their contexts, so the
    layers attend over the fresh K/V instead, one span at a time."""
    model = packed_model("llama")
    model.set_attention_backend(CPU)
    caches = empty_caches(model)
    positions, meta = ref._step_meta(ref.STEPS[0], "cpu")
    for span in meta.prefills:
        span.block_ids = span.block_ids[:0]
    assert not model.model.cpu_step.runs(meta, ref.BLOCK_SIZE)
    with torch.inference_mode():
        model(torch.arange(15), positions, caches, meta)
    assert one_call_runs == []


def test_where_the_one_call_does_not_apply_it_says_why(monkeypatch):
    model = packed_model("llama")
    model.set_attention_backend(TORCH)
    assert cpu_step.unsupported_reason(model.model) == "the model does not run the CPU backend's fused ops"
    model.set_attention_backend(dataclasses.replace(CPU, decode=TORCH.decode))
    assert cpu_step.unsupported_reason(model.model) == "the attention backend is cpu"
    model.set_attention_backend(CPU)
    assert cpu_step.unsupported_reason(model.model) is None and model.model.cpu_step is not None
    unpacked = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    unpacked.set_attention_backend(CPU)
    assert cpu_step.unsupported_reason(unpacked.model) == "a linear's weight is not packed for cpu_gemm.c"
    assert unpacked.model.cpu_step is None
    qwen3 = packed_model("qwen3")
    qwen3.set_attention_backend(CPU)
    assert cpu_step.unsupported_reason(qwen3.model) is None  # q/k norms per head (its own head_dim of 64)
    qwen3.model.layers[0].self_attn.k_norm.eps = 1e-5
    assert cpu_step.unsupported_reason(qwen3.model) == "the layers differ in rotary or norm epsilon"
    model.model.layers[1].post_attention_layernorm.eps = 1e-5
    assert cpu_step.unsupported_reason(model.model) == "the layers differ in rotary or norm epsilon"
    granite = packed_model("granite")
    granite.set_attention_backend(CPU)
    assert cpu_step.unsupported_reason(granite.model) is None
    granite.model.layers[1].residual_multiplier = 1.0
    assert cpu_step.unsupported_reason(granite.model) == "the layers differ in residual multiplier or attention scale"


class Wrapped(nn.Module):
    """What LoRA does to a linear after the backend is set: another module around it"""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x)


def test_a_linear_wrapped_later_sends_the_steps_back_layer_by_layer(one_call_runs, monkeypatch):
    model = packed_model("llama")
    expected_hidden, _ = ref.run_steps_layer_by_layer(monkeypatch, model, CPU)
    model.set_attention_backend(CPU)
    layer = model.model.layers[1]
    layer.mlp.down_proj = Wrapped(layer.mlp.down_proj)
    real_set = model.set_attention_backend
    monkeypatch.setattr(model, "set_attention_backend", lambda backend: None)  # keep the step built before the wrap
    assert model.model.cpu_step is not None
    hidden, _ = ref.run_steps(model, CPU, "cpu")
    assert one_call_runs == [] and model.model.cpu_step is None  # built again on the wrap: not eligible
    for got, expected in zip(hidden, expected_hidden, strict=True):
        assert torch.equal(got, expected)
    monkeypatch.setattr(model, "set_attention_backend", real_set)
    model.set_attention_backend(CPU)
    reason = "a linear is Wrapped, of a kind the one call does not run"
    assert cpu_step.unsupported_reason(model.model) == reason


def empty_caches(model):
    attn = model.model.layers[0].self_attn
    shape = (ref.NUM_BLOCKS, attn.num_kv_heads, ref.BLOCK_SIZE, attn.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in model.model.layers]


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        ("position", "a position is outside the rotary table's 64 positions"),
        ("slot", "a slot is outside the cache's 10 blocks of 8"),
        ("block", "a block table holds a block id outside the cache's 10 blocks"),
        ("length", r"a context length \(17\) is beyond its block table \(2 blocks of 8\)"),
        ("span", r"^a span's query is longer than its context \(cu_seqlens_q \[0, 3\], context_lens \[2\]\)$"),
    ],
)
def test_a_bad_step_fails_with_the_layer_paths_error(spoil, message, one_call_runs, monkeypatch):
    """A decode-only step (ref.STEPS[2]) spoiled, or a decode with a chunk (ref.STEPS[1]) whose span's query is
    longer than its context: the one call raises what the layers raise (for the span, the prefill kernel's
    own error through their varlen call)."""
    model = packed_model("llama")
    step = ref.STEPS[1] if spoil == "span" else ref.STEPS[2]
    for one_call in (True, False):
        model.set_attention_backend(CPU)
        if not one_call:
            model.model.cpu_step = None
        positions, meta = ref._step_meta(step, "cpu")
        if spoil == "position":
            positions[1] = 64
        elif spoil == "slot":
            meta.slot_mapping[0] = ref.NUM_BLOCKS * ref.BLOCK_SIZE
        elif spoil == "block":
            meta.decode_block_tables[1, 0] = ref.NUM_BLOCKS
        elif spoil == "length":
            meta.decode_context_lens[0] = 17
        else:
            meta.prefills[0].context_len = 2
        with torch.inference_mode(), pytest.raises(ValueError, match=message):
            model(torch.arange(1, positions.shape[0] + 1), positions, empty_caches(model), meta)
    assert one_call_runs == [positions.shape[0]]


def test_the_one_call_step_keeps_neither_its_model_nor_the_caches_alive(one_call_runs):
    """No reference cycle through the step: dropping the model and the caches frees them at once, as the engine
    expects when it shuts down (a cycle held a model's weights and its KV caches until the cyclic collector ran,
    and a long test session ran out of memory)."""
    model = packed_model("llama")
    hidden, caches = ref.run_steps(model, CPU, "cpu")
    assert one_call_runs == [15, 4, 2, 2]
    assert model.model.cpu_step is not None
    refs = [weakref.ref(model.model), weakref.ref(model.model.layers[0].mlp.gate_up_proj.weight)]
    refs.append(weakref.ref(caches[0][0]))
    gc.disable()
    try:
        del model, caches, hidden
        assert [ref() for ref in refs] == [None, None, None]
    finally:
        gc.enable()


def test_lora_steps_without_an_adapter_run_in_one_call_and_those_with_one_layer_by_layer(one_call_runs, monkeypatch):
    """attach_lora wraps the linears after the backend is set (as the worker does): the step is built again
    around their bases; a step where a token has an adapter runs layer by layer, with its product."""
    model = packed_model("llama")
    model.set_attention_backend(CPU)
    lora = attach_lora(model, 2, 8, TensorParallel(), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    for linear in lora.linears.values():
        a_t = torch.randn(linear.target.in_features, 4, generator=gen) * 0.2
        linear.set_slot(1, (a_t, torch.randn(4, linear.target.out_features, generator=gen) * 0.2))

    def adapters(index):  # the first decode-only step: sequence b with the adapter in slot 1
        lora.step.mapping = build_lora_mapping([None, 1]) if index == 2 else None

    got = ref.run_steps(model, CPU, "cpu", before_step=adapters)
    assert one_call_runs == [15, 4, 2]  # every step but the first decode-only one, which had an adapter
    assert cpu_step.unsupported_reason(model.model) is None
    ref.assert_same_steps(got, ref.run_steps_layer_by_layer(monkeypatch, model, CPU, before_step=adapters))
    hidden, base_hidden = got[0], ref.run_steps_layer_by_layer(monkeypatch, model, CPU)[0]
    assert torch.equal(hidden[2][0], base_hidden[2][0]) and not torch.equal(hidden[2][1], base_hidden[2][1])
