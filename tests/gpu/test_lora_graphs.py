"""LoRA recorded into the CUDA graphs (``$RAYPAGED_LORA_KERNELS``): one decode graph per batch
size, and one set of pieces per token bucket, replay the BGMV product for whatever adapters the
step's rows read, against the same BGMV mapping run eagerly and the per-slot matmul path. The
pieces without graphs, on the CPU: tests/worker/test_piecewise.py."""

import gc

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.attention.backend import cuda_backend
from raypaged.lora.ops import build_bgmv_mapping, build_lora_mapping
from raypaged.lora.request import LoRARequest
from raypaged.worker.cuda_graphs import DecodeGraphs
from raypaged.worker.piecewise_graphs import PiecewiseGraphs
from tests import fused_reference as ref
from tests.conftest import make_peft_adapter
from tests.gpu import NEEDS_CUDA_AND_CUPY, TINY_LLAMA, random_llama
from tests.worker.test_piecewise import (
    MAX_NUM_BATCHED_TOKENS,
    STEPS,
    attach_random_lora,
    lora_slots,
    new_caches,
    step_inputs,
)

pytestmark = NEEDS_CUDA_AND_CUPY

DECODE = [("a", 12, 1, True), ("b", 7, 1, True), ("c", 5, 1, True)]  # 3 rows: the graph of 4, one padding row
# slots 0 and 2 hold adapters of ranks 4 and 8, slot 1 none
STEP_SLOTS = [[0, None, 2], [None, None, None], [2, 2, 2], [1, 0, None], [None, 2, 0]]


@pytest.fixture(autouse=True)
def release_device_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


def test_decode_graphs_replay_the_lora_product_for_any_slots():
    device = torch.device("cuda")
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cuda")
    model.set_attention_backend(cuda_backend())
    lora = attach_random_lora(model, device)
    caches = {name: new_caches(model, 7.0, "cuda") for name in ("segments", "bgmv", "graphs", "base")}
    graphs = DecodeGraphs(model, caches["graphs"], 4, 3, device, lora.step)
    graphs.capture()
    assert graphs.records_lora and lora.step.mapping is None and sorted(graphs.graphs) == [1, 2, 4]
    inputs = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for index, token_slots in enumerate(STEP_SLOTS):
            ids, positions, meta = step_inputs(DECODE, inputs, model.config.vocab_size, "cuda")
            lora.step.mapping = build_lora_mapping(token_slots, device)
            expected = model(ids, positions, caches["segments"], meta).clone()
            lora.step.mapping = build_bgmv_mapping(token_slots, device)
            eager = model(ids, positions, caches["bgmv"], meta).clone()
            replayed = graphs.run(ids, positions, meta).clone()
            message = lambda m, index=index, token_slots=token_slots: (  # noqa: E731
                f"step {index}, slots {token_slots}: {m}"
            )
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5, msg=message)
            torch.testing.assert_close(eager, expected, rtol=1e-4, atol=1e-4, msg=message)
            if index == 0:  # the adapters matter: rows of slots 0 and 2 are far from the base model's
                lora.step.mapping = None
                base = model(ids, positions, caches["base"], meta)
                torch.testing.assert_close(replayed[1], base[1], rtol=1e-4, atol=1e-4)
                assert (replayed[0] - base[0]).abs().max() > 1e-2 and (replayed[2] - base[2]).abs().max() > 1e-2
    assert graphs.replays == len(STEP_SLOTS)
    assert graphs.lora.slot_of[3].item() == -1  # the padding row reads no adapter


def test_piecewise_graphs_replay_the_lora_product_for_any_slots():
    device = torch.device("cuda")
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cuda")
    model.set_attention_backend(cuda_backend())
    lora = attach_random_lora(model, device)
    caches = {name: new_caches(model, 7.0, "cuda") for name in ("segments", "bgmv", "graphs")}
    decode = DecodeGraphs(model, caches["graphs"], 4, 3, device, lora.step)
    decode.capture()
    graphs = PiecewiseGraphs(model, caches["graphs"], MAX_NUM_BATCHED_TOKENS, device, lora.step)
    graphs.capture(pool=decode.pool)
    assert graphs.records_lora and lora.step.mapping is None
    inputs = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for index, step in enumerate(STEPS):
            ids, positions, meta = step_inputs(step, inputs, model.config.vocab_size, "cuda")
            token_slots = lora_slots(index, len(ids))
            lora.step.mapping = build_lora_mapping(token_slots, device)
            expected = model(ids, positions, caches["segments"], meta).clone()
            lora.step.mapping = build_bgmv_mapping(token_slots, device)
            eager = model(ids, positions, caches["bgmv"], meta).clone()
            replayed = (graphs if meta.prefills else decode).run(ids, positions, meta).clone()
            message = lambda m, index=index: f"step {index}: {m}"  # noqa: E731
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5, msg=message)
            torch.testing.assert_close(eager, expected, rtol=1e-4, atol=1e-4, msg=message)
    assert graphs.replays == sum(1 for step in STEPS if not all(decode for *_, decode in step)) == 4
    assert decode.replays == 1


SHAPE = TINY_LLAMA


def test_engine_tokens_with_the_lora_kernels_equal_the_torch_path(tmp_path, monkeypatch):
    """Three adapters over two slots, beside base-model requests: greedy tokens with the BGMV kernels
    and graphs equal the per-slot matmul path's (eager for adapter steps), and the graphs replay."""
    pytest.importorskip("peft")
    model_dir = random_llama(tmp_path / "tiny", **SHAPE)
    options = [
        dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        dict(r=8, lora_alpha=16, target_modules="all-linear"),
        dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
    ]
    adapters = [
        LoRARequest(f"ad{i}", i + 1, str(make_peft_adapter(model_dir, tmp_path / f"ad{i}", seed=i, std=0.3, **option)))
        for i, option in enumerate(options)
    ]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 3 for j in range(5 + 13 * i)]} for i in range(8)]
    requests = [adapters[i % 4] if i % 4 < 3 else None for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    found = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("RAYPAGED_LORA_KERNELS", switch)
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.3,
            max_model_len=512,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            max_num_seqs=8,
        )
        outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        found[switch] = [list(o.outputs[0].token_ids) for o in outputs]
        runner = llm.llm_engine.executor.worker.runner
        assert runner.graphs.records_lora is (switch == "1")
        if switch == "1":
            assert runner.graphs.replays > 0
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert found["1"] == found["0"]
