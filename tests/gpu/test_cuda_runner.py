"""The engine on a CUDA device against transformers on the same device and weights:
the kernel attention backend, eager and with decode CUDA graphs, fp32/fp16/bf16,
swapping through the copy_blocks kernel, and KV sizing by gpu_memory_utilization."""

import gc

import pytest
import torch

from raypaged import LLM, SamplingParams
from tests.gpu import NEEDS_CUDA_AND_CUPY, TINY_LLAMA, ragged_prompts, random_llama

pytestmark = NEEDS_CUDA_AND_CUPY

SHAPE = TINY_LLAMA
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(autouse=True)
def release_device_memory():
    """Each test's engine (and its KV cache) is gone before the next sizes its own."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small random Llama saved as safetensors, with a word-level tokenizer."""
    return random_llama(tmp_path_factory.mktemp("cuda") / "tiny", **SHAPE)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()


def hf_greedy(model_dir, prompts, dtype, max_tokens=32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    outputs = []
    for ids in prompts:
        ids_t = torch.tensor([ids], device="cuda")
        with torch.inference_mode():
            out = model.generate(
                ids_t,
                attention_mask=torch.ones_like(ids_t),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(ids) :].tolist())
    del model
    torch.cuda.empty_cache()
    return outputs


def hf_first_logprobs(model_dir, prompts, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    with torch.no_grad():
        rows = [
            model(torch.tensor([ids], device="cuda")).logits[0, -1].float().log_softmax(-1).cpu() for ids in prompts
        ]
    del model
    torch.cuda.empty_cache()
    return rows


def engine(model_dir, **kwargs):
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("gpu_memory_utilization", 0.3)
    kwargs.setdefault("max_model_len", 2048)
    return LLM(str(model_dir), device="cuda", **kwargs)


def runner(llm):
    return llm.llm_engine.executor.worker.runner


def run(llm, prompts, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    return hf_greedy(model_dir, prompts, torch.float32)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("backend", ["cuda", "torch"])
def test_fp32_greedy_matches_transformers(model_dir, prompts, reference, enforce_eager, backend):
    llm = engine(model_dir, enforce_eager=enforce_eager, attention_backend=backend)
    assert llm.llm_engine.executor.worker.attn_backend.name == backend
    assert run(llm, prompts) == reference
    graphs = runner(llm).graphs
    if enforce_eager or backend == "torch":  # graphs record the kernels only
        assert graphs is None
    else:
        assert graphs.replays > 0
    assert llm.stats()["num_gpu_blocks_free"] == llm.stats()["num_gpu_blocks_total"]


def test_async_scheduling_is_on_by_default_and_gives_the_synchronous_tokens(model_dir, prompts, reference):
    params = [
        GREEDY
        if i % 2 == 0
        else SamplingParams(
            temperature=0.8, seed=i, max_tokens=GREEDY.max_tokens, ignore_eos=True, repetition_penalty=1.2
        )
        for i in range(len(prompts))
    ]
    tokens = {}
    for mode in (None, False):  # the default first: on, with CUDA graphs
        llm = engine(model_dir, async_scheduling=mode)
        assert llm.llm_engine.config.resolved_async_scheduling is (mode is None)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[mode] = [list(o.outputs[0].token_ids) for o in outputs]
        assert (llm.llm_engine.core.num_overlapped_steps > 0) is (mode is None)
        assert runner(llm).graphs.replays > 0
        del llm
        torch.cuda.empty_cache()
    assert tokens[None] == tokens[False]
    assert tokens[None][0::2] == reference[0::2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_logprobs_match_transformers(model_dir, prompts, dtype):
    ref = hf_first_logprobs(model_dir, prompts, dtype)
    name = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    for eager in (True, False):
        llm = engine(model_dir, dtype=name, enforce_eager=eager)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5),
            use_tqdm=False,
        )
        for out, row in zip(outputs, ref):
            first = out.outputs[0].logprobs[0]
            for token, logprob in first.items():
                assert abs(logprob - row[token].item()) <= 0.05 * max(1.0, abs(row[token].item())), (token, eager)
            assert len(out.outputs[0].token_ids) == 8
        del llm
        torch.cuda.empty_cache()


def test_swap_through_copy_blocks_kernel_keeps_outputs(model_dir, prompts, reference):
    """A pool too small for the batch: groups swap out to pinned host blocks and back."""
    llm = engine(
        model_dir,
        num_gpu_blocks_override=26,
        max_model_len=416,
        swap_space=0.05,
        preemption_mode="swap",
        enforce_eager=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, n=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:5]], params, use_tqdm=False)
    for out, ref in zip(outputs, reference[:5]):
        assert [list(c.token_ids) for c in out.outputs] == [ref, ref]
    stats = llm.stats()
    assert stats["num_swap_outs"] > 0
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
    assert stats["num_cpu_blocks_free"] == stats["num_cpu_blocks_total"] > 0


def test_gpu_memory_utilization_sizes_the_cache(model_dir):
    total = torch.cuda.mem_get_info()[1]
    before = torch.cuda.memory_allocated()
    llm = engine(model_dir, gpu_memory_utilization=0.2, enforce_eager=True)
    blocks = llm.llm_engine.executor.worker.runner.cache.device_blocks
    cache_bytes = blocks.numel() * blocks.element_size()
    assert 0.18 * total < cache_bytes < 0.2 * total  # the tiny model's weights and activations take the rest
    assert torch.cuda.memory_allocated() - before < 0.2 * total
    del llm, blocks
    torch.cuda.empty_cache()


def test_too_little_memory_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="no device memory is left for the KV cache: gpu_memory_utilization 1e-05"):
        engine(model_dir, gpu_memory_utilization=0.00001)
