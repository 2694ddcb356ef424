"""Random-weight Mixtral, Qwen2-MoE (a gated shared expert, a dense layer among the sparse ones), Qwen3-MoE (q/k
norms, unnormalized top-k weights) and GLM-4.5 (a sigmoid router with a score bias and expert groups, an ungated
shared expert) models: greedy tokens equal transformers' ``generate`` and every prompt and sampled
token's logprob its logits, whole prompts, in chunks after a prefix-cache hit, on the CPU attention backend's fused
step and on two shards; the expert tensors load exactly where they belong; what raypaged does not run for them is
refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from raypaged.model.architecture import MoeSpec, architecture_of
from raypaged.model.layers import PackedWeight
from raypaged.model.llama import LlamaForCausalLM, check_tensor_parallel
from raypaged.model.loader import iter_checkpoint, load_model
from raypaged.model.moe import SparseMoeBlock
from raypaged.model.parallel import TensorParallel
from raypaged.quantization import quantizer
from raypaged.quantization.linear import QuantLinear
from tests.conftest import hf_greedy, use_kernels_without_avx512
from tests.entrypoints.test_bf16_cpu_smollm2 import write_bf16_checkpoint
from tests.model.conftest import (
    LOGPROB_PROMPTS,
    LOGPROB_TOKENS,
    Reference,
    assert_matches_transformers,
    tiny_models_with_word_tokenizer,
    transformers_references,
)
from tests.model.conftest import (
    MOE_TINY as TINY,
)
from tests.quantization.conftest import load as load_quantized

MODELS = {
    "mixtral": ("mixtral", {"num_hidden_layers": 2, "intermediate_size": 48, "num_local_experts": 6}),
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_hidden_layers": 3,
            "intermediate_size": 80,  # the dense layer's
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_hidden_layers": 2,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "head_dim": 16,
        },
    ),
    # sigmoid router with a score bias, 2 of 4 groups, scaled weights; an ungated shared expert; dense layer 0;
    # q/k norms; half of each head rotated
    "glm4_moe": (
        "glm4_moe",
        {
            "num_hidden_layers": 3,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "use_qk_norm": True,
            "attention_bias": True,
            "head_dim": 16,
            "partial_rotary_factor": 0.5,
        },
    ),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Each model with a word-level tokenizer of its 512 tokens."""
    return tiny_models_with_word_tokenizer(tmp_path_factory.mktemp("moe"), smollm2_dir, MODELS, TINY)


@pytest.fixture(scope="module")
def references(model_dirs) -> dict[str, Reference]:
    """Each model's references from transformers."""
    return transformers_references(model_dirs)


def assert_matches(model: str, model_dirs, references, **llm_options) -> None:
    assert_matches_transformers(model_dirs[model], references[model], **llm_options)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_matches_transformers(model, model_dirs, references):
    assert_matches(model, model_dirs, references, attention_backend="torch")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_chunked_prefill_and_prefix_cache_hits_on_the_cpu_backend_match_transformers(model, model_dirs, references):
    """Prompts in chunks of at most 5 tokens, then again from their cached blocks, with the CPU backend's kernels
    and fused norms around the experts (its one-call C step does not run experts: the layers do)."""
    assert_matches(
        model,
        model_dirs,
        references,
        attention_backend="cpu",
        max_num_batched_tokens=5,
        max_num_seqs=4,
        enable_prefix_caching=True,
    )


@pytest.mark.parametrize("model", ["qwen2_moe", "glm4_moe"])
def test_two_shards_match_transformers(ray_session, model, model_dirs, references):
    """tp=2: each shard holds half of every expert's and the shared expert's intermediate features; the router
    (GLM-4.5's with its score bias) and the shared expert's gate are whole on each, and one all-reduce sums the
    layer."""
    assert_matches(model, model_dirs, references, tensor_parallel_size=2)


@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_expert_parallel_shards_match_transformers(ray_session, model, model_dirs, references):
    """--enable-expert-parallel at tp=2: each shard holds half of the experts whole (Qwen2-MoE's shared expert and
    dense layer still split by features) and sums only its experts' products before the layer's all-reduce."""
    assert_matches(model, model_dirs, references, tensor_parallel_size=2, enable_expert_parallel=True)


def test_expert_parallel_places_whole_experts_and_refuses_an_uneven_split(model_dirs):
    config = AutoConfig.from_pretrained(model_dirs["mixtral"])
    shards = [
        load_model(
            model_dirs["mixtral"],
            config,
            64,
            torch.float32,
            torch.device("cpu"),
            TensorParallel(r, 2, expert_parallel=True),
        )
        for r in range(2)
    ]
    whole = load_model(model_dirs["mixtral"], config, 64, torch.float32, torch.device("cpu"), TensorParallel())
    for rank, shard in enumerate(shards):
        block = shard.model.layers[0].mlp
        assert (block.first_expert, len(block.experts)) == (3 * rank, 3)
        for local, expert in enumerate(block.experts):
            want = whole.model.layers[0].mlp.experts[3 * rank + local]
            assert torch.equal(expert.down_proj.weight.to_dense(), want.down_proj.weight.to_dense())
    config.intermediate_size = 51  # whole experts need not split their features
    check_tensor_parallel(config, 2, expert_parallel=True)
    with pytest.raises(ValueError, match=r"^the model's intermediate_size 51 is not divisible by tensor_parallel_size"):
        check_tensor_parallel(config, 2)
    with pytest.raises(
        ValueError, match=r"^--enable-expert-parallel: the model's 6 experts do not split evenly over t"
    ):
        check_tensor_parallel(config, 4, expert_parallel=True)


def test_the_specs_are_transformers_routing(model_dirs):
    specs = {
        name: architecture_of(EngineConfig(model=str(path), device="cpu").hf_config).moe
        for name, path in model_dirs.items()
    }
    assert specs == {
        "mixtral": MoeSpec(
            6, 2, 48, renormalize=True, fp32_weights=True, shared_intermediate_size=0, sparse_layers=(True, True)
        ),
        "qwen2_moe": MoeSpec(
            8,
            3,
            32,
            renormalize=True,
            fp32_weights=False,
            shared_intermediate_size=48,
            sparse_layers=(True, False, True),
        ),
        "qwen3_moe": MoeSpec(
            8, 2, 32, renormalize=False, fp32_weights=False, shared_intermediate_size=0, sparse_layers=(True, True)
        ),
        "glm4_moe": MoeSpec(
            8,
            3,
            32,
            renormalize=True,
            fp32_weights=True,
            shared_intermediate_size=32,
            sparse_layers=(False, True, True),
            scoring="sigmoid",
            num_groups=4,
            topk_groups=2,
            routed_scaling=2.5,
            shared_gated=False,
            fp32_router=True,
            score_correction_bias=True,
        ),
    }


def test_an_expert_tensor_loads_into_its_experts_rows(model_dirs):
    """Mixtral's ``block_sparse_moe.experts.3.w1`` (gate) and ``w3`` (up) fill expert 3's gate | up weight, ``w2``
    (down) its down weight, exactly; a missing or an extra expert tensor is named."""
    from safetensors.torch import load_file

    from raypaged.model.checkpoint import load_weights
    from raypaged.model.llama import LlamaForCausalLM

    config = EngineConfig(model=str(model_dirs["mixtral"]), device="cpu").hf_config
    tensors = load_file(model_dirs["mixtral"] / "model.safetensors")
    model = LlamaForCausalLM(config, 64)
    load_weights(model, tensors.items())
    expert = model.model.layers[1].mlp.experts[3]
    prefix = "model.layers.1.block_sparse_moe.experts.3"
    assert torch.equal(expert.gate_up_proj.weight[:48], tensors[f"{prefix}.w1.weight"])
    assert torch.equal(expert.gate_up_proj.weight[48:], tensors[f"{prefix}.w3.weight"])
    assert torch.equal(expert.down_proj.weight, tensors[f"{prefix}.w2.weight"])
    del tensors[f"{prefix}.w2.weight"]
    missing = r"missing 1 tensors, e\.g\. \['model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight'\]$"
    with pytest.raises(ValueError, match=missing):
        load_weights(LlamaForCausalLM(config, 64), tensors.items())
    tensors[f"{prefix.replace('.3', '.6')}.w2.weight"] = torch.zeros(64, 48)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.6\.down_proj\.weight' has no place"):
        load_weights(LlamaForCausalLM(config, 64), tensors.items())


EXPERTS_REFUSED = (
    r"^LoRA adapter 'experts': LoRA on parameters \(target_parameters, as of a mixture of experts' expert weights\) "
    r"is not supported$"
)


def test_attention_adapters_equal_peft_in_one_batch_with_the_base_model(model_dirs, tmp_path):
    """LoRA on a mixture-of-experts model adapts its attention: two peft adapters (q/v at rank 4; q/k/v/o at rank 8,
    rsLoRA) and the base model in one batch give peft's greedy tokens; an adapter of the experts is refused by name."""
    from peft import PeftModel

    from raypaged.lora.request import LoRARequest
    from tests.conftest import make_peft_adapter

    path = model_dirs["qwen3_moe"]
    options = {
        "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "qkvo": {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "use_rslora": True,
        },
    }
    adapters = {
        name: make_peft_adapter(path, tmp_path / name, seed, std=0.2, **o)
        for seed, (name, o) in enumerate(options.items())
    }
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = {None: [hf_greedy(base, p, LOGPROB_TOKENS) for p in LOGPROB_PROMPTS[:2]]}
    for name, adapter in adapters.items():
        peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter
        ).eval()
        want[name] = [hf_greedy(peft, p, LOGPROB_TOKENS) for p in LOGPROB_PROMPTS[:2]]
    assert len({tuple(map(tuple, tokens)) for tokens in want.values()}) == 3  # each adapter changes the tokens
    experts = make_peft_adapter(
        path, tmp_path / "experts", 3, r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]
    )
    llm = LLM(
        model=str(path), device="cpu", num_gpu_blocks_override=64, block_size=4, enable_lora=True, max_lora_rank=8
    )
    requests = {name: LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(adapters)}
    jobs = [(name, prompt) for name in want for prompt in LOGPROB_PROMPTS[:2]]
    params = SamplingParams(temperature=0, max_tokens=LOGPROB_TOKENS, ignore_eos=True)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": prompt} for _, prompt in jobs],
            params,
            use_tqdm=False,
            lora_request=[requests[name] if name else None for name, _ in jobs],
        )
        with pytest.raises(
            ValueError,
            match=EXPERTS_REFUSED,
        ):
            llm.generate(
                [{"prompt_token_ids": LOGPROB_PROMPTS[0]}], params, lora_request=LoRARequest("experts", 9, str(experts))
            )
    finally:
        llm.shutdown()
    got = {name: [o.outputs[0].token_ids for o in outputs[i * 2 : i * 2 + 2]] for i, name in enumerate(want)}
    assert got == want


def test_a_tensor_parallel_size_that_splits_no_expert_evenly_is_refused(model_dirs):
    config = EngineConfig(model=str(model_dirs["qwen2_moe"]), device="cpu").hf_config
    check_tensor_parallel(config, 4)
    config.moe_intermediate_size = 30
    with pytest.raises(ValueError, match=r"^the model's moe_intermediate_size 30 is not divisible by tensor_parallel"):
        check_tensor_parallel(config, 4)


# name -> (scheme, quantizer options, the largest error as a share of the float weight's largest |value|); group 8
# divides every projection's input (64, Mixtral's 48 and Qwen2-MoE's 32, 48 and 80, and each of two ranks' half)
QUANTIZED = {
    "fp8-block": ("fp8-block", {"block": (16, 8)}, 2**-4),  # 16-row blocks across the gate | up boundary
    "w8a8-int8": ("w8a8-int8", {}, 1 / 127),
    "gptq-actorder-asym": ("gptq", {"group_size": 8, "act_order": True, "symmetric": False}, 2 / 15),
    "awq": ("awq", {"group_size": 8}, 2 / 15),
}


@pytest.fixture(scope="module")
def quantized_dirs(tmp_path_factory, model_dirs) -> dict[tuple[str, str], Path]:
    """Mixtral's and Qwen2-MoE's checkpoints in each format (Mixtral's experts as w1, w2 and w3)."""
    root = tmp_path_factory.mktemp("moe_quantized")
    return {
        (model, name): quantizer.quantize_checkpoint(model_dirs[model], root / f"{model}-{name}", scheme, **options)
        for model in ("mixtral", "qwen2_moe")
        for name, (scheme, options, _) in QUANTIZED.items()
    }


def expert_names(model: str, layer: int, expert: int) -> tuple[str, str, str]:
    """The checkpoint names of an expert's gate, up and down weights."""
    if model == "mixtral":
        prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
        return f"{prefix}.w1.weight", f"{prefix}.w3.weight", f"{prefix}.w2.weight"
    prefix = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", f"{prefix}.down_proj.weight"


@pytest.mark.parametrize("name", sorted(QUANTIZED))
@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_each_quantized_expert_dequantizes_to_its_float_weights_on_each_shard(model, name, model_dirs, quantized_dirs):
    """Every expert (and the shared expert) loads quantized, within the scheme's error of its float weights; each of
    two shards holds its half of every expert's intermediate rows (gate, up) and columns (down), exactly."""
    weights = dict(iter_checkpoint(model_dirs[model]))
    path = quantized_dirs[(model, name)]
    whole = load_quantized(path)
    shards = [load_quantized(path, TensorParallel(rank, 2)) for rank in range(2)]
    tolerance = QUANTIZED[name][2]
    checked = 0
    for index, layer in enumerate(whole.model.layers):
        if not isinstance(layer.mlp, SparseMoeBlock):
            continue
        for expert_index, expert in enumerate(layer.mlp.experts):
            gate_name, up_name, down_name = expert_names(model, index, expert_index)
            gate_up, down = expert.gate_up_proj, expert.down_proj
            assert isinstance(gate_up, QuantLinear) and isinstance(down, QuantLinear)
            for got, want in ((gate_up, torch.cat([weights[gate_name], weights[up_name]])), (down, weights[down_name])):
                assert (got.dequantize() - want).abs().max() <= tolerance * want.abs().max()
            half = expert.intermediate_size // 2
            for rank, shard in enumerate(shards):
                shard_expert = shard.model.layers[index].mlp.experts[expert_index]
                mine = range(rank * half, (rank + 1) * half)
                rows = [*mine, *(2 * half + row for row in mine)]
                assert torch.equal(shard_expert.gate_up_proj.dequantize(), gate_up.dequantize()[rows])
                assert torch.equal(shard_expert.down_proj.dequantize(), down.dequantize()[:, mine])
            checked += 1
        if layer.mlp.shared_expert is not None:
            assert isinstance(layer.mlp.shared_expert.down_proj, QuantLinear)
    assert checked == {"mixtral": 2 * 6, "qwen2_moe": 2 * 8}[model]


def test_a_gptq_model_generates_as_transformers_with_its_dequantized_weights(model_dirs, quantized_dirs, tmp_path):
    """Weight-only 4-bit (GPTQ, act order): raypaged's greedy tokens equal transformers' from a float checkpoint of
    the weights raypaged dequantized, routing, experts, the shared expert and the dense layer alike."""
    model = "qwen2_moe"
    path = quantized_dirs[(model, "gptq-actorder-asym")]
    loaded = load_quantized(path)
    weights = dict(iter_checkpoint(model_dirs[model]))
    for index, layer in enumerate(loaded.model.layers):
        prefix = f"model.layers.{index}"
        attn = layer.self_attn
        for part, rows in zip("qkv", attn.qkv_proj.dequantize().split(attn.shard_sizes)):
            weights[f"{prefix}.self_attn.{part}_proj.weight"] = rows
        weights[f"{prefix}.self_attn.o_proj.weight"] = attn.o_proj.dequantize()
        mlps = {f"{prefix}.mlp": layer.mlp} if not isinstance(layer.mlp, SparseMoeBlock) else {}
        if isinstance(layer.mlp, SparseMoeBlock):
            mlps |= {f"{prefix}.mlp.experts.{i}": expert for i, expert in enumerate(layer.mlp.experts)}
            mlps[f"{prefix}.mlp.shared_expert"] = layer.mlp.shared_expert
        for name, mlp in mlps.items():
            gate, up = mlp.gate_up_proj.dequantize().chunk(2)
            weights |= {f"{name}.gate_proj.weight": gate, f"{name}.up_proj.weight": up}
            weights[f"{name}.down_proj.weight"] = mlp.down_proj.dequantize()
    reference = tmp_path / "dequantized"
    shutil.copytree(model_dirs[model], reference)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, reference / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    llm = LLM(model=str(path), device="cpu", num_gpu_blocks_override=64, block_size=4)
    try:
        params = SamplingParams(temperature=0, max_tokens=LOGPROB_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in LOGPROB_PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, LOGPROB_TOKENS) for p in LOGPROB_PROMPTS]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_grouped_gemms_over_stacked_experts_equal_each_experts_own(model, model_dirs, quantized_dirs):
    """``stack_experts``: every expert's weights become views of two stacked tensors, and the experts as two grouped
    GEMMs (``torch._grouped_mm``, no host sync: what an H100/H200 runs in bf16) give each layer's output of the
    expert-by-expert loop; a quantized model's or packed weights are left as they are."""
    config = AutoConfig.from_pretrained(model_dirs[model])
    loaded = LlamaForCausalLM(config, 64)
    loaded.load_weights(iter_checkpoint(model_dirs[model]))
    blocks = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        loops = [block(x) for block in blocks]
    assert loaded.stack_experts() == [True] * len(blocks)
    for block, loop in zip(blocks, loops):
        assert block.stacked is not None
        gate_up, down = block.stacked
        for index, expert in enumerate(block.experts):
            assert expert.gate_up_proj.weight.data_ptr() == gate_up[index].data_ptr()
            assert expert.down_proj.weight.data_ptr() == down[index].data_ptr()
        with torch.inference_mode():
            torch.testing.assert_close(block(x), loop, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(block(x[:0]), loop[:0])
    if (model, "gptq-actorder-asym") in quantized_dirs:
        assert not any(load_quantized(quantized_dirs[(model, "gptq-actorder-asym")]).stack_experts())
    packed = load_model(model_dirs[model], config, 64, torch.float32, torch.device("cpu"), TensorParallel())
    assert not any(packed.stack_experts())


def test_expert_parallel_shards_load_their_quantized_experts_whole(quantized_dirs):
    """GPTQ (act order) Mixtral at tp 2 with expert parallelism: each shard's experts dequantize to the whole
    model's, every row and column (their groups and g_idx unsplit)."""
    path = quantized_dirs[("mixtral", "gptq-actorder-asym")]
    whole = load_quantized(path)
    for rank in range(2):
        shard = load_quantized(path, TensorParallel(rank, 2, expert_parallel=True))
        for whole_layer, layer in zip(whole.model.layers, shard.model.layers, strict=True):
            assert len(layer.mlp.experts) == 3
            for local, expert in enumerate(layer.mlp.experts):
                want = whole_layer.mlp.experts[3 * rank + local]
                assert torch.equal(expert.gate_up_proj.dequantize(), want.gate_up_proj.dequantize())
                assert torch.equal(expert.down_proj.dequantize(), want.down_proj.dequantize())


def test_glm4_moe_router_stays_fp32_and_its_mtp_layer_is_skipped(model_dirs, monkeypatch):
    """A bf16 model is built in bf16 (never in fp32 first), and GLM-4.5's router weight and score bias stay fp32 in it,
    the checkpoint's values exactly (transformers keeps them so); the multi-token-prediction layer a checkpoint keeps
    after the model's (``num_nextn_predict_layers``) is not loaded, and a layer past it is named."""
    from safetensors.torch import load_file

    from raypaged.model import loader
    from raypaged.model.checkpoint import load_weights

    path = model_dirs["glm4_moe"]
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.num_nextn_predict_layers) == (3, 1)
    built_in = []

    class Recorded(LlamaForCausalLM):
        def __init__(self, *args, **kwargs) -> None:
            built_in.append(torch.get_default_dtype())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(loader, "LlamaForCausalLM", Recorded)
    model = load_model(path, config, 64, torch.bfloat16, torch.device("cpu"))
    assert built_in == [torch.bfloat16] and torch.get_default_dtype() == torch.float32
    router = model.model.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts[0].down_proj.weight.dtype == torch.bfloat16
    tensors = load_file(path / "model.safetensors")
    assert torch.equal(router.weight, tensors["model.layers.1.mlp.gate.weight"])
    assert torch.equal(
        LlamaForCausalLM(config, 64).model.layers[1].mlp.gate.e_score_correction_bias, torch.zeros(8)
    )  # what the loader overwrites: the checkpoint's bias
    loaded = LlamaForCausalLM(config, 64)
    load_weights(loaded, [*tensors.items(), ("model.layers.3.eh_proj.weight", torch.zeros(64, 128))])
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(loaded.model.layers[1].mlp.gate.e_score_correction_bias, bias) and bias.abs().sum() > 0
    with pytest.raises(ValueError, match=r"'model\.layers\.4\.eh_proj\.weight' has no place in the model"):
        load_weights(
            LlamaForCausalLM(config, 64), [*tensors.items(), ("model.layers.4.eh_proj.weight", torch.zeros(1))]
        )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_bf16_moe_on_cpu_runs_each_expert_from_bf16_packed_weights_with_the_fp32_blocks_bits(
    model, model_dirs, tmp_path, monkeypatch
):
    """A bf16 mixture of experts on a CPU computes in fp32 from bf16 weights packed for the C GEMMs, its experts' as
    the dense layers' (layers.bf16_linears_on_cpu): half fp32's memory, as torch's bf16 model. Built for AVX2, where
    the bf16 panels are widened to fp32, each sparse block gives the fp32 block's bits on the same weights; routers
    (GLM-4.5's fp32 one too) and shared-expert gates are fp32."""
    use_kernels_without_avx512(monkeypatch)
    path, cpu = write_bf16_checkpoint(model_dirs[model], tmp_path / model), torch.device("cpu")
    config = AutoConfig.from_pretrained(path)
    got = load_model(path, config, 64, torch.float32, cpu, bf16_linears=True)
    want = load_model(path, config, 64, torch.float32, cpu)
    blocks = [(g.mlp, w.mlp) for g, w in zip(got.model.layers, want.model.layers) if isinstance(g.mlp, SparseMoeBlock)]
    assert len(blocks) == 2  # Qwen2-MoE's and GLM-4.5's third layer dense
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(0))
    for block, fp32 in blocks:
        experts = [block.experts, [block.shared_expert] if block.shared_expert is not None else []]
        linears = [lin.weight for mlps in experts for mlp in mlps for lin in (mlp.gate_up_proj, mlp.down_proj)]
        assert linears and all(isinstance(w, PackedWeight) and w.bf16 for w in linears)
        assert block.gate.weight.dtype == torch.float32
        assert torch.equal(block(x), fp32(x))


def test_a_bf16_moe_checkpoint_serves_from_bf16_weights_and_follows_the_fp32_engine(model_dirs, tmp_path):
    """``--dtype auto`` on a bf16 Qwen2-MoE checkpoint (a shared expert, a dense layer): every float linear, each
    expert's included, packed in bf16 over a bf16 KV cache; natively (with AVX512-BF16 where the CPU has it, the
    linears' inputs rounded to bf16) its greedy tokens follow the fp32 engine's on the same weights."""
    path = write_bf16_checkpoint(model_dirs["qwen2_moe"], tmp_path / "qwen2_moe")
    params = SamplingParams(temperature=0, max_tokens=LOGPROB_TOKENS, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in LOGPROB_PROMPTS]
    runs = []
    for dtype in ("auto", "float32"):
        llm = LLM(model=str(path), dtype=dtype, num_gpu_blocks_override=64, block_size=4)
        worker = llm.llm_engine.executor.worker
        if dtype == "auto":
            assert worker.bf16_linears and worker.cache_dtype == torch.bfloat16
            experts = [m for m in worker.model.modules() if isinstance(m, SparseMoeBlock)]
            assert len(experts) == 2 and all(e.experts[0].down_proj.weight.bf16 for e in experts)
        runs.append([o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)])
        llm.shutdown()
    assert sum(got.token_ids == fp32.token_ids for got, fp32 in zip(*runs)) >= 3  # measured: 4 of 4 over 2 tokens,
    # 3 of 4 over 12 (a random model's near ties), the first logprobs within 0.001
    assert all(got.token_ids[:2] == fp32.token_ids[:2] for got, fp32 in zip(*runs))
    first = [[o.logprobs[0][o.token_ids[0]].logprob for o in run] for run in runs]
    torch.testing.assert_close(first[0], first[1], rtol=0, atol=0.01)
    assert first[0] != first[1]  # bf16 K/V and weights: not the fp32 arithmetic
