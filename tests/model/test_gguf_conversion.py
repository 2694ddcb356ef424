"""GGUF files (llama.cpp's format), served as vLLM serves them: one pass over the file gives transformers' own GGUF
loading's weights, bit for bit, and its config, for each architecture (llama, qwen2 with q/k/v biases, qwen3 with q/k
norms); the engine's greedy tokens then equal transformers' on the GGUF; the converted folder is cached by the file's
identity; what the conversion could not carry is refused by name."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants
from huggingface_hub import constants as hf_constants
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from raypaged import LLM, SamplingParams
from raypaged.attention import cpu_ops
from raypaged.config import EngineConfig
from raypaged.model import gguf_checkpoint
from raypaged.model.gguf_checkpoint import TOKENIZER_ERROR, read_gguf
from raypaged.model.hub import resolve_gguf_hub_file
from raypaged.model.synthetic import write_synthetic_model
from tests.conftest import hf_greedy

# the mixtures of experts: experts, each one's width and the shared expert's (transformers reads neither width from a
# GGUF file: its config's defaults, which the files here match)
EXPERTS = {"qwen2moe": (4, 1408, 5632), "qwen3moe": (4, 768, 0)}
SHAPE = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=256)
Q4_1, Q8_0, F32 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32
# Gemma 3's layers: five sliding ones, then a global one; Gemma's sliding window, shorter than the prompts here
GEMMA3_LAYERS, GEMMA_WINDOW = 6, 8


def write_gguf(
    path: Path,
    tied: bool,
    architecture: str = "llama",
    extra: str | None = None,
    metadata: dict[str, object] | None = None,
    tokenizer: bool = False,
    vocab_size: bool = True,
    rope_theta: float = 10000.0,
    rope_factors: np.ndarray | None = None,
    layers: int | None = None,
    longrope: tuple[np.ndarray, np.ndarray] | None = None,
    end_of_turn: int | None = None,
) -> Path:
    """A random llama.cpp-layout model of ``architecture``: Q4_1 and Q8_0 matrices, F32 norms (and an F32 head unless
    ``tied``; an F32 tensor named ``extra`` too, if given); qwen2's q/k/v with F32 biases, qwen3's q/k norms (its
    head_dim, key_length, 128 as transformers assumes, instead of 16). ``metadata``: more keys, after
    ``<architecture>.``; ``tokenizer``: a byte-level BPE of 255 bytes and ``<|endoftext|>``, as llama.cpp writes
    GPT-2-style tokenizers (else the file has none); ``rope_factors``: a ``rope_freqs`` tensor of them, as llama.cpp
    writes Llama 3's rope scaling; ``vocab_size`` False: no vocab_size key, as llama.cpp often writes none;
    ``layers``: other than SHAPE's (Gemma 3's six by default); ``longrope``: Phi-3's long and short factors, as
    ``rope_factors_long`` and ``rope_factors_short`` tensors."""
    rng = np.random.default_rng(0)
    hidden, ffn = SHAPE["hidden"], SHAPE["ffn"]
    # transformers reads no key_length for qwen3 and no query_pre_attn_scalar for Gemma (its default 256, every
    # Gemma's head_dim but the 27B models')
    head_dim = {"qwen3": 128, "gemma2": 256, "gemma3": 256}.get(architecture, hidden // SHAPE["heads"])
    q_rows, kv_rows = SHAPE["heads"] * head_dim, SHAPE["kv_heads"] * head_dim
    layers = layers or (GEMMA3_LAYERS if architecture == "gemma3" else SHAPE["layers"])
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("tiny model")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    if architecture in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    if architecture in EXPERTS:
        experts, expert_ffn, shared_ffn = EXPERTS[architecture]
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(expert_ffn)
        if shared_ffn:
            writer.add_expert_shared_feed_forward_length(shared_ffn)
    if architecture in ("gemma2", "gemma3"):  # as llama.cpp writes Gemma's: a window and (Gemma 2) soft-capping
        writer.add_sliding_window(GEMMA_WINDOW)
        if architecture == "gemma2":
            writer.add_attn_logit_softcapping(50.0)
            writer.add_final_logit_softcapping(30.0)
    if vocab_size:
        writer.add_vocab_size(SHAPE["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if end_of_turn is not None:
        writer.add_eot_token_id(end_of_turn)
    if architecture == "phi3":  # as Phi-3's files have (Phi3Config's default, 32000, is past the tiny vocabulary)
        writer.add_pad_token_id(0)
    if tokenizer:
        byte_tokens = bytes_to_unicode()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([byte_tokens[i] for i in range(SHAPE["vocab"] - 1)] + ["<|endoftext|>"])
        writer.add_token_types([1] * (SHAPE["vocab"] - 1) + [3])  # the last a control token, as GPT-2's
        writer.add_token_scores([0.0] * SHAPE["vocab"])
        writer.add_token_merges([])
    for key, value in (metadata or {}).items():
        writer.add_key_value(f"{architecture}.{key}", value, GGUFValueType.get_type(value))

    # Gemma's matrices smaller: its embeddings are scaled by sqrt(hidden) and its norms by 1 + weight, and
    # standard normal weights would put all of every next token's probability on one token
    std = 0.1 if architecture in ("gemma2", "gemma3") else 1.0

    def add(name: str, rows: int, cols: int, kind: GGMLQuantizationType) -> None:
        values = (std * rng.standard_normal((rows, cols))).astype(np.float32) if cols else rng.random(rows, np.float32)
        if kind == F32:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", SHAPE["vocab"], hidden, Q8_0)
    for layer in range(layers):
        prefix = f"blk.{layer}"
        add(f"{prefix}.attn_norm.weight", hidden, 0, F32)
        if architecture == "phi3":  # q, k and v in one tensor, gate and up in another, as Phi-3's checkpoints
            add(f"{prefix}.attn_qkv.weight", q_rows + 2 * kv_rows, hidden, Q4_1)
            add(f"{prefix}.attn_output.weight", hidden, q_rows, Q4_1)
            add(f"{prefix}.ffn_norm.weight", hidden, 0, F32)
            add(f"{prefix}.ffn_up.weight", 2 * ffn, hidden, Q4_1)
            add(f"{prefix}.ffn_down.weight", hidden, ffn, Q8_0)
            continue
        add(f"{prefix}.attn_q.weight", q_rows, hidden, Q4_1)
        add(f"{prefix}.attn_k.weight", kv_rows, hidden, Q4_1)
        add(f"{prefix}.attn_v.weight", kv_rows, hidden, Q8_0)
        if architecture in ("qwen2", "qwen2moe"):
            for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                add(f"{prefix}.attn_{part}.bias", rows, 0, F32)
        if architecture in ("qwen3", "qwen3moe", "gemma3"):
            add(f"{prefix}.attn_q_norm.weight", head_dim, 0, F32)
            add(f"{prefix}.attn_k_norm.weight", head_dim, 0, F32)
        add(f"{prefix}.attn_output.weight", hidden, q_rows, Q4_1)
        if architecture in ("gemma2", "gemma3"):
            add(f"{prefix}.post_attention_norm.weight", hidden, 0, F32)
            add(f"{prefix}.post_ffw_norm.weight", hidden, 0, F32)
        add(f"{prefix}.ffn_norm.weight", hidden, 0, F32)
        if architecture not in EXPERTS:
            add(f"{prefix}.ffn_gate.weight", ffn, hidden, Q4_1)
            add(f"{prefix}.ffn_up.weight", ffn, hidden, Q4_1)
            add(f"{prefix}.ffn_down.weight", hidden, ffn, Q8_0)
            continue
        experts, expert_ffn, shared_ffn = EXPERTS[architecture]
        add(f"{prefix}.ffn_gate_inp.weight", experts, hidden, F32)
        for part, shape in (
            ("gate", (expert_ffn, hidden)),
            ("up", (expert_ffn, hidden)),
            ("down", (hidden, expert_ffn)),
        ):
            values = rng.standard_normal((experts, *shape)).astype(np.float32)
            writer.add_tensor(f"{prefix}.ffn_{part}_exps.weight", quants.quantize(values, Q8_0), raw_dtype=Q8_0)
        if shared_ffn:
            add(f"{prefix}.ffn_gate_inp_shexp.weight", hidden, 0, F32)
            add(f"{prefix}.ffn_gate_shexp.weight", shared_ffn, hidden, Q8_0)
            add(f"{prefix}.ffn_up_shexp.weight", shared_ffn, hidden, Q8_0)
            add(f"{prefix}.ffn_down_shexp.weight", hidden, shared_ffn, Q8_0)
    add("output_norm.weight", hidden, 0, F32)
    if not tied:
        add("output.weight", SHAPE["vocab"], hidden, F32)
    if extra is not None:
        add(extra, hidden, 0, F32)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    if longrope is not None:
        writer.add_tensor("rope_factors_long.weight", longrope[0].astype(np.float32))
        writer.add_tensor("rope_factors_short.weight", longrope[1].astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


ARCHITECTURES = [
    ("llama", True),
    ("llama", False),
    ("qwen2", False),
    ("qwen3", True),
    ("qwen2moe", False),
    ("qwen3moe", True),
    ("phi3", False),
    ("gemma2", True),
    ("gemma3", True),
]
IDS = ["llama-tied", "llama", "qwen2", "qwen3-tied", "qwen2moe", "qwen3moe-tied", "phi3", "gemma2-tied", "gemma3-tied"]


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts (``experts.gate_up_proj`` [experts, 2 x width, hidden], gate first, and
    ``experts.down_proj``) as each expert's tensors, by the names checkpoints give them."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name.removesuffix("gate_up_proj")
            for expert, (gate, up) in enumerate(rows.chunk(2, dim=0) for rows in tensor):
                out[f"{stem}{expert}.gate_proj.weight"], out[f"{stem}{expert}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            stem = name.removesuffix("down_proj")
            out.update({f"{stem}{expert}.down_proj.weight": rows for expert, rows in enumerate(tensor)})
        else:
            out[name] = tensor
    return out


@pytest.mark.parametrize(("architecture", "tied"), ARCHITECTURES, ids=IDS)
def test_weights_and_config_equal_transformers_gguf_loading(tmp_path, architecture, tied):
    path = write_gguf(tmp_path / "tiny.gguf", tied, architecture)
    gguf_architecture, keywords, tensors = read_gguf(path)
    weights = dict(tensors)
    assert gguf_architecture == architecture
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = per_expert(reference.state_dict())
    if tied:
        expected.pop("lm_head.weight")
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], tensor), name
    expected_config = reference.config.to_dict()
    del expected_config["quantization_config"]  # how transformers loaded it, not the model
    expected_config.update(_name_or_path="", architectures=None)  # where it came from
    model_type = gguf_checkpoint.ARCHITECTURES[architecture][0]
    assert AutoConfig.for_model(model_type, **keywords, dtype="float32").to_dict() == expected_config


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer of the tiny models' 256 tokens (their GGUF files hold none, as a file may not)."""
    return write_synthetic_model(tmp_path_factory.mktemp("tokenizer"), vocab_size=SHAPE["vocab"], hidden_size=64)


@pytest.mark.parametrize(("architecture", "tied"), ARCHITECTURES, ids=IDS)
def test_a_gguf_file_serves_transformers_greedy_tokens(tmp_path, monkeypatch, tokenizer_dir, architecture, tied):
    """``LLM(model="x.gguf", tokenizer=...)`` as vLLM's: converted once into the cache, the engine's greedy tokens
    those of transformers' model loaded from the same file."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tied, architecture)
    prompts = [[5, 9, 30, 31, 100], [7] * 9, list(range(40, 61))]
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected = [hf_greedy(reference, p, 8) for p in prompts]
    llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), dtype="float32", num_gpu_blocks_override=32, block_size=4)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
    (folder,) = (tmp_path / "cache" / "models" / "gguf").iterdir()
    assert folder.name.startswith("tiny-") and (folder / TOKENIZER_ERROR).is_file()  # the file has no tokenizer


def test_a_gguf_files_own_tokenizer_serves_text(tmp_path, monkeypatch):
    """Where transformers reads the file's tokenizer, the folder has it: text in and out, no --tokenizer."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tied=True, tokenizer=True)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    llm = LLM(model=str(path), dtype="float32", num_gpu_blocks_override=32, block_size=4)
    try:
        (output,) = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        llm.shutdown()
    assert output.prompt_token_ids == list(b"hello world")
    assert output.outputs[0].token_ids == hf_greedy(reference, list(b"hello world"), 6)
    assert output.outputs[0].text == bytes(output.outputs[0].token_ids).decode("utf-8", errors="replace")


def test_a_large_file_converts_into_shards_hugging_face_reads(tmp_path, monkeypatch, tokenizer_dir):
    """A conversion holds at most one file's worth of weights (SHARD_BYTES, 2 GiB: a 7B model never wholly in
    memory): shards named and indexed as Hugging Face's, which transformers loads as the GGUF's model."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_checkpoint, "SHARD_BYTES", 100_000)
    path = write_gguf(tmp_path / "tiny.gguf", tied=False)
    folder = EngineConfig(model=str(path), tokenizer=str(tokenizer_dir), device="cpu").model_path
    files = sorted(file.name for file in folder.glob("*.safetensors"))
    assert len(files) > 2 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert max((folder / file).stat().st_size for file in files) < 100_000 + 4 * SHAPE["vocab"] * SHAPE["hidden"] + 4096
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    assert sorted(converted) == sorted(reference)
    assert all(torch.equal(converted[name], tensor) for name, tensor in reference.items())


def test_dtype_auto_serves_a_gguf_file_in_bf16(tmp_path, monkeypatch, tokenizer_dir):
    """The folder's weights are fp32 (transformers' exactly) and its config's dtype bfloat16: ``--dtype auto`` runs
    the bf16 model (on a CPU, its linears packed in bf16 over a bf16 cache: half fp32's memory)."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tied=True)
    llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), num_gpu_blocks_override=32, block_size=4)
    try:
        worker = llm.llm_engine.executor.worker
        assert llm.llm_engine.config.resolved_dtype == "bfloat16" and worker.cache_dtype == torch.bfloat16
        assert worker.bf16_linears == (cpu_ops.unavailable_reason() is None)
        (output,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(output.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    (folder,) = (tmp_path / "cache" / "models" / "gguf").iterdir()
    assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {torch.float32}


def test_the_folder_is_converted_once_and_anew_for_a_changed_file(tmp_path, monkeypatch, tokenizer_dir):
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tied=True)
    conversions = []
    convert = gguf_checkpoint.convert_gguf
    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", lambda *args: conversions.append(args[0]) or convert(*args))
    configs = [EngineConfig(model=str(path), tokenizer=str(tokenizer_dir), device="cpu") for _ in range(2)]
    assert configs[0].model_path == configs[1].model_path and conversions == [path.resolve()]
    assert configs[0].hf_config.architectures == ["LlamaForCausalLM"] and configs[0].resolved_dtype == "bfloat16"
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    changed = EngineConfig(model=str(path), load_format="gguf", tokenizer=str(tokenizer_dir), device="cpu")
    assert changed.model_path != configs[0].model_path and len(conversions) == 2


def test_a_gguf_without_a_tokenizer_transformers_reads_asks_for_one(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tied=True)
    with pytest.raises(
        ValueError,
        match=rf"^transformers cannot read the tokenizer of GGUF file '{re.escape(str(path))}' \(.+\): name the "
        r"original model's with --tokenizer \(a folder or a Hub id\)$",
    ):
        EngineConfig(model=str(path), device="cpu")


def test_the_load_format_gguf_needs_a_gguf_file_and_takes_no_hub_options(tmp_path, tokenizer_dir):
    for not_gguf in (tokenizer_dir, tokenizer_dir / "config.json"):
        with pytest.raises(
            ValueError, match=r"^--load-format gguf reads a local GGUF file, and model '.+' is not one$"
        ):
            EngineConfig(model=str(not_gguf), load_format="gguf", device="cpu")
    path = write_gguf(tmp_path / "tiny.gguf", tied=True)
    with pytest.raises(ValueError, match=r"^--revision v2 applies to Hugging Face Hub ids, but model '.+' is a GGUF"):
        EngineConfig(model=str(path), revision="v2", tokenizer=str(tokenizer_dir), device="cpu")


def test_load_format_gguf_reads_a_gguf_file_of_any_name(tmp_path, monkeypatch, tokenizer_dir):
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tied=True).rename(tmp_path / "weights.bin")
    config = EngineConfig(model=str(path), load_format="gguf", tokenizer=str(tokenizer_dir), device="cpu")
    assert config.model_path.parent == tmp_path / "cache" / "models" / "gguf"
    assert config.model_path.name.startswith("weights-") and config.hf_config.num_hidden_layers == SHAPE["layers"]


def test_quantization_gguf_is_refused_by_name(tmp_path, monkeypatch, tokenizer_dir):
    """vLLM runs a GGUF file's quantized weights with ``--quantization gguf``; raypaged serves them dequantized."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", tied=True)
    with pytest.raises(
        ValueError, match=r"^--quantization gguf is not supported: a GGUF file is served dequantized \(drop --quan"
    ):
        EngineConfig(model=str(path), quantization="gguf", tokenizer=str(tokenizer_dir), device="cpu")


def test_without_a_vocab_size_the_embeddings_rows_are_the_vocabulary(tmp_path):
    _, keywords, _ = read_gguf(write_gguf(tmp_path / "tiny.gguf", tied=True, vocab_size=False))
    assert keywords["vocab_size"] == SHAPE["vocab"]


def test_another_architecture_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tied=True, architecture="gemma")
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{path}: GGUF architecture 'gemma' is not supported here; llama, qwen2, qwen3, qwen2moe, qwen3moe, "
            "phi3, gemma2, gemma3 are"
        ),
    ):
        read_gguf(path)


def test_a_tensor_no_llama_has_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf", tied=True, extra="blk.0.attn_gate.weight")
    with pytest.raises(ValueError, match=re.escape(f"{path}: tensor 'blk.0.attn_gate.weight' is not one of a llama's")):
        read_gguf(path)


def llama_cpp_rope_factors(theta: float, head_dim: int, factor: float, low: float = 1.0) -> np.ndarray:
    """The ``rope_freqs`` llama.cpp's converter writes for a Llama 3 checkpoint (high_freq_factor 4, original length
    8,192): per rotary frequency, computed in float32 from them, what the frequency is divided by."""
    high, original = 4.0, 8192
    factors = []
    for frequency in 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)):
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return np.array(factors, dtype=np.float32)


def test_llama_3_rope_factors_become_its_rope_parameters_and_serve_its_tokens(tmp_path, monkeypatch, tokenizer_dir):
    """Llama 3.1's and later's GGUF files carry their rope scaling as ``rope_freqs``: the folder gets the llama3
    rope parameters that give those factors, so the engine rotates as transformers' model of the original
    checkpoint does (transformers' own GGUF loading drops the tensor and rotates unscaled)."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    head_dim = SHAPE["hidden"] // SHAPE["heads"]
    factors = llama_cpp_rope_factors(500000.0, head_dim, 32.0)
    assert sorted(set(factors.tolist())) != [1.0, 32.0]  # some features between: the smooth part
    path = write_gguf(tmp_path / "tiny.gguf", True, rope_theta=500000.0, rope_factors=factors)
    _, keywords, _ = read_gguf(path)
    assert keywords["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    unscaled = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    config = AutoConfig.for_model("llama", **keywords, dtype="float32")
    scaled = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    scaled.load_state_dict(unscaled.state_dict())
    prompt = list(range(30, 90))
    got = serves_as(scaled.eval(), path, tokenizer_dir, prompt, atol=2e-5, block_size=4)
    unscaled_logprobs = greedy_logprobs(unscaled, prompt, hf_greedy(scaled, prompt, 8))
    assert not torch.allclose(got, unscaled_logprobs, rtol=0, atol=2e-5)


def test_rope_factors_other_than_llama_3s_are_refused_by_name(tmp_path):
    factors = llama_cpp_rope_factors(500000.0, SHAPE["hidden"] // SHAPE["heads"], 32.0, low=2.0)
    path = write_gguf(tmp_path / "tiny.gguf", True, rope_theta=500000.0, rope_factors=factors)
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: tensor 'rope_freqs.weight' is not Llama 3's rope scaling (factor 32.0, ")
    ):
        read_gguf(path)


@pytest.mark.parametrize(
    ("key", "value", "what"),
    [
        ("rope.scaling.attn_factor", 1.5, "a rope attention factor"),
        ("expert_count", 8, "experts"),
        ("attention.sliding_window", 64, "a sliding window"),
        ("attention.sliding_window_pattern", 4, "a sliding window pattern"),
        ("attention.scale", 0.125, "a query scale"),
    ],
)
def test_metadata_the_folder_cannot_carry_is_refused_by_name(tmp_path, key, value, what):
    path = write_gguf(tmp_path / "tiny.gguf", tied=True, architecture="qwen2", metadata={key: value})
    with pytest.raises(
        ValueError,
        match=re.escape(f"{path}: qwen2.{key} = {value!r} ({what}) is not supported in GGUF files here: serve the"),
    ):
        read_gguf(path)


def greedy_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """``model``'s logprob of each of ``tokens`` after ``prompt`` and the tokens before it."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]


def serves_as(model, path: Path, tokenizer_dir: Path, prompt: list[int], atol: float = 1e-4, **options) -> torch.Tensor:
    """``LLM(model=path)``'s greedy tokens (fp32) are ``model``'s, transformers' model of the config the file
    stands for, and their logprobs within ``atol`` of its (1e-4: the tiny Phi-3's logits are large); those
    logprobs."""
    expected = hf_greedy(model, prompt, 8)
    llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), dtype="float32", num_gpu_blocks_override=64, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == expected
    got = torch.tensor([entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, expected)])
    assert torch.allclose(got, greedy_logprobs(model, prompt, expected), rtol=0, atol=atol)
    return got


def transformers_model(path: Path, model_type: str):
    """transformers' model of the config and weights ``read_gguf`` gives for ``path`` (for what transformers' own
    GGUF loading does not read: rope scaling, Phi-3's partial rotation)."""
    _, keywords, weights = read_gguf(path)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **keywords), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(weights), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


def test_phi3_longrope_and_partial_rotation_serve_the_original_models_tokens(tmp_path, monkeypatch, tokenizer_dir):
    """Phi-3.5's and Phi-4-mini's files: longrope's factors as two tensors, its original context and attention
    factor on the metadata, and (Phi-4-mini) a rotary width below the head's; the folder's config carries them as
    the original checkpoint's, so the engine rotates as transformers' model of that checkpoint does (the short
    factors within the original context)."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    rotated, original = 12, 32  # of 16 features; the context is 128
    long, short = np.linspace(1.0, 8.0, rotated // 2), np.linspace(1.0, 1.5, rotated // 2)
    attention = math.sqrt(1 + math.log(128 / original) / math.log(original))
    metadata = {"rope.dimension_count": rotated, "rope.scaling.original_context_length": original}
    metadata["rope.scaling.attn_factor"] = attention
    path = write_gguf(tmp_path / "tiny.gguf", False, "phi3", metadata=metadata, longrope=(long, short))
    _, keywords, _ = read_gguf(path)
    assert keywords["partial_rotary_factor"] == 0.75 and keywords["original_max_position_embeddings"] == original
    assert keywords["rope_scaling"] == {
        "rope_type": "longrope",
        "long_factor": long.astype(np.float32).tolist(),
        "short_factor": short.astype(np.float32).tolist(),
    }
    model = transformers_model(path, "phi3")
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.75
    serves_as(model, path, tokenizer_dir, list(range(40, 61)), max_model_len=original)
    metadata["rope.scaling.attn_factor"] = 1.5
    path = write_gguf(tmp_path / "other.gguf", False, "phi3", metadata=metadata, longrope=(long, short))
    with pytest.raises(
        ValueError,
        match=re.escape(f"{path}: phi3.rope.scaling.attn_factor = 1.5 is not longrope's {attention} for a context"),
    ):
        read_gguf(path)


@pytest.mark.parametrize(
    ("architecture", "metadata", "rope_scaling"),
    [
        ("gemma3", {"rope.scaling.type": "linear", "rope.scaling.factor": 8.0}, {"rope_type": "linear", "factor": 8.0}),
        (
            "qwen2",
            {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        ),
    ],
    ids=["gemma3-linear", "qwen2-yarn"],
)
def test_rope_scaling_on_the_metadata_serves_the_scaled_models_tokens(
    tmp_path, monkeypatch, tokenizer_dir, architecture, metadata, rope_scaling
):
    """Gemma 3's linear rope scaling (4B and larger: on its global layers) and Qwen's yarn: the metadata's become the
    config's rope parameters (transformers' own GGUF loading drops them), and the engine's tokens are those of
    transformers' scaled model."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", True, architecture, metadata=metadata)
    _, keywords, _ = read_gguf(path)
    assert keywords["rope_scaling"] == rope_scaling
    model_type = gguf_checkpoint.ARCHITECTURES[architecture][0]
    prompt = list(range(40, 61))
    got = serves_as(transformers_model(path, model_type), path, tokenizer_dir, prompt)
    unscaled = transformers_model(write_gguf(tmp_path / "unscaled.gguf", True, architecture), model_type)
    tokens = [int(token) for token in hf_greedy(transformers_model(path, model_type), prompt, 8)]
    assert not torch.allclose(got, greedy_logprobs(unscaled, prompt, tokens), rtol=0, atol=1e-3)  # the scaling shows


def test_other_rope_scaling_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "a.gguf", True, "qwen2", metadata={"rope.scaling.type": "su"})
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: qwen2.rope.scaling.type = 'su' is not supported in GGUF files here")
    ):
        read_gguf(path)
    metadata = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.yarn_log_multiplier": 0.1}
    path = write_gguf(tmp_path / "b.gguf", True, "qwen2", metadata=metadata)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{path}: qwen2.rope.scaling.yarn_log_multiplier (yarn rope scaling options) are not supported here"
        ),
    ):
        read_gguf(path)


@pytest.mark.parametrize(("architecture", "layers"), [("gemma2", 46), ("gemma3", 62), ("gemma2", 3)])
def test_gemmas_query_scale_is_its_head_width_but_the_27b_models(tmp_path, architecture, layers):
    """As llama.cpp scales Gemma's queries (and their checkpoints' query_pre_attn_scalar say): by head_dim, but by
    hidden / heads in the 27B models (Gemma 2's 46 layers, Gemma 3's 62)."""
    _, keywords, _ = read_gguf(write_gguf(tmp_path / "tiny.gguf", True, architecture, layers=layers))
    assert keywords["head_dim"] == 256
    assert keywords["query_pre_attn_scalar"] == (256 if layers == 3 else SHAPE["hidden"] // SHAPE["heads"])


def test_phi3s_sliding_window_is_the_configs(tmp_path):
    """Phi-3-mini's window (llama.cpp writes it; transformers' GGUF loading drops it): raypaged keeps max_model_len
    within it, as for the original checkpoint's folder."""
    path = write_gguf(tmp_path / "tiny.gguf", False, "phi3", metadata={"attention.sliding_window": 47})
    assert read_gguf(path)[1]["sliding_window"] == 47
    assert EngineConfig(model=str(path), device="cpu", tokenizer=str(path.parent)).max_model_len == 47


def test_hf_config_path_gives_the_original_models_config(tmp_path, monkeypatch, tokenizer_dir):
    """vLLM's ``--hf-config-path``: the config of another folder (the original model's) in place of the one made from
    the file's metadata, here with a linear rope scaling the metadata lacks; the engine's tokens and logprobs are
    transformers' on that config, and differ from the file's own. A folder without a config is refused by name."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", True)
    _, keywords, weights = read_gguf(path)
    scaling = {"rope_type": "linear", "factor": 4.0}
    original = AutoConfig.for_model("llama", **keywords, rope_scaling=scaling, architectures=["LlamaForCausalLM"])
    original.save_pretrained(tmp_path / "original")
    model = AutoModelForCausalLM.from_config(original, dtype=torch.float32)
    model.load_state_dict(dict(weights), strict=False)
    prompt = list(range(40, 61))
    got = serves_as(model.eval(), path, tokenizer_dir, prompt, hf_config_path=str(tmp_path / "original"))
    own = transformers_model(path, "llama")
    tokens = hf_greedy(model, prompt, 8)
    assert not torch.allclose(got, greedy_logprobs(own, prompt, tokens), rtol=0, atol=1e-3)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(
        ValueError, match=re.escape(f"--hf-config-path '{empty}' is not a model folder (no config.json, nor Mistral's")
    ):
        EngineConfig(model=str(path), tokenizer=str(tokenizer_dir), device="cpu", hf_config_path=str(empty))


GGUF_REPO, GGUF_COMMIT = "tiny-org/tiny-GGUF", "c" * 40


@pytest.fixture
def gguf_hub(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache (offline) holding GGUF_REPO at main as huggingface_hub lays it out: the tiny llama in
    Q8_0, a vision projector of that type too, a Q4_K and a Q4_K_M, and a Q2_K in two parts; its snapshot folder."""
    cache = tmp_path / "hub"
    repo = cache / ("models--" + GGUF_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / GGUF_COMMIT
    snapshot.mkdir(parents=True)
    write_gguf(snapshot / "tiny-Q8_0.gguf", tied=True)
    for name in ("mmproj-tiny-Q8_0.gguf", "tiny-Q4_K.gguf", "tiny-Q4_K_M.gguf", "README.md"):
        shutil.copy(snapshot / "tiny-Q8_0.gguf", snapshot / name)
    for part in (1, 2):
        (snapshot / f"tiny-Q2_K-0000{part}-of-00002.gguf").write_bytes(b"GGUF")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(GGUF_COMMIT)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    return snapshot


def test_a_hub_id_and_quantization_type_serve_that_gguf_file(gguf_hub, tokenizer_dir):
    """vLLM's ``org/name:QUANT``: the repository's one GGUF file of that type (any case; never a vision projector
    of it), served as that file is."""
    prompt = [5, 9, 30, 31, 100]
    reference = AutoModelForCausalLM.from_pretrained(gguf_hub, gguf_file="tiny-Q8_0.gguf", dtype=torch.float32)
    llm = LLM(model=f"{GGUF_REPO}:q8_0", tokenizer=str(tokenizer_dir), dtype="float32", num_gpu_blocks_override=32)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == hf_greedy(reference, prompt, 8)
    assert resolve_gguf_hub_file(f"{GGUF_REPO}:Q4_K", None, None, None) == gguf_hub / "tiny-Q4_K.gguf"  # not Q4_K_M


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        (
            "Q5_K_M",
            "tiny-org/tiny-GGUF has no GGUF file of type Q5_K_M (its GGUF files: mmproj-tiny-Q8_0.gguf, "
            "tiny-Q2_K-00001-of-00002.gguf, "
            "tiny-Q2_K-00002-of-00002.gguf, tiny-Q4_K.gguf, tiny-Q4_K_M.gguf, tiny-Q8_0.gguf)",
        ),
        (
            "Q2_K",
            "tiny-Q2_K-00001-of-00002.gguf, tiny-Q2_K-00002-of-00002.gguf in tiny-org/tiny-GGUF are Q2_K, split into "
            "parts: merge them with llama.cpp's llama-gguf-split --merge and serve the merged file",
        ),
    ],
)
def test_a_quantization_type_the_repository_has_no_one_file_of_is_refused_naming_its_files(gguf_hub, quant, message):
    with pytest.raises(ValueError, match=re.escape(f"model '{GGUF_REPO}:{quant}': {message}")):
        EngineConfig(model=f"{GGUF_REPO}:{quant}", device="cpu")


def test_the_end_of_a_turn_ends_a_generation_as_in_llama_cpp(tmp_path, monkeypatch, tokenizer_dir):
    """A chat model's file names its end of turn (and of message) beside its end of text, and llama.cpp stops on
    each: so does the converted folder's generation config (transformers' GGUF loading keeps the end of text
    alone). Here the end of turn is the token the model gives first: the generation stops there."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    prompt = [5, 9, 30, 31, 100]
    path = write_gguf(tmp_path / "plain.gguf", True)
    first = hf_greedy(AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name), prompt, 1)[0]
    path = write_gguf(tmp_path / "chat.gguf", True, end_of_turn=first)
    assert gguf_checkpoint.end_of_generation_ids(path) == [2, first]
    llm = LLM(model=str(path), tokenizer=str(tokenizer_dir), dtype="float32", num_gpu_blocks_override=32)
    try:
        params = SamplingParams(temperature=0, max_tokens=8)
        (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == [first] and output.outputs[0].finish_reason == "stop"
    folder = EngineConfig(model=str(path), tokenizer=str(tokenizer_dir), device="cpu").model_path
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [2, first]


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ([True, False, True, True, False, True], "SFSSFS"),  # a flag per layer (true: sliding)
        (3, "SSFSSF"),  # every third layer global
    ],
)
def test_a_gemma_files_sliding_window_pattern_gives_its_layers_windows(
    tmp_path, monkeypatch, tokenizer_dir, pattern, expected
):
    """Newer llama.cpp files carry which layers slide (``sliding_window_pattern``): the config's ``layer_types``
    follow it, and the engine's tokens are those of transformers' model of that config."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf", True, "gemma3", metadata={"attention.sliding_window_pattern": pattern})
    _, keywords, _ = read_gguf(path)
    names = {"S": "sliding_attention", "F": "full_attention"}
    assert keywords["layer_types"] == [names[letter] for letter in expected]
    serves_as(transformers_model(path, "gemma3_text"), path, tokenizer_dir, list(range(40, 61)))
