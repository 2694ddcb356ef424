"""Random-weight gpt-oss models: attention sinks, sliding-window attention on alternate layers, biases on q/k/v/o,
experts with biases and clamped SwiGLU behind a router with a bias. Greedy tokens equal transformers' ``generate``
and every sampled token's logprob its logits, whole prompts and in chunks after prefix-cache hits, and on two
shards; an MXFP4 checkpoint (the published format of its experts) dequantizes at load bit for bit as transformers'
``convert_moe_packed_tensors`` and serves as its dequantized float model does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from raypaged import LLM
from raypaged.quantization import mxfp4
from tests.model.conftest import (
    MOE_TINY as TINY,
)
from tests.model.conftest import (
    Reference,
    assert_matches_transformers,
    tiny_models_with_word_tokenizer,
    transformers_references,
)

GPT_OSS = {
    "num_hidden_layers": 2,
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """The float model, its MXFP4 checkpoint, and the float model of the MXFP4 weights (transformers' reference)."""
    root = tmp_path_factory.mktemp("gpt_oss")
    (path,) = tiny_models_with_word_tokenizer(root, smollm2_dir, {"gpt_oss": ("gpt_oss", GPT_OSS)}, TINY).values()
    return {"float": path, **mxfp4_checkpoint(path, root)}


def mxfp4_checkpoint(path: Path, root: Path) -> dict[str, Path]:
    """``path``'s experts' weights as MXFP4 (the published gpt-oss layout: ``[E, out, in/32, 16]`` blocks and
    ``[E, out, in/32]`` scales, ``quantization_config`` mxfp4) at ``root / "mxfp4"``, and at ``root / "dequantized"``
    the float model of what those blocks code (transformers' ``convert_moe_packed_tensors``)."""
    tensors = load_file(path / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(tensor.transpose(1, 2))  # [E, out, in] rows of the input's blocks
            blocks = blocks.unflatten(-1, (-1, 16)) if blocks.dim() == 3 else blocks
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantized[name] = dequantized[name] = tensor
    out = {}
    for kind, weights in (("mxfp4", quantized), ("dequantized", dequantized)):
        folder = root / kind
        shutil.copytree(path, folder)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        out[kind] = folder
    config = json.loads((out["mxfp4"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out["mxfp4"] / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def references(dirs) -> dict[str, Reference]:
    return transformers_references({"float": dirs["float"], "dequantized": dirs["dequantized"]})


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_matches_transformers(dirs, references, backend):
    """The torch attention ops, and the CPU decode kernel with the sinks and the window."""
    assert_matches_transformers(dirs["float"], references["float"], attention_backend=backend)


def test_chunked_prefill_and_prefix_cache_hits_match_transformers(dirs, references):
    """Chunks of at most 5 tokens over the sliding window of 8, then again from the cached blocks."""
    assert_matches_transformers(
        dirs["float"], references["float"], max_num_batched_tokens=5, max_num_seqs=4, enable_prefix_caching=True
    )


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_shards_match_transformers(ray_session, dirs, references, expert_parallel):
    """tp=2: each shard holds two of the four heads' sinks and half of every expert, whose down bias the first shard
    alone adds (once, before the all-reduce); with expert parallelism two whole experts each, with their biases."""
    assert_matches_transformers(
        dirs["float"], references["float"], tensor_parallel_size=2, enable_expert_parallel=expert_parallel
    )


def test_an_mxfp4_checkpoint_dequantizes_as_transformers(dirs, references):
    tensors = load_file(dirs["mxfp4"] / "model.safetensors")
    for projection in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{projection}"
        blocks, scales = tensors[f"{name}_blocks"], tensors[f"{name}_scales"]
        ours = mxfp4.dequantize(blocks, scales, torch.bfloat16)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out]
        assert torch.equal(ours.transpose(1, 2), theirs)
    assert_matches_transformers(dirs["mxfp4"], references["dequantized"], quantization="mxfp4")
    with pytest.raises(ValueError, match=r"^--quantization fp8 contradicts the checkpoint's quantization_config"):
        LLM(model=str(dirs["mxfp4"]), quantization="fp8", device="cpu")
    with pytest.raises(ValueError, match=r"^mxfp4 is read from gpt-oss checkpoints only"):
        LLM(model=str(dirs["float"]), quantization="mxfp4", device="cpu")


def test_grouped_gemms_over_stacked_experts_equal_each_experts_own(dirs):
    """``stack_experts`` stacks gpt-oss's experts and their biases; the two grouped GEMMs (what an H100/H200 runs in
    bf16) add each row's expert's biases and run the clamped SwiGLU, as the expert-by-expert loop does."""
    from transformers import AutoConfig

    from raypaged.model.llama import LlamaForCausalLM
    from raypaged.model.loader import iter_checkpoint
    from raypaged.model.moe import SparseMoeBlock

    loaded = LlamaForCausalLM(AutoConfig.from_pretrained(dirs["float"]), 64)
    loaded.load_weights(iter_checkpoint(dirs["float"]))
    blocks = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        loops = [block(x) for block in blocks]
    assert loaded.stack_experts() == [True] * len(blocks)
    for block, loop in zip(blocks, loops, strict=True):
        assert block.stacked_biases is not None
        assert block.experts[1].down_proj.bias.data_ptr() == block.stacked_biases[1][1].data_ptr()
        with torch.inference_mode():
            torch.testing.assert_close(block(x), loop, rtol=1e-5, atol=1e-5)
