"""fp8 KV cache scales from a checkpoint (llm-compressor's ``kv_cache_scheme``, vLLM's and AutoFP8's names) and
from ``--calculate-kv-scales``: where they come from, where they go, and the errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from raypaged.config import EngineConfig
from raypaged.engine.core import EngineCore, EngineCoreRequest
from raypaged.model.parallel import TensorParallel
from raypaged.quantization.compressed_tensors import KV_CACHE_SCHEME, CompressedTensorsConfig
from raypaged.quantization.kv_scales import kv_maxima
from raypaged.quantization.quantizer import quantize_checkpoint
from raypaged.sampling_params import SamplingParams
from raypaged.worker.worker import Worker
from tests.quantization.conftest import load

TEXT = "The quick brown fox jumps over the lazy dog. def f(x):\n    return 2 * x\n"


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory, tiny_float_dir):
    return quantize_checkpoint(tiny_float_dir, tmp_path_factory.mktemp("kv") / "kv-fp8", "kv-fp8")


def test_the_quantizer_writes_each_layers_scales_as_llm_compressor_does(kv_dir, tiny_float_dir):
    """kv-fp8: the weights as they were, a compressed-tensors config with only a kv_cache_scheme, and per layer
    k_scale = max |rotated key| / 448 and v_scale = max |value| / 448 over the calibration text."""
    tensors = load_file(kv_dir / "model.safetensors")
    originals = load_file(tiny_float_dir / "model.safetensors")
    maxima = kv_maxima(tiny_float_dir)
    assert len(maxima) == 2
    for index, (k_max, v_max) in enumerate(maxima):
        prefix = f"model.layers.{index}.self_attn"
        assert tensors.pop(f"{prefix}.k_scale").tolist() == [f32(k_max / 448)]
        assert tensors.pop(f"{prefix}.v_scale").tolist() == [f32(v_max / 448)]
    assert tensors.keys() == originals.keys() and all(torch.equal(tensors[n], originals[n]) for n in tensors)
    config = json.loads((kv_dir / "config.json").read_text())["quantization_config"]
    assert config["config_groups"] == {} and config["kv_cache_scheme"] == KV_CACHE_SCHEME
    parsed = EngineConfig(model=str(kv_dir)).quant_config
    assert isinstance(parsed, CompressedTensorsConfig) and parsed.kv_cache_scales and parsed.groups == ()


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_a_checkpoints_scales_load_into_their_layers(kv_dir, rank):
    """Per tensor: every tensor-parallel rank takes them whole (its KV heads' share of the cache, the same scale)."""
    model = load(kv_dir) if rank is None else load(kv_dir, TensorParallel(rank, 2))
    tensors = load_file(kv_dir / "model.safetensors")
    assert model.checkpoint_kv_scales
    for index, scales in enumerate(model.kv_scales()):
        prefix = f"model.layers.{index}.self_attn"
        assert (scales.k, scales.v) == (tensors[f"{prefix}.k_scale"].item(), tensors[f"{prefix}.v_scale"].item())


def renamed(src, dst, rename):
    """A copy of ``src`` with its KV scale tensors renamed (None: dropped) by ``rename(name) -> name | None``."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        new = rename(name) if name.endswith(("k_scale", "v_scale")) else name
        if new is not None:
            tensors[new] = tensor
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_autofp8_names_and_one_scale_for_both_load_too(tmp_path, kv_dir):
    """AutoFP8's k_proj.output_scale / v_proj.output_scale; an older single kv_scale, which sets both (vLLM)."""
    expected = [(s.k, s.v) for s in load(kv_dir).kv_scales()]
    autofp8 = renamed(
        kv_dir,
        tmp_path / "autofp8",
        lambda n: n.replace(".k_scale", ".k_proj.output_scale").replace(".v_scale", ".v_proj.output_scale"),
    )
    assert [(s.k, s.v) for s in load(autofp8).kv_scales()] == expected
    single = renamed(kv_dir, tmp_path / "single", lambda n: n.replace(".k_scale", ".kv_scale") if "k_s" in n else None)
    assert [(s.k, s.v) for s in load(single).kv_scales()] == [(k, k) for k, _ in expected]


@pytest.mark.parametrize(
    "rename, message",
    [
        (
            lambda n: None if n == "model.layers.1.self_attn.v_scale" else n,
            "the checkpoint has KV cache scales for some layers but not v_scale for model.layers.1.self_attn (every "
            "layer needs both, or no layer any)",
        ),
        (
            lambda n: n if n.startswith("model.layers.0.") else None,
            "the checkpoint has KV cache scales for some layers but not k_scale and v_scale for "
            "model.layers.1.self_attn (every layer needs both, or no layer any)",
        ),
    ],
)
def test_scales_for_some_layers_only_are_an_error(tmp_path, kv_dir, rename, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        load(renamed(kv_dir, tmp_path / "partial", rename))


@pytest.mark.parametrize(
    "k_scale, message",
    [
        (
            torch.ones(2),
            "checkpoint tensor 'model.layers.0.self_attn.k_scale' holds (2,) values: KV cache scales are supported "
            "per tensor only (one value)",
        ),
        (
            torch.zeros(1),
            "checkpoint KV cache scales of model.layers.0.self_attn: a KV cache scale must be positive and finite, "
            "got 0.0",
        ),
    ],
)
def test_a_scale_that_is_not_one_positive_value_is_an_error(tmp_path, kv_dir, k_scale, message):
    path = renamed(kv_dir, tmp_path / "bad", lambda n: n)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = k_scale
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        load(path)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_only_an_fp8_cache_keeps_the_checkpoints_scales(kv_dir, kv_cache_dtype):
    """As vLLM: a cache of the model's dtype stores K/V as they are, so the worker sets the scales back to 1.0."""
    config = EngineConfig(model=str(kv_dir), dtype="float32", device="cpu", kv_cache_dtype=kv_cache_dtype)
    scales = Worker(config, None).model.kv_scales()
    expected = [(s.k, s.v) for s in load(kv_dir).kv_scales()] if kv_cache_dtype == "fp8" else [(1.0, 1.0)] * 2
    assert [(s.k, s.v) for s in scales] == expected


def test_calculated_scales_are_the_first_steps_maxima_as_transformers_computes_them(kv_dir, tiny_float_dir):
    """--calculate-kv-scales: the first step's (one prompt's prefill) max |rotated key| / 200 and max |value| / 100
    per layer, read in transformers' own attention over the same tokens; in place of the checkpoint's, once. The
    torch backend's whole prompt attends over its exact K/V, as transformers' does (the CPU kernels read the fp8
    cache, so the layers after the first see rounded attention: their maxima differ by about 0.5 %)."""
    ids = AutoTokenizer.from_pretrained(tiny_float_dir)(TEXT).input_ids
    config = EngineConfig(
        model=str(kv_dir),
        dtype="float32",
        device="cpu",
        kv_cache_dtype="fp8",
        calculate_kv_scales=True,
        attention_backend="torch",
        num_gpu_blocks_override=16,
        max_model_len=128,
    )
    core = EngineCore(config, None)
    try:
        model = core.executor.worker.model
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        core.add(EngineCoreRequest("a", ids, params, 4))
        core.step()
        calculated = [(s.k, s.v) for s in model.kv_scales()]
        expected = [(k / 200, v / 100) for k, v in kv_maxima(tiny_float_dir, TEXT)]
        torch.testing.assert_close(torch.tensor(calculated), torch.tensor(expected), rtol=1e-5, atol=0)
        core.add(EngineCoreRequest("b", ids[:5], params, 4))
        while core.has_unfinished_requests():
            core.step()
        assert [(s.k, s.v) for s in model.kv_scales()] == calculated
    finally:
        core.shutdown()


@pytest.mark.parametrize("scheme", ["w8a8-fp8", "fp8"])
def test_scales_beside_quantized_weights(tmp_path, tiny_float_dir, kv_dir, scheme):
    """--kv-cache-scales with a weight scheme: compressed-tensors declares them in its kv_cache_scheme, an fp8
    checkpoint (vLLM's Fp8Config) just holds them; both load them."""
    path = quantize_checkpoint(tiny_float_dir, tmp_path / scheme, scheme, kv_cache_scales=True)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config.get("kv_cache_scheme") == (KV_CACHE_SCHEME if scheme == "w8a8-fp8" else None)
    expected = [(s.k, s.v) for s in load(kv_dir).kv_scales()]
    assert [(s.k, s.v) for s in load(path).kv_scales()] == expected


def test_the_quantizer_puts_scales_only_where_vllm_reads_them(tmp_path, tiny_float_dir):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "KV cache scales go with fp8 and compressed-tensors checkpoints (fp8, fp8-block, w8a8-int8, w8a8-fp8, "
            "w8a8-fp8-block, w4a16, kv-fp8), not gptq"
        ),
    ):
        quantize_checkpoint(tiny_float_dir, tmp_path / "gptq", "gptq", kv_cache_scales=True)
