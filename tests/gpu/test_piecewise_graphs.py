"""Piecewise CUDA graphs (raypaged/worker/piecewise_graphs.py) on a device: replaying the
recorded pieces, with the attention eager between them, against the same pieces run eagerly and
against the model's forward, over mixed steps (decodes, whole prompts, a chunk over cached context,
1-token spans, padding); and an engine end to end with ``$RAYPAGED_PIECEWISE_GRAPHS`` on and off.
The CPU tests of the pieces run eagerly (bit for bit): tests/worker/test_piecewise.py."""

import gc
import random

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.attention.backend import cuda_backend
from raypaged.worker.cuda_graphs import DecodeGraphs
from raypaged.worker.piecewise_graphs import PiecewiseGraphs
from tests import fused_reference as ref
from tests.gpu import NEEDS_CUDA_AND_CUPY, TINY_LLAMA, random_llama
from tests.worker.test_piecewise import BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, NUM_BLOCKS, STEPS, new_caches, step_inputs

pytestmark = NEEDS_CUDA_AND_CUPY

SHAPE = TINY_LLAMA


@pytest.fixture(autouse=True)
def piecewise_graphs_on(monkeypatch):
    monkeypatch.setenv("RAYPAGED_PIECEWISE_GRAPHS", "1")
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fused", ["0", "1"], ids=["plain", "fused"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_graph_replay_equals_the_eager_pieces_and_the_forward(architecture, fused, monkeypatch):
    monkeypatch.setenv("RAYPAGED_FUSED_KERNELS", fused)
    device = torch.device("cuda")
    model = ref.random_model(ref.tiny_config(architecture), torch.float32, "cuda")
    model.set_attention_backend(cuda_backend())
    assert (model.model.fused_ops is not None) is (fused == "1")
    caches = {name: new_caches(model, 7.0, "cuda") for name in ("forward", "pieces", "graphs")}
    pieces = PiecewiseGraphs(model, caches["pieces"], MAX_NUM_BATCHED_TOKENS, device)  # never captured: eager
    graphs = PiecewiseGraphs(model, caches["graphs"], MAX_NUM_BATCHED_TOKENS, device)
    decode = DecodeGraphs(model, caches["graphs"], 4, 3, device)
    decode.capture()
    graphs.capture(pool=decode.pool)  # one pool, as the runner records them
    assert sorted(graphs.graphs) == graphs.buckets == [8, 16, 20]
    assert all(len(g) == graphs.num_pieces == 3 for g in graphs.graphs.values())
    generator = torch.Generator().manual_seed(1)
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=device)
    with torch.inference_mode():
        for index, step in enumerate(STEPS):
            ids, positions, meta = step_inputs(step, generator, model.config.vocab_size, "cuda")
            written[meta.slot_mapping] = True
            expected = model(ids, positions, caches["forward"], meta).clone()
            eager = pieces.run(ids, positions, meta).clone()
            # as the runner: decode-only steps replay the decode graphs, the others the pieces
            replayed = (graphs if meta.prefills else decode).run(ids, positions, meta).clone()
            message = lambda m, index=index: f"step {index}: {m}"  # noqa: E731
            torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5, msg=message)
            torch.testing.assert_close(replayed, expected, rtol=1e-4, atol=1e-4, msg=message)
    assert graphs.replays == sum(1 for step in STEPS if not all(decode for *_, decode in step)) == 4
    assert decode.replays == 1 and pieces.replays == 0
    for (k, v), (k_ref, v_ref) in zip(caches["graphs"], caches["forward"]):
        for cache, cache_ref in ((k, k_ref), (v, v_ref)):
            torch.testing.assert_close(cache, cache_ref, rtol=1e-4, atol=1e-4)
            slots = cache.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK_SIZE, -1)
            assert slots[~written].eq(7.0).all()  # padding rows (slot -1) wrote nowhere


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small random Llama saved as safetensors, with a word-level tokenizer."""
    return random_llama(tmp_path_factory.mktemp("piecewise") / "tiny", **SHAPE)


def test_engine_gives_the_same_greedy_tokens_with_the_switch_on_and_off(model_dir, monkeypatch):
    """A 128-token budget and 4 sequences at a time: prompts are chunked and new ones start while
    others decode, so most steps are mixed."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(n)] for n in (3, 17, 64, 100, 250, 31, 5, 90)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    tokens, replays = {}, {}
    for switch in ("1", "0"):
        monkeypatch.setenv("RAYPAGED_PIECEWISE_GRAPHS", switch)
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.3,
            max_model_len=2048,
            max_num_batched_tokens=128,
            max_num_seqs=4,
        )
        runner = llm.llm_engine.executor.worker.runner
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[switch] = [list(o.outputs[0].token_ids) for o in outputs]
        assert runner.graphs is not None and runner.graphs.replays > 0
        replays[switch] = None if runner.piecewise is None else runner.piecewise.replays
        if runner.piecewise is not None:
            assert runner.piecewise.buckets == [8, 16, 24, 32, 48, 64, 96, 128]
        del llm, runner, outputs
        gc.collect()
        torch.cuda.empty_cache()
    assert replays["0"] is None and replays["1"] > 0
    assert tokens["1"] == tokens["0"]
    assert [len(t) for t in tokens["1"]] == [p.max_tokens for p in params]


def test_vllms_capture_size_flags_choose_the_graphs_and_change_no_token(model_dir):
    """--cudagraph-capture-sizes 1 3 32: decode graphs for batches 1 and 3 (a batch of 4 runs eagerly), piecewise
    graphs for 1, 3 and 32 tokens (a step of more runs eagerly); the tokens equal the default sizes'."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(n)] for n in (3, 17, 40, 9, 25)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for sizes in (None, [1, 3, 32]):
        llm = LLM(
            str(model_dir),
            device="cuda",
            dtype="float32",
            gpu_memory_utilization=0.3,
            max_model_len=512,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            cudagraph_capture_sizes=sizes,
        )
        runner = llm.llm_engine.executor.worker.runner
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[str(sizes)] = [list(o.outputs[0].token_ids) for o in outputs]
        assert runner.graphs is not None
        if sizes is not None:
            assert runner.graphs.sizes == [1, 3] and runner.piecewise.buckets == [1, 3, 32]
            assert runner.graphs.replays > 0 and runner.piecewise.replays > 0
        del llm, runner, outputs
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens["None"] == tokens["[1, 3, 32]"]
