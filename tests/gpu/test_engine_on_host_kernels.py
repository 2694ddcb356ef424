"""The engine with ``attention_backend="cuda"`` and every CUDA-kernel switch on, its kernels built for the host
CPU (``raypaged.kernels.host``): where there is no GPU, the wiring of the kernels into the engine (the attention
backend's metadata for mixed steps, chunked prefill over cached context, the fused model step, the varlen
prefill, swaps through ``copy_blocks``, the fp8 cache, LoRA through BGMV, 4-bit layers through W4A16) runs end
to end. Greedy tokens equal those of the same engine on torch's attention and torch's linears, token for token.
On a GPU, tests/gpu/test_cuda_runner.py and its neighbours check the same paths on the device itself."""

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.kernels import host
from raypaged.lora.request import LoRARequest
from raypaged.quantization import wna16
from raypaged.quantization.quantizer import quantize_checkpoint
from tests.conftest import make_peft_adapter
from tests.gpu import ON_HOST, TINY_LLAMA, ragged_prompts, random_llama

pytestmark = pytest.mark.skipif(not ON_HOST or host.compiler() is None, reason="the kernels built for the host CPU")

SWITCHES = {
    "RAYPAGED_FUSED_KERNELS": "1",
    "RAYPAGED_VARLEN_PREFILL": "1",
    "RAYPAGED_FP8_KV_KERNELS": "1",
    "RAYPAGED_LORA_KERNELS": "1",
    "RAYPAGED_W4A16_KERNELS": "1",
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    for name, value in SWITCHES.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_llama(tmp_path_factory.mktemp("host_engine") / "tiny", **TINY_LLAMA)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()  # 3 to 1,100 tokens: 700 and 1,100 take the split-context (v2) decode


def generate(model_dir, prompts, backend: str, params=GREEDY, lora_request=None, then=(), **kwargs):
    """Greedy tokens per prompt, with the CUDA kernels built for the host (``cuda``) or torch's attention;
    ``then``: prompts the same engine generates for afterwards."""
    kwargs = {"dtype": "float32", "max_model_len": 2048, "kv_cache_space": 0.05, **kwargs}
    with host.on_host(backend == "cuda"):
        llm = LLM(str(model_dir), device="cpu", attention_backend=backend, **kwargs)
        worker = llm.llm_engine.executor.worker
        assert worker.attn_backend.name == backend
        outputs = []
        for batch, adapters in ((prompts, lora_request), (then, None)):
            if batch:
                inputs = [{"prompt_token_ids": p} for p in batch]
                outputs += llm.generate(inputs, params, use_tqdm=False, lora_request=adapters)
        stats = llm.stats()
    return [[list(c.token_ids) for c in o.outputs] for o in outputs], worker, stats


def test_mixed_steps_chunked_prefill_and_prefix_hits_equal_the_torch_backend(model_dir, prompts):
    """Chunks of at most 256 tokens (a long prompt's later chunks read its cached context through the block table),
    a repeated prompt served from the prefix cache, decodes beside prefills: the fused kernels and the varlen
    prefill on, as the switches say."""
    again = [prompts[4], prompts[6][:900]]  # a prompt again, and a 1,100-token one's first 900: from the cache
    options = dict(max_num_batched_tokens=256, enable_prefix_caching=True, then=again)
    ours, worker, stats = generate(model_dir, prompts, "cuda", **options)
    assert worker.attn_backend.fused_ops is not None and worker.attn_backend.varlen_prefill is not None
    assert stats["prefix_cache_hits"] > 0
    theirs, _, _ = generate(model_dir, prompts, "torch", **options)
    assert ours == theirs


def test_swapping_through_copy_blocks_equals_the_torch_backend(model_dir, prompts):
    """A pool too small for every sequence at once: sequences are swapped out and back in by the copy kernel."""
    options = dict(num_gpu_blocks_override=40, max_model_len=320, swap_space=0.05, preemption_mode="swap")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ours, _, stats = generate(model_dir, prompts[:5], "cuda", params, **options)
    assert stats["num_swap_outs"] > 0
    theirs, _, _ = generate(model_dir, prompts[:5], "torch", params, **options)
    assert ours == theirs


def test_an_fp8_kv_cache_through_the_fp8_kernels_equals_the_torch_backend(model_dir, prompts, monkeypatch):
    """Whole prompts attend over their fresh K/V on both paths (per span), as tests/gpu/test_fp8_kv_kernels.py's
    engine tests do on a GPU; the cache is written and read in fp8 by the kernels."""
    monkeypatch.setenv("RAYPAGED_VARLEN_PREFILL", "0")
    ours, worker, _ = generate(model_dir, prompts, "cuda", kv_cache_dtype="fp8")
    assert worker.runner.cache.device_blocks.dtype == torch.float8_e4m3fn
    theirs, _, _ = generate(model_dir, prompts, "torch", kv_cache_dtype="fp8")
    assert ours == theirs


def test_lora_through_the_bgmv_kernels_equals_the_per_slot_path(model_dir, prompts, tmp_path):
    adapters = [
        make_peft_adapter(model_dir, tmp_path / "a", 0, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        make_peft_adapter(model_dir, tmp_path / "b", 1, r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"]),
    ]
    requests = [LoRARequest(f"adapter{i % 2}", i % 2 + 1, str(adapters[i % 2])) if i % 3 else None for i in range(6)]
    options = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    ours, worker, _ = generate(model_dir, prompts[:6], "cuda", lora_request=requests, **options)
    assert worker.runner.lora.bgmv
    theirs, worker, _ = generate(model_dir, prompts[:6], "torch", lora_request=requests, **options)
    assert not worker.runner.lora.bgmv
    assert ours == theirs


def test_gptq_layers_through_the_w4a16_kernels_equal_the_dequantize_path(model_dir, prompts, tmp_path, monkeypatch):
    gptq = quantize_checkpoint(model_dir, tmp_path / "gptq", "gptq", group_size=64, act_order=True, symmetric=False)
    ours, worker, _ = generate(gptq, prompts[:5], "cuda")
    linears = [m for m in worker.runner.model.modules() if wna16.kernel_weight(m) is not None]
    assert linears  # the 4-bit layers took the kernels' layout
    monkeypatch.setenv("RAYPAGED_W4A16_KERNELS", "0")
    theirs, _, _ = generate(gptq, prompts[:5], "cuda")
    assert ours == theirs


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_logprobs_through_the_tensor_core_prefill_match_the_torch_backend(model_dir, prompts, dtype):
    """fp16/bf16 (the host build takes an sm_90 GPU's paths: the varlen prefill on tensor cores): every prompt's
    first logprobs within 5 % of torch's attention, as tests/gpu/test_cuda_runner.py asks of a GPU."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5)
    runs = {}
    for backend in ("cuda", "torch"):
        with host.on_host(backend == "cuda"):
            llm = LLM(str(model_dir), device="cpu", dtype=dtype, attention_backend=backend, kv_cache_space=0.05)
            runs[backend] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ours, theirs in zip(runs["cuda"], runs["torch"]):
        first, reference = ours.outputs[0].logprobs[0], theirs.outputs[0].logprobs[0]
        shared = first.keys() & reference.keys()
        assert len(shared) >= 3
        for token in shared:
            assert abs(first[token] - reference[token]) <= 0.05 * max(1.0, abs(reference[token])), token
