"""The CUDA kernels over an fp8 e4m3 KV cache (``torch.float8_e4m3fn``; the ``*_fp8`` kernels, switched on
by ``$RAYPAGED_FP8_KV_KERNELS``) against torch: the cache write narrows bit for bit as ``.to(torch.float8_e4m3fn)``;
decode (v1, v2), the varlen prefill (tensor cores and FMA) and the gather prefill over an fp8 cache match the torch
reference over the same cache (widened to float32) within the tolerances of tests/gpu/test_kernels.py and
test_paged_prefill.py, with random block tables, ragged lengths and outputs poisoned with NaN; an attention
backend step; and the engine: greedy tokens with the kernels equal those of the torch fallback."""

import dataclasses
import gc
import random

import pytest
import torch

from raypaged import kernels
from raypaged.attention import torch_ops
from raypaged.attention.backend import TORCH, KVScales, cuda_backend
from tests.attention.test_varlen import random_step
from tests.gpu import CUDA_ONLY, DEVICE, NEEDS_KERNELS, ON_HOST, TINY_LLAMA, ragged_prompts, random_llama
from tests.gpu import test_kernels as base
from tests.gpu.test_kernels import NUM_BLOCKS, random_layout, relative_error
from tests.gpu.test_kernels import TOLERANCE as DECODE_TOLERANCE

pytestmark = NEEDS_KERNELS

FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PREFILL_TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}  # test_paged_prefill.py's
MIXED = [(37, 37), (1, 50), (64, 200), (130, 333), (5, 5), (17, 18), (1, 1)]  # (query_len, context_len)


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """The kernels are off by default until these tests have passed on a device."""
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")


def fp8_cache(shape, scale=2.0):
    """Random K or V narrowed to fp8 (normal values and subnormals)."""
    return (torch.randn(shape, device=DEVICE) * scale).to(FP8)


def fp8_caches(block_size, num_kv_heads, head_size, num_blocks=NUM_BLOCKS):
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    return fp8_cache(shape), fp8_cache(shape)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


# ---- the cache write -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_narrows_as_torch_bit_for_bit(dtype, head_size):
    torch.manual_seed(0)
    num_tokens, num_kv_heads, block_size = 37, 2, 16
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, device=DEVICE) * 64
    # the edges of the narrowing: ties, subnormals, saturation, infinities, NaN, signed zero
    edges = [448.0, 449.0, 464.0, 470.0, 1e6, float("inf"), -float("inf"), float("nan"), 2.0**-10, 3 * 2.0**-10]
    edges += [2.0**-7 + 2.0**-10, 1.0625, -1.1875, -0.0, 1e-30, -500.0]
    positions = torch.randint(0, qkv.numel(), (20 * len(edges),), device=DEVICE)
    qkv.view(-1)[positions] = torch.tensor(edges, device=DEVICE).repeat(20)
    qkv = qkv.to(dtype)
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads : 2 * num_kv_heads]  # strided rows, as from a fused qkv
    slots = torch.randperm(NUM_BLOCKS * block_size, device=DEVICE)[:num_tokens]
    slots[::5] = -1  # padding
    poison = torch.full((NUM_BLOCKS, num_kv_heads, block_size, head_size), 0x5A, dtype=torch.uint8, device=DEVICE)
    key_cache, value_cache = poison.clone().view(FP8), poison.clone().view(FP8)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    # torch's narrowing on the device, written through byte views
    valid = slots >= 0
    blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
    for cache, rows in ((key_cache, key), (value_cache, value)):
        expected = poison.clone()
        expected[blocks, :, offsets] = rows[valid].to(FP8).view(torch.uint8)
        assert torch.equal(as_bytes(cache), expected)  # written slots narrowed as torch narrows; the rest untouched


def test_copy_and_gather_move_fp8_blocks_bit_for_bit():
    torch.manual_seed(1)
    pool = fp8_cache((3, 2, NUM_BLOCKS, 2, 8, 64))
    ref = as_bytes(pool).clone()
    for src, dst in [(3, 40), (7, 41)]:
        ref[:, :, dst] = ref[:, :, src]
    kernels.copy_blocks(pool, pool, torch.tensor([(3, 40), (7, 41)], device=DEVICE))
    assert torch.equal(as_bytes(pool), ref)
    key_cache, _ = fp8_caches(16, 4, 96)
    tables, _ = random_layout(random.Random(2), 5, 16, 200)
    gathered = kernels.gather_blocks(key_cache, tables)
    assert gathered.dtype == FP8
    assert torch.equal(as_bytes(gathered), torch_ops.gather_blocks(as_bytes(key_cache), tables))


# ---- decode ----------------------------------------------------------------------------------------------------


def decode_case(*args, **kwargs):
    """tests/gpu/test_kernels.py's decode case (its tolerances) over fp8 caches."""
    base.decode_case(*args, caches=lambda dtype, *shape: fp8_caches(*shape), **kwargs)


@pytest.mark.pairwise
@pytest.mark.parametrize("partition_size", [None, 32], ids=["v1", "v2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_gqa_over_fp8_matches_torch(dtype, head_size, block_size, partition_size):
    decode_case(dtype, head_size, block_size, 8, 2, partition_size, seed=head_size + block_size)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (12, 2), (32, 1)], ids=["mha", "gqa6", "mqa"])
@pytest.mark.parametrize("partition_size", [None, 48], ids=["v1", "v2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_head_layouts_over_fp8_match_torch(dtype, num_heads, num_kv_heads, partition_size):
    decode_case(dtype, 128, 16, num_heads, num_kv_heads, partition_size, seed=num_heads)


def test_decode_over_fp8_picks_v2_for_one_long_sequence():
    decode_case(torch.float16, 128, 16, 32, 8, None, seed=3, num_seqs=1, max_context=1400, min_context=1100)


# ---- prefill ---------------------------------------------------------------------------------------------------


def prefill_case(dtype, head_size, block_size, num_heads, num_kv_heads, spans, seed, tensor_cores=None, **layout):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_needed = [-(-context // block_size) for _, context in spans]
    num_blocks = 2 * sum(blocks_needed) + 3
    key_cache, value_cache = fp8_caches(block_size, num_kv_heads, head_size, num_blocks)
    free = list(range(num_blocks))
    rng.shuffle(free)
    max_blocks = max(blocks_needed) + 1
    tables = []
    for needed in blocks_needed:
        used = [free.pop() for _ in range(needed)]
        tables.append(used + [rng.randrange(num_blocks) for _ in range(max_blocks - needed)])  # garbage padding
    block_tables = torch.tensor(tables, dtype=layout.get("table_dtype", torch.int32), device=DEVICE)
    cu = [0]
    for query_len, _ in spans:
        cu.append(cu[-1] + query_len)
    total = cu[-1]
    if layout.get("strided_query"):  # the query part of a fused qkv
        query = torch.randn(total, num_heads + 2 * num_kv_heads, head_size, dtype=dtype, device=DEVICE)[:, :num_heads]
    else:
        query = torch.randn(total, num_heads, head_size, dtype=dtype, device=DEVICE)
    scale = head_size**-0.5
    out = torch.full((total, num_heads, head_size), float("nan"), dtype=dtype, device=DEVICE)
    result = kernels.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        torch.tensor(cu, dtype=torch.int32, device=DEVICE),
        torch.tensor([c for _, c in spans], dtype=torch.int32, device=DEVICE),
        block_tables,
        scale,
        max(q for q, _ in spans),
        out=out,
        tensor_cores=tensor_cores,
    )
    assert result is out
    assert not out.isnan().any(), "an output element was not written"
    keys, values = key_cache.float(), value_cache.float()
    for s, (query_len, context_len) in enumerate(spans):
        ids = block_tables[s, : blocks_needed[s]].long()
        ref = torch_ops.paged_attention_prefill(query[cu[s] : cu[s + 1]].float(), keys, values, ids, context_len, scale)
        error = relative_error(out[cu[s] : cu[s + 1]], ref)
        assert error <= PREFILL_TOLERANCE[dtype], (s, query_len, context_len, error)


KERNEL_CHOICES = [(d, t) for d in DTYPES for t in ([None] if d == torch.float32 else [None, False])]


def KERNEL_IDS(value):  # noqa: N802 (used as a constant)
    return str(value) if isinstance(value, torch.dtype) else {None: "auto", False: "fma"}[value]


@pytest.mark.pairwise
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
@pytest.mark.parametrize("dtype, tensor_cores", KERNEL_CHOICES, ids=KERNEL_IDS)
def test_varlen_prefill_over_fp8_matches_torch(dtype, tensor_cores, head_size, block_size):
    prefill_case(dtype, head_size, block_size, 8, 2, MIXED, seed=head_size + block_size, tensor_cores=tensor_cores)


@pytest.mark.pairwise
@pytest.mark.parametrize(
    "num_heads, num_kv_heads", [(8, 8), (12, 2), (32, 1), (96, 1)], ids=["mha", "gqa6", "mqa32", "mqa96"]
)
@pytest.mark.parametrize("dtype, tensor_cores", KERNEL_CHOICES, ids=KERNEL_IDS)
def test_varlen_prefill_head_layouts_over_fp8_match_torch(dtype, tensor_cores, num_heads, num_kv_heads):
    spans = [(70, 70), (3, 90), (33, 161)]
    prefill_case(dtype, 128, 16, num_heads, num_kv_heads, spans, seed=num_heads, tensor_cores=tensor_cores)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_varlen_prefill_over_fp8_long_chunk_int64_tables_strided_query(dtype):
    # smaller on the host, where the kernels run thread by thread (tests/gpu/test_paged_prefill.py)
    prefill_case(dtype, 128, 16, 16, 4, [(150, 700), (70, 70)] if ON_HOST else [(512, 2048), (300, 300)], seed=5)
    prefill_case(dtype, 128, 32, 8, 2, MIXED, seed=11, table_dtype=torch.int64, strided_query=True)


@pytest.mark.parametrize("query_len", [1, 19, 150], ids=["one", "chunk", "whole-prompt"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_prefill_over_fp8_matches_torch(dtype, query_len):
    torch.manual_seed(3)
    key_cache, value_cache = fp8_caches(16, 2, 128)
    block_ids = torch.randperm(NUM_BLOCKS, device=DEVICE)[:10]
    query = torch.randn(query_len, 8, 128, dtype=dtype, device=DEVICE)
    ref = torch_ops.paged_attention_prefill(
        query.float(), key_cache.float(), value_cache.float(), block_ids, 150, 128**-0.5
    )
    out = kernels.paged_attention_prefill(query, key_cache, value_cache, block_ids, 150, 128**-0.5)
    assert out.dtype == dtype and relative_error(out, ref) <= DECODE_TOLERANCE[dtype]


# ---- an attention backend step ---------------------------------------------------------------------------------


def every_span_over_the_cache(query, key, value, key_cache, value_cache, meta, scale):
    """The torch reference of a step whose every span reads its context from the fp8 cache (as the varlen kernel
    does, whole prompts too): the step's K/V narrowed into it first."""
    torch_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    keys, values = key_cache.float(), value_cache.float()
    out = torch.empty_like(query)
    n = meta.num_decode_tokens
    out[:n] = torch_ops.paged_attention_decode(
        query[:n], keys, values, meta.decode_block_tables, meta.decode_context_lens, scale
    )
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.query_len)
        out[rows] = torch_ops.paged_attention_prefill(
            query[rows], keys, values, span.block_ids, span.context_len, scale
        )
    return out


@pytest.mark.parametrize(
    "varlen, scales", [("0", None), ("1", None), ("0", KVScales(0.011, 0.0043))], ids=["per-span", "varlen", "scaled"]
)
@pytest.mark.parametrize("seed", range(2))
def test_cuda_backend_step_over_fp8_matches_torch(monkeypatch, seed, varlen, scales):
    """AttentionBackend.forward on CUDA over an fp8 cache (fp32 model): the cache bytes it writes are torch's, and
    its output is the torch backend's (per-span: whole prompts over their fresh K/V) or, with the varlen kernel,
    that of every span read from the cache. Scaled: K/V divided by per-layer scales before the fp8 kernel writes
    them, the scales folded into the kernels' reads (tests/attention/test_kv_scales.py checks the fold on CPU)."""
    monkeypatch.setenv("RAYPAGED_VARLEN_PREFILL", varlen)
    query, key, value, key_cache, value_cache, meta = random_step(seed, head_dim=64, block_size=8)
    key_cache, value_cache = key_cache.to(FP8), value_cache.to(FP8)  # the stale garbage too, saturated
    cuda_meta = dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping.to(DEVICE),
        decode_block_tables=meta.decode_block_tables.to(DEVICE),
        decode_context_lens=meta.decode_context_lens.to(DEVICE),
        varlen_cache={},
        prefills=[dataclasses.replace(s, block_ids=s.block_ids.to(DEVICE)) for s in meta.prefills],
    )
    ref_key, ref_value = key_cache.clone(), value_cache.clone()
    if varlen == "1":
        expected = every_span_over_the_cache(query, key, value, ref_key, ref_value, meta, 64**-0.5)
    else:
        expected = TORCH.forward(query, key, value, ref_key, ref_value, meta, 64**-0.5, scales)
    backend = cuda_backend(fp8_cache=True)
    assert (backend.varlen_prefill is not None) == (varlen == "1")
    kc, vc = key_cache.to(DEVICE), value_cache.to(DEVICE)
    out = backend.forward(query.to(DEVICE), key.to(DEVICE), value.to(DEVICE), kc, vc, cuda_meta, 64**-0.5, scales)
    assert torch.equal(as_bytes(kc).cpu(), as_bytes(ref_key)) and torch.equal(as_bytes(vc).cpu(), as_bytes(ref_value))
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


# ---- the engine ------------------------------------------------------------------------------------------------

SHAPE = TINY_LLAMA


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_llama(tmp_path_factory.mktemp("fp8_kv") / "tiny", **SHAPE)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()


def generate(model_dir, prompts, params, expect_backend, **kwargs):
    from raypaged import LLM

    kwargs = {"dtype": "float32", "gpu_memory_utilization": 0.3, "max_model_len": 2048, **kwargs}
    llm = LLM(str(model_dir), device="cuda", kv_cache_dtype="fp8", **kwargs)
    worker = llm.llm_engine.executor.worker
    assert worker.attn_backend.name == expect_backend
    assert worker.runner.cache.device_blocks.dtype == FP8
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    graphs = worker.runner.graphs
    stats = llm.stats()
    del llm, worker
    gc.collect()
    torch.cuda.empty_cache()
    return outputs, graphs, stats


def tokens(outputs):
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.fixture
def per_span(monkeypatch):
    """Whole prompts attend over their fresh K/V on both paths (the varlen kernel would read them from the cache,
    rounded to fp8, where the torch backend does not)."""
    monkeypatch.setenv("RAYPAGED_VARLEN_PREFILL", "0")


@CUDA_ONLY
@pytest.mark.usefixtures("per_span")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_engine_greedy_tokens_with_the_fp8_kernels_are_the_torch_fallbacks(
    monkeypatch, model_dir, prompts, enforce_eager
):
    from raypaged import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "0")
    fallback, graphs, _ = generate(model_dir, prompts, greedy, "torch", enforce_eager=True)
    assert graphs is None
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")
    outputs, graphs, stats = generate(model_dir, prompts, greedy, "cuda", enforce_eager=enforce_eager)
    assert tokens(outputs) == tokens(fallback)
    assert (graphs is None) == enforce_eager and (enforce_eager or graphs.replays > 0)
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]


@CUDA_ONLY
@pytest.mark.usefixtures("per_span")
def test_engine_calculated_kv_scales_with_the_fp8_kernels_are_the_torch_fallbacks(monkeypatch, model_dir, prompts):
    """--calculate-kv-scales: the first step sets each layer's scales on both paths alike; CUDA graphs stay off."""
    from raypaged import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "0")
    fallback, _, _ = generate(model_dir, prompts, greedy, "torch", enforce_eager=True, calculate_kv_scales=True)
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")
    outputs, graphs, _ = generate(model_dir, prompts, greedy, "cuda", calculate_kv_scales=True)
    assert graphs is None
    assert tokens(outputs) == tokens(fallback)


@CUDA_ONLY
@pytest.mark.usefixtures("per_span")
def test_engine_swaps_fp8_blocks_through_the_copy_kernel(model_dir, prompts):
    """A pool too small for the batch: groups swap out to pinned host blocks and back, bytes kept."""
    from raypaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, n=2)
    roomy, _, _ = generate(model_dir, prompts[:5], params, "cuda", max_model_len=416)
    swapped, _, stats = generate(
        model_dir,
        prompts[:5],
        params,
        "cuda",
        num_gpu_blocks_override=26,
        max_model_len=416,
        swap_space=0.05,
        preemption_mode="swap",
    )
    assert stats["num_swap_outs"] > 0
    assert tokens(swapped) == tokens(roomy)


@CUDA_ONLY
@pytest.mark.usefixtures("per_span")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_engine_half_precision_logprobs_with_the_fp8_kernels_are_the_torch_fallbacks(
    monkeypatch, model_dir, prompts, dtype
):
    from raypaged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "0")
    fallback, _, _ = generate(model_dir, prompts, params, "torch", dtype=dtype, enforce_eager=True)
    monkeypatch.setenv("RAYPAGED_FP8_KV_KERNELS", "1")
    outputs, _, _ = generate(model_dir, prompts, params, "cuda", dtype=dtype)
    for out, ref in zip(outputs, fallback):
        assert len(out.outputs[0].token_ids) == 8
        ours, theirs = out.outputs[0].logprobs[0], ref.outputs[0].logprobs[0]
        for token in ours.keys() & theirs.keys():
            assert abs(ours[token] - theirs[token]) <= 0.05 * max(1.0, abs(theirs[token])), token
