"""Which scheme a model runs: the checkpoint's quantization_config, the flag, and the exact errors."""

import json
import re
import shutil

import pytest

from raypaged.config import EngineConfig
from raypaged.quantization import resolve_quantization
from raypaged.quantization.block_fp8 import BlockFp8Method
from raypaged.quantization.compressed_tensors import CompressedTensorsConfig
from raypaged.quantization.gptq import GPTQConfig
from raypaged.quantization.quantizer import quantization_config


def with_quantization_config(src, dst, config):
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_the_checkpoint_decides_and_the_flag_may_repeat_it(quantized_dirs):
    for flag in (None, "gptq"):
        config = EngineConfig(model=str(quantized_dirs["gptq-actorder-asym"]), quantization=flag)
        assert config.quant_config == GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False)
    config = EngineConfig(model=str(quantized_dirs["w8a8-int8"]))
    assert isinstance(config.quant_config, CompressedTensorsConfig)
    assert config.quant_config.scheme_of("model.layers.0.mlp.up_proj").format == "int-quantized"
    assert config.quant_config.scheme_of("lm_head") is None


def test_a_flag_contradicting_the_checkpoint_is_a_startup_error(quantized_dirs):
    message = (
        "--quantization fp8 contradicts the checkpoint's quantization_config (quant_method 'awq'): "
        "drop --quantization or pass --quantization awq"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        EngineConfig(model=str(quantized_dirs["awq"]), quantization="fp8")


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "the checkpoint's quantization_config quant_method 'bitsandbytes' is not supported (supported: awq, "
            "compressed-tensors, fp8, gptq)",
        ),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits 3 is not supported (supported: 4, 8)"),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            "awq version 'gemv' is not supported (only gemm, the layout vLLM reads)",
        ),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "fp8 weight_block_size [128, 128] with activation_scheme 'static' is not supported (block-wise scales "
            "take dynamic activations only)",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128]},
            "fp8 weight_block_size must be two positive integers [block_n, block_k], got [128]",
        ),
        (
            {"quant_method": "fp8", "kv_cache_quant": True},
            "fp8 quantization_config field 'kv_cache_quant' is not supported (supported: activation_scheme, fmt, "
            "ignored_layers, modules_to_not_convert, quant_method, weight_block_size)",
        ),
        (
            {
                **quantization_config("w8a8-int8", 128, True, False),
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head"},
            },
            "compressed-tensors kv_cache_scheme strategy 'attn_head' is not supported (fp8 K/V with one static "
            "symmetric scale per tensor: num_bits 8, type float, strategy tensor, dynamic false)",
        ),
        (
            {**quantization_config("kv-fp8", 128, True, False), "kv_cache_scheme": {"num_bits": 8, "type": "int"}},
            "compressed-tensors kv_cache_scheme type 'int' is not supported (fp8 K/V with one static symmetric scale "
            "per tensor: num_bits 8, type float, strategy tensor, dynamic false)",
        ),
        (
            {**quantization_config("kv-fp8", 128, True, False), "kv_cache_scheme": {"type": "float", "dynamic": True}},
            "compressed-tensors kv_cache_scheme dynamic True is not supported (fp8 K/V with one static symmetric "
            "scale per tensor: num_bits 8, type float, strategy tensor, dynamic false)",
        ),
        (
            {**quantization_config("kv-fp8", 128, True, False), "kv_cache_scheme": {"num_bits": 8, "zero": 1}},
            "compressed-tensors kv_cache_scheme quantization_config field 'zero' is not supported (supported: "
            "actorder, block_structure, dynamic, group_size, num_bits, observer, observer_kwargs, scale_dtype, "
            "strategy, symmetric, type, zp_dtype)",
        ),
        (
            quantization_config("kv-fp8", 128, True, False),
            "compressed-tensors quantization_config has no config_groups",
        ),
    ],
)
def test_unsupported_checkpoint_quantization_is_named(config, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        resolve_quantization(None, config)


def test_an_unsupported_compressed_tensors_scheme_is_described():
    config = quantization_config("w4a16", 128, True, False)
    config["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8,
        "type": "int",
        "strategy": "token",
        "dynamic": True,
        "symmetric": True,
    }
    with pytest.raises(
        ValueError,
        match=re.escape(
            "compressed-tensors scheme group_0 (format pack-quantized, weights int4 group (group 128), "
            "input_activations int8 token) is not supported"
        ),
    ):
        resolve_quantization("compressed-tensors", config)


def test_a_float_checkpoint_needs_an_online_scheme(tiny_float_dir):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "--quantization gptq needs a checkpoint quantized with gptq, but the model's config.json has no "
            "quantization_config"
        ),
    ):
        EngineConfig(model=str(tiny_float_dir), quantization="gptq")
    assert EngineConfig(model=str(tiny_float_dir), quantization="fp8").quant_config.serialized is False


def test_an_unsupported_checkpoint_is_refused_at_startup(tmp_path, tiny_float_dir):
    path = with_quantization_config(tiny_float_dir, tmp_path / "m", {"quant_method": "gguf"})
    with pytest.raises(ValueError, match=re.escape("quant_method 'gguf' is not supported")):
        EngineConfig(model=str(path))


def test_dummy_weights_cannot_fill_a_quantized_checkpoint(quantized_dirs):
    with pytest.raises(
        ValueError, match=re.escape("--load-format dummy cannot fill the gptq tensors of a quantized checkpoint")
    ):
        EngineConfig(model=str(quantized_dirs["gptq"]), load_format="dummy")


def test_block_fp8_checkpoints_name_their_tiles_and_the_modules_left_float():
    fp8 = resolve_quantization(
        "fp8",
        {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 64],
            "modules_to_not_convert": ["mlp.down_proj"],
        },
    )
    method = fp8.linear_method(("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"))
    assert isinstance(method, BlockFp8Method)
    assert (method.block_n, method.block_k, method.scale_name) == (128, 64, "weight_scale_inv")
    assert fp8.linear_method(("model.layers.3.mlp.down_proj",)) is None  # transformers matches a substring
    config = quantization_config("w8a8-fp8-block", 128, True, False, block=(64, 32))
    method = resolve_quantization(None, config).linear_method(("model.layers.0.mlp.down_proj",))
    assert isinstance(method, BlockFp8Method)
    assert (method.block_n, method.block_k, method.scale_name) == (64, 32, "weight_scale")


def test_a_block_fp8_compressed_tensors_scheme_needs_activation_groups_of_its_block():
    config = quantization_config("w8a8-fp8-block", 128, True, False, block=(64, 32))
    config["config_groups"]["group_0"]["input_activations"]["group_size"] = 64
    with pytest.raises(
        ValueError,
        match=re.escape(
            "compressed-tensors scheme group_0 (format float-quantized, weights float8 block [64, 32], "
            "input_activations float8 group) is not supported"
        ),
    ):
        resolve_quantization(None, config)
