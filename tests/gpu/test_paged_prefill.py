"""kernels/paged_prefill.cu (raypaged.kernels.paged_prefill_attention) against the torch reference, span by
span: several spans of different query and context lengths in one call (whole prompts, chunks over cached
context, one-token spans), GQA/MQA, every head and block size, fp32/fp16/bf16, the tensor-core and the
fp32-FMA kernels, block ids scattered over the cache with garbage padding, outputs poisoned with NaN."""

import dataclasses
import random

import pytest
import torch

from raypaged import kernels
from raypaged.attention import torch_ops
from raypaged.attention.backend import TORCH, cuda_backend
from tests.attention.test_varlen import random_step
from tests.gpu import DEVICE, NEEDS_KERNELS, ON_HOST

pytestmark = NEEDS_KERNELS


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """The kernels are off by default until these tests have passed on a device."""
    monkeypatch.setenv("RAYPAGED_VARLEN_PREFILL", "1")


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# fp32: FMA kernel, fp32 throughout. fp16/bf16: P is rounded to the input dtype before P V (as FlashAttention)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}
# (query_len, context_len): a whole prompt, one query token over a context, chunks, a short prompt
MIXED = [(37, 37), (1, 50), (64, 200), (130, 333), (5, 5), (17, 18), (1, 1)]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def prefill_case(
    dtype,
    head_size,
    block_size,
    num_heads,
    num_kv_heads,
    spans,
    seed,
    tensor_cores=None,
    table_dtype=torch.int32,
    strided_query=False,
):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks_needed = [-(-context // block_size) for _, context in spans]
    num_blocks = 2 * sum(blocks_needed) + 3
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    key_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    value_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    free = list(range(num_blocks))
    rng.shuffle(free)  # each span's blocks scattered over the cache, never in order
    max_blocks = max(blocks_needed) + 1
    tables = []
    for needed in blocks_needed:
        used = [free.pop() for _ in range(needed)]
        tables.append(used + [rng.randrange(num_blocks) for _ in range(max_blocks - needed)])  # garbage padding
    block_tables = torch.tensor(tables, dtype=table_dtype, device=DEVICE)
    query_lens = [q for q, _ in spans]
    cu = [0]
    for q in query_lens:
        cu.append(cu[-1] + q)
    total = cu[-1]
    if strided_query:  # the query part of a fused qkv: rows at a token stride wider than num_heads * head_size
        qkv = torch.randn(total, num_heads + 2 * num_kv_heads, head_size, dtype=dtype, device=DEVICE)
        query = qkv[:, :num_heads]
    else:
        query = torch.randn(total, num_heads, head_size, dtype=dtype, device=DEVICE)
    scale = head_size**-0.5
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor([c for _, c in spans], dtype=torch.int32, device=DEVICE)
    out = torch.full((total, num_heads, head_size), float("nan"), dtype=dtype, device=DEVICE)
    result = kernels.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        cu_seqlens,
        context_lens,
        block_tables,
        scale,
        max(query_lens),
        out=out,
        tensor_cores=tensor_cores,
    )
    assert result is out
    assert not out.isnan().any(), "an output element was not written"
    for s, (query_len, context_len) in enumerate(spans):
        ids = block_tables[s, : blocks_needed[s]].long()
        ref = torch_ops.paged_attention_prefill(
            query[cu[s] : cu[s + 1]].float(), key_cache.float(), value_cache.float(), ids, context_len, scale
        )
        error = relative_error(out[cu[s] : cu[s + 1]], ref)
        assert error <= TOLERANCE[dtype], (s, query_len, context_len, error)


def kernels_for(dtype):
    return [None] if dtype == torch.float32 else [None, False]


@pytest.mark.pairwise
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
@pytest.mark.parametrize(
    "dtype, tensor_cores",
    [(d, t) for d in DTYPES for t in kernels_for(d)],
    ids=lambda v: str(v) if isinstance(v, torch.dtype) else {None: "auto", False: "fma"}[v],
)
def test_mixed_spans_in_one_call_match_torch(dtype, tensor_cores, head_size, block_size):
    prefill_case(
        dtype,
        head_size,
        block_size,
        num_heads=8,
        num_kv_heads=2,
        spans=MIXED,
        seed=head_size + block_size,
        tensor_cores=tensor_cores,
    )


@pytest.mark.pairwise
@pytest.mark.parametrize(
    "num_heads, num_kv_heads",
    [(8, 8), (16, 4), (32, 4), (12, 2), (32, 1), (96, 1)],
    ids=["mha", "gqa4", "gqa8", "gqa6", "mqa32", "mqa96"],
)
@pytest.mark.parametrize(
    "dtype, tensor_cores",
    [(d, t) for d in DTYPES for t in kernels_for(d)],
    ids=lambda v: str(v) if isinstance(v, torch.dtype) else {None: "auto", False: "fma"}[v],
)
def test_head_layouts_match_torch(dtype, tensor_cores, num_heads, num_kv_heads):
    # gqa6: 64 // 6 tokens per tile leaves rows unused; mqa96: more heads than a tile's rows, one head per block
    prefill_case(dtype, 128, 16, num_heads, num_kv_heads, spans=[(70, 70), (3, 90), (33, 161)], seed=num_heads)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_chunk_over_a_long_context(dtype, head_size):
    # the shape gpu_check times: 512 query tokens over 2048 (here 4 query heads per KV head); on the host, where
    # the kernels run thread by thread, a smaller one of as many tiles in each direction as a GPU block has
    spans = [(150, 700), (70, 70)] if ON_HOST else [(512, 2048), (300, 300)]
    prefill_case(dtype, head_size, 16, 16, 4, spans=spans, seed=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int64_tables_and_query_rows_strided_out_of_qkv(dtype):
    prefill_case(dtype, 128, 32, 8, 2, spans=MIXED, seed=11, table_dtype=torch.int64, strided_query=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_outside_the_spans_are_untouched(dtype):
    torch.manual_seed(2)
    key_cache = torch.randn(8, 2, 16, 64, dtype=dtype, device=DEVICE)
    value_cache = torch.randn_like(key_cache)
    query = torch.randn(10, 4, 64, dtype=dtype, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    cu = torch.tensor([3, 7, 9], dtype=torch.int32, device=DEVICE)  # rows 0-2 (decodes) and 9 are not spans'
    lens = torch.tensor([20, 2], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([[5, 1], [6, 0]], dtype=torch.int32, device=DEVICE)
    kernels.paged_prefill_attention(query, key_cache, value_cache, cu, lens, tables, 0.125, 4, out=out)
    assert out[:3].isnan().all() and out[9].isnan().all() and not out[3:9].isnan().any()
    ref = torch_ops.paged_attention_prefill(
        query[3:7].float(), key_cache.float(), value_cache.float(), tables[0].long(), 20, 0.125
    )
    assert relative_error(out[3:7], ref) <= TOLERANCE[dtype]


def test_whole_prompt_matches_sdpa_over_its_fresh_keys():
    """A span with nothing cached before it reads back what reshape_and_cache wrote this step, and matches
    SDPA over the step's own K/V (the path the torch backend takes)."""
    torch.manual_seed(4)
    num_tokens, block_size = 150, 16
    key = torch.randn(num_tokens, 2, 128, dtype=torch.float16, device=DEVICE)
    value = torch.randn_like(key)
    query = torch.randn(num_tokens, 8, 128, dtype=torch.float16, device=DEVICE)
    key_cache = torch.full((40, 2, block_size, 128), float("nan"), dtype=torch.float16, device=DEVICE)
    value_cache = key_cache.clone()
    ids = torch.randperm(40, device=DEVICE)[:10]
    positions = torch.arange(num_tokens, device=DEVICE)
    kernels.reshape_and_cache(
        key, value, key_cache, value_cache, ids[positions // block_size] * block_size + positions % block_size
    )
    out = kernels.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE),
        torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE),
        ids[None],
        128**-0.5,
        num_tokens,
    )
    ref = torch_ops.prefill_attention(query.float(), key.float(), value.float(), 128**-0.5)
    assert relative_error(out, ref) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("seed", range(3))
def test_cuda_backend_step_matches_the_torch_backend(seed):
    """AttentionBackend.forward on CUDA (decodes in one call, every prefill span in one varlen call) against
    the torch backend's per-span loop on the same mixed step, fp32 on both."""
    query, key, value, key_cache, value_cache, meta = random_step(seed, head_dim=64, block_size=8)

    def to_cuda(t):
        return t.to(DEVICE)

    cuda_meta = dataclasses.replace(
        meta,
        slot_mapping=to_cuda(meta.slot_mapping),
        decode_block_tables=to_cuda(meta.decode_block_tables),
        decode_context_lens=to_cuda(meta.decode_context_lens),
        varlen_cache={},
        prefills=[dataclasses.replace(s, block_ids=to_cuda(s.block_ids)) for s in meta.prefills],
    )
    expected = TORCH.forward(query, key, value, key_cache.clone(), value_cache.clone(), meta, 64**-0.5)
    backend = cuda_backend()
    kc, vc = to_cuda(key_cache), to_cuda(value_cache)
    out = backend.forward(to_cuda(query), to_cuda(key), to_cuda(value), kc, vc, cuda_meta, 64**-0.5)
    assert cuda_meta.varlen_prefill(8) is not None  # the prefills ran as one packed batch
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)
