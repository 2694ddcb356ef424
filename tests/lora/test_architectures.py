"""Adapters on the other decoders raypaged runs (biased QKV, per-head q/k norms, tied MHA, Granite's multipliers,
Phi-3's fused projections), and on a quantized base: the wrapping does not depend on the base linear's class."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from raypaged.lora.config import LoRAConfig
from raypaged.lora.layout import check_adapter_fits
from raypaged.lora.manager import LoRAManager
from raypaged.lora.ops import add_lora_reference
from raypaged.lora.peft_format import LoRAWeights, PeftAdapter
from raypaged.lora.request import LoRARequest
from raypaged.model.loader import load_model
from raypaged.model.parallel import TensorParallel
from raypaged.quantization import resolve_quantization
from tests.conftest import make_tiny_model
from tests.lora.conftest import load_raypaged, make_peft_adapter, peft_logits, prefill_logits

PROMPTS = [[3, 400, 401, 402, 9], [1, 2, 3], [77, 78, 79, 80]]
PROMPT_ADAPTERS = ["all", None, "qkv"]
VARIANTS = {
    "qwen2-qkv-bias": ("qwen2", {"num_key_value_heads": 4}),
    "qwen3-qk-norm-bias": ("qwen3", {"head_dim": 16, "attention_bias": True, "tie_word_embeddings": True}),
    "llama-tied-mha": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 8}),
    "granite": ("granite", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5, "logits_scaling": 3.0}),
    "phi3-partial-rotary": ("phi3", {"num_attention_heads": 4, "pad_token_id": 0, "partial_rotary_factor": 0.5}),
}
ADAPTER_OPTIONS = {
    "all": {"r": 4, "target_modules": "all-linear"},
    "qkv": {"r": 2, "lora_alpha": 3, "target_modules": ["q_proj", "k_proj", "v_proj"]},
}
# Phi-3's checkpoint, and so its adapters, hold q/k/v and gate/up fused
FUSED_ADAPTER_OPTIONS = {
    "all": ADAPTER_OPTIONS["all"],
    "qkv": {"r": 2, "lora_alpha": 3, "target_modules": ["qkv_proj", "gate_up_proj"]},
}


def attach(model, adapter_dirs) -> LoRAManager:
    manager = LoRAManager(
        model, LoRAConfig(max_loras=2, max_lora_rank=4), TensorParallel(), torch.float32, torch.device("cpu")
    )
    for slot, (name, path) in enumerate(adapter_dirs.items()):
        manager.place(slot, LoRARequest(name, slot + 1, str(path)))
    return manager


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mixed_forward_equals_peft(tmp_path, smollm2_dir, variant):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[variant]
    model_dir = make_tiny_model(tmp_path, smollm2_dir, arch, **overrides)
    adapter_dirs = {
        name: make_peft_adapter(model_dir, tmp_path / name, seed=i, std=0.3, **options)
        for i, (name, options) in enumerate((FUSED_ADAPTER_OPTIONS if arch == "phi3" else ADAPTER_OPTIONS).items())
    }
    model = load_raypaged(model_dir)
    manager = attach(model, adapter_dirs)
    slots = {name: i for i, name in enumerate(adapter_dirs)}
    manager.set_slot_mapping([slots.get(a) for a, p in zip(PROMPT_ADAPTERS, PROMPTS) for _ in p])
    got = prefill_logits(model, PROMPTS)
    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), adapter_dirs["all"], adapter_name="all"
    )
    reference.load_adapter(adapter_dirs["qkv"], adapter_name="qkv")
    for name, prompt, logits in zip(PROMPT_ADAPTERS, PROMPTS, got):
        want = peft_logits(reference.eval(), name, prompt)
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4, msg=f"{variant} adapter {name}")
        if name is not None:
            assert (want - peft_logits(reference, None, prompt)).abs().max() > 0.1


def test_quantized_base_linears_take_lora_unchanged(tmp_path, smollm2_dir):
    model_dir = make_tiny_model(tmp_path, smollm2_dir, "llama")
    adapter_dirs = {
        name: make_peft_adapter(model_dir, tmp_path / name, seed=i, std=0.3, **options)
        for i, (name, options) in enumerate(ADAPTER_OPTIONS.items())
    }
    model = load_model(
        model_dir,
        AutoConfig.from_pretrained(model_dir),
        64,
        torch.float32,
        torch.device("cpu"),
        quant_config=resolve_quantization("fp8", None),
    )
    base_classes = {type(model.model.layers[0].self_attn.qkv_proj), type(model.model.layers[0].mlp.down_proj)}
    assert {cls.__name__ for cls in base_classes} == {"QuantLinear"}
    base_logits = prefill_logits(model, PROMPTS)
    manager = attach(model, adapter_dirs)
    assert {type(linear.base) for linear in manager.lora_model.linears.values()} == base_classes
    token_slots = [0, 1, None, 1, 0, 0]
    manager.set_slot_mapping(token_slots)
    for linear in manager.lora_model.linears.values():
        x = torch.randn(len(token_slots), linear.target.in_features)
        want = linear.base(x)
        add_lora_reference(want, x, linear.lora_a, linear.lora_b, token_slots)
        assert not torch.equal(want, linear.base(x))  # adapter "all" (slot 0) is on every linear
        torch.testing.assert_close(linear(x), want)
    manager.set_slot_mapping([None] * sum(map(len, PROMPTS)))
    for got, want in zip(prefill_logits(model, PROMPTS), base_logits):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("arch", "projection", "projections"),
    [
        ("phi3", "q_proj", "qkv_proj, o_proj, gate_up_proj, down_proj"),
        ("llama", "gate_up_proj", "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    ],
)
def test_an_adapter_of_the_other_layout_is_refused_by_name(arch, projection, projections):
    """Phi-3's adapters adapt its fused projections, the others' the unfused ones: the other names are refused."""
    config = AutoConfig.for_model(arch, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    rows = {"q_proj": 64, "gate_up_proj": 256}[projection]
    adapter = PeftAdapter("a", 2, "base", {(0, projection): LoRAWeights(torch.zeros(2, 64), torch.zeros(rows, 2))})
    with pytest.raises(ValueError) as info:
        check_adapter_fits(adapter, config)
    assert str(info.value) == (
        f"LoRA adapter 'a': layer 0 {projection} targets a module the model lacks (its projections: {projections}) "
        "(the adapter was made for 'base')"
    )
