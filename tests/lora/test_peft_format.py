"""Reading PEFT folders: the scale folded as peft computes it, and each adapter that cannot be
served refused with a message naming the adapter and the problem."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from raypaged.lora.layout import read_checked_adapter
from raypaged.lora.peft_format import PROJECTIONS, PeftAdapter, read_peft_adapter
from raypaged.lora.request import LoRARequest
from tests.conftest import make_tiny_model
from tests.lora.conftest import make_peft_adapter

SUPPORTED = ", ".join(PROJECTIONS)


@pytest.fixture(scope="module")
def tiny_config(tiny_llama_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_llama_dir)


def adapter(tmp_path: Path, base: Path, name: str = "a", **options) -> Path:
    options.setdefault("r", 4)
    options.setdefault("target_modules", ["q_proj", "down_proj"])
    return make_peft_adapter(base, tmp_path / name, seed=0, **options)


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def edit_tensors(path: Path, edit) -> Path:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file(edit(tensors), str(path / "adapter_model.safetensors"))
    return path


def add(config, path: Path, name: str = "a") -> PeftAdapter:
    """What the driver does before a request may use the adapter (``--max-lora-rank 8``)."""
    return read_checked_adapter(LoRARequest(name, 1, str(path)), config, max_lora_rank=8)


def test_scale_is_folded_into_b_as_peft_scales(tmp_path, tiny_llama_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = adapter(tmp_path, tiny_llama_dir, r=4, lora_alpha=12, use_rslora=True, rank_pattern={"down_proj": 2})
    read = read_peft_adapter("a", path, max_lora_rank=8)
    assert read.rank == 4
    raw = load_file(str(path / "adapter_model.safetensors"))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), path)
    for projection, parent, rank in (("q_proj", "self_attn", 4), ("down_proj", "mlp", 2)):
        module = peft_model.get_submodule(f"base_model.model.model.layers.1.{parent}.{projection}")
        assert module.scaling["default"] == 12 / rank**0.5
        key = f"base_model.model.model.layers.1.{parent}.{projection}.lora_B.weight"
        weights = read.weights[(1, projection)]
        assert weights.rank == rank
        torch.testing.assert_close(weights.lora_b, raw[key] * module.scaling["default"])


def test_bin_weights_read_as_safetensors(tmp_path, tiny_llama_dir):
    path = adapter(tmp_path, tiny_llama_dir)
    expected = read_peft_adapter("a", path, 8)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    (path / "adapter_model.safetensors").unlink()
    torch.save(tensors, path / "adapter_model.bin")
    got = read_peft_adapter("a", path, 8)
    assert got.weights.keys() == expected.weights.keys()
    for key, weights in got.weights.items():
        assert torch.equal(weights.lora_a, expected.weights[key].lora_a)
        assert torch.equal(weights.lora_b, expected.weights[key].lora_b)


def test_all_linear_and_full_paths_are_accepted(tmp_path, tiny_llama_dir):
    path = adapter(tmp_path, tiny_llama_dir, target_modules=["model.layers.1.mlp.up_proj", "v_proj"])
    assert sorted(read_peft_adapter("a", path, 8).weights) == [(0, "v_proj"), (1, "up_proj"), (1, "v_proj")]
    edit_config(path, target_modules="all-linear")
    assert len(read_peft_adapter("a", path, 8).weights) == 3


def test_rank_above_max_lora_rank(tmp_path, tiny_llama_dir, tiny_config):
    path = adapter(tmp_path, tiny_llama_dir, r=16)
    with pytest.raises(ValueError, match=r"^LoRA adapter 'a' has rank 16, above --max-lora-rank 8$"):
        add(tiny_config, path)


def test_one_module_rank_above_max_lora_rank(tmp_path, tiny_llama_dir, tiny_config):
    path = adapter(tmp_path, tiny_llama_dir, r=4, rank_pattern={"q_proj": 12})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'a' has rank 12, above --max-lora-rank 8$"):
        add(tiny_config, path)


def test_target_module_the_model_lacks(tmp_path, tiny_llama_dir, tiny_config):
    path = edit_config(adapter(tmp_path, tiny_llama_dir), target_modules=["q_proj", "c_attn"])
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"LoRA adapter 'a' targets module 'c_attn', which the model lacks (LoRA applies to {SUPPORTED})"
        ),
    ):
        add(tiny_config, path)


def test_weight_of_a_module_the_model_lacks(tmp_path, tiny_llama_dir, tiny_config):
    def rename(tensors):
        return {k.replace("mlp.down_proj", "mlp.fc2"): v for k, v in tensors.items()}

    path = edit_tensors(edit_config(adapter(tmp_path, tiny_llama_dir), target_modules=".*"), rename)
    key = "base_model.model.model.layers.0.mlp.fc2.lora_A.weight"
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"LoRA adapter 'a': weight '{key}' targets a module the model lacks (LoRA applies to {SUPPORTED})"
        ),
    ):
        add(tiny_config, path)


def test_projection_under_the_wrong_block(tmp_path, tiny_llama_dir, tiny_config):
    def move(tensors):
        return {k.replace("self_attn.q_proj", "mlp.q_proj"): v for k, v in tensors.items()}

    path = edit_tensors(adapter(tmp_path, tiny_llama_dir), move)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "LoRA adapter 'a': weight 'base_model.model.model.layers.0.mlp.q_proj.lora_A.weight' targets a module "
            "the model lacks"
        ),
    ):
        add(tiny_config, path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"target_modules": ["q_proj", "lm_head"]}, f"LoRA on 'lm_head' is not supported (supported: {SUPPORTED})"),
        ({"target_modules": ["embed_tokens"]}, f"LoRA on 'embed_tokens' is not supported (supported: {SUPPORTED})"),
        ({"use_dora": True}, "DoRA (use_dora) is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is not supported"),
        ({"lora_bias": True}, "a LoRA bias (lora_bias) is not supported"),
    ],
)
def test_unsupported_peft_features_are_refused_by_name(tmp_path, tiny_llama_dir, tiny_config, options, message):
    path = adapter(tmp_path, tiny_llama_dir, **options)
    with pytest.raises(ValueError, match=f"^{re.escape(f'LoRA adapter {chr(39)}a{chr(39)}: {message}')}$"):
        add(tiny_config, path)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            ".*embed_tokens",
            "LoRA on embeddings ('base_model.model.model.embed_tokens.lora_embedding_A') is not supported",
        ),
        (
            ".*lm_head",
            (f"LoRA on 'lm_head' ('base_model.model.lm_head.lora_A.weight') is not supported (supported: {SUPPORTED})"),
        ),
    ],
)
def test_unsupported_weights_behind_a_regex_target_are_refused_by_name(
    tmp_path, tiny_llama_dir, tiny_config, target, message
):
    path = adapter(tmp_path, tiny_llama_dir, target_modules=target)
    with pytest.raises(ValueError, match=f"^{re.escape(f'LoRA adapter {chr(39)}a{chr(39)}: {message}')}$"):
        add(tiny_config, path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bias": "lora_only"}, "bias 'lora_only' is not supported (only 'none')"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported (only LORA)"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern is not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out is not supported"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name(tmp_path, tiny_llama_dir, tiny_config, changes, message):
    path = edit_config(adapter(tmp_path, tiny_llama_dir), **changes)
    with pytest.raises(ValueError, match=f"^{re.escape(f'LoRA adapter {chr(39)}a{chr(39)}: {message}')}$"):
        add(tiny_config, path)


def test_adapter_of_another_base_model_does_not_fit(tmp_path, smollm2_dir, tiny_llama_dir, tiny_config):
    other = make_tiny_model(tmp_path, smollm2_dir, "llama", hidden_size=32, num_attention_heads=4)
    path = adapter(tmp_path, other)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"LoRA adapter 'a': layer 0 q_proj is [32, 32] (out, in) but the model's is [64, 64] "
            f"(the adapter was made for '{other}')"
        ),
    ):
        add(tiny_config, path)


def test_adapter_of_a_deeper_model_does_not_fit(tmp_path, smollm2_dir, tiny_llama_dir, tiny_config):
    deeper = make_tiny_model(tmp_path, smollm2_dir, "llama", num_hidden_layers=3)
    path = adapter(tmp_path, deeper)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"LoRA adapter 'a' has weights for layer 2 q_proj, but the model has 2 layers "
            f"(the adapter was made for '{deeper}')"
        ),
    ):
        add(tiny_config, path)


def test_broken_folders(tmp_path, tiny_llama_dir, tiny_config):
    with pytest.raises(ValueError, match=re.escape(f"LoRA adapter 'a': no adapter_config.json in {tmp_path}")):
        add(tiny_config, tmp_path)
    path = adapter(tmp_path, tiny_llama_dir)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(
        ValueError, match=re.escape(f"LoRA adapter 'a': no adapter_model.safetensors or adapter_model.bin in {path}")
    ):
        add(tiny_config, path)
    (path / "adapter_config.json").write_text("{'r': 8}")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"LoRA adapter 'a': {path / 'adapter_config.json'} is not valid JSON (Expecting property name enclosed "
            "in double quotes: line 1 column 2 (char 1))"
        ),
    ):
        add(tiny_config, path)


def test_broken_weights(tmp_path, tiny_llama_dir, tiny_config):
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    path = edit_tensors(adapter(tmp_path, tiny_llama_dir), lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'a': layer 1 q_proj has no lora_B weight$"):
        add(tiny_config, path)
    shutil.rmtree(path)
    path = edit_tensors(adapter(tmp_path, tiny_llama_dir), lambda t: {**t, key: t[key][:, :3].contiguous()})
    with pytest.raises(
        ValueError,
        match=re.escape("LoRA adapter 'a': layer 1 q_proj lora_A [4, 64] and lora_B [64, 3] do not share a rank"),
    ):
        add(tiny_config, path)
    shutil.rmtree(path)
    path = edit_tensors(adapter(tmp_path, tiny_llama_dir), lambda t: {})
    with pytest.raises(ValueError, match=r"^LoRA adapter 'a': the checkpoint holds no LoRA weights$"):
        add(tiny_config, path)


def test_a_fitting_adapter_keeps_the_model_order(tmp_path, tiny_llama_dir, tiny_config):
    read = add(tiny_config, adapter(tmp_path, tiny_llama_dir))
    assert list(read.weights) == [(0, "q_proj"), (0, "down_proj"), (1, "q_proj"), (1, "down_proj")]
