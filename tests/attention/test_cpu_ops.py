"""The CPU decode kernel (``cpu_decode.c`` through ``cpu_ops``) against the torch path it replaces, its
argument checks and exact errors, its build (cache key, missing or failing compiler) and its thread pool."""

import subprocess
import sys

import pytest
import torch

from raypaged.attention import cpu_ops, torch_ops
from tests.conftest import use_kernels_without_avx512

# SmolLM2's attention shape: 9 query heads over 3 KV heads of 64
NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 400, 9, 3, 64


def random_step(seed, lens, block_size=16, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    """A cache of stale garbage, shuffled block tables wide enough for the longest context (padded with
    block 0) and the query as the model has it: a strided view of its fused qkv rows."""
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randn(NUM_BLOCKS, num_kv_heads, block_size, head_dim, generator=gen) * 3
    value_cache = torch.randn(NUM_BLOCKS, num_kv_heads, block_size, head_dim, generator=gen)
    lens = torch.tensor(lens, dtype=torch.long)
    width = int(-(-lens.max() // block_size))
    ids = torch.randperm(NUM_BLOCKS, generator=gen)
    tables, taken = torch.zeros(len(lens), width, dtype=torch.long), 0
    for row, length in enumerate(lens.tolist()):
        used = -(-length // block_size)
        tables[row, :used] = ids[taken : taken + used]
        taken += used
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv[:, : num_heads * head_dim].view(len(lens), num_heads, head_dim)
    return query, key_cache, value_cache, tables, lens


@pytest.mark.parametrize(
    ("lens", "block_size"),
    [
        ([1, 2, 15, 16, 17, 100, 250], 16),  # one token, partial and whole blocks
        ([511, 512, 513, 1300], 16),  # around the 512-token partition and a 3-partition sequence
        ([7, 33, 900], 8),
        ([5, 64, 130], 32),
        ([300], 16),  # one sequence alone: split into 48-token partitions so that every thread has work
    ],
)
def test_decode_equals_the_torch_path(lens, block_size):
    query, key_cache, value_cache, tables, lens = random_step(len(lens) + block_size, lens, block_size)
    expected = torch_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (8, 1, 64), (12, 2, 128), (6, 3, 20)])
def test_decode_head_layouts(num_heads, num_kv_heads, head_dim):
    """Multi-head, one KV head for eight, a head of 128, and a head size with no 8-wide path (scalar loops)."""
    query, key_cache, value_cache, tables, lens = random_step(3, [3, 40, 600], 16, num_heads, num_kv_heads, head_dim)
    expected = torch_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 8},  # inside one block
        {"sliding_window": 600},  # over partitions of several blocks
        {"chunk": 64},
        {"sinks": "random"},
        {"softcap": 5.0},
        {"sliding_window": 40, "sinks": "random", "softcap": 3.0},
        {"chunk": 256, "sinks": "random"},
    ],
)
def test_decode_options_equal_the_torch_path(options):
    """Gemma's and gpt-oss's windows, Llama 4's chunks, gpt-oss's sinks and Gemma 2's soft-capping, in contexts of one
    token, of one block and of several partitions (the window's start inside a block)."""
    query, key_cache, value_cache, tables, lens = random_step(7, [1, 13, 100, 700, 1500], 16, 6, 2, 64)
    if options.get("sinks") == "random":
        options = {**options, "sinks": torch.randn(6, generator=torch.Generator().manual_seed(3))}
    expected = torch_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, **options)
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125, **options)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.fixture
def avx2_build(monkeypatch):
    """The kernels built without AVX-512: where a machine has it, the 16-wide loops run otherwise; this
    runs the 8-wide ones, as AVX2-only machines do."""
    use_kernels_without_avx512(monkeypatch)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 1, 64), (12, 2, 128), (6, 3, 24)])
def test_the_avx2_path_equals_the_torch_path(num_heads, num_kv_heads, head_dim, avx2_build):
    query, key_cache, value_cache, tables, lens = random_step(
        7, [1, 17, 300, 700], 16, num_heads, num_kv_heads, head_dim
    )
    expected = torch_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_score_far_above_the_rest_takes_all_the_weight_wherever_it_lies(where):
    """Scores of 0 and one of 89.5, at the start, in the middle or at the end of a partition (44 tokens: the
    16-wide max and its remainder): the softmax must subtract the true max (exp(89.5) overflows fp32), so the
    output is that token's V row."""
    query, key_cache, value_cache, tables, lens = random_step(9, [44, 44], 16)
    key_cache.zero_()
    token = {"first": 0, "middle": 31, "last": 43}[where]
    for seq in range(2):
        block, slot = tables[seq, token // 16], token % 16
        firsts = query[seq].view(NUM_KV_HEADS, -1, HEAD_DIM)[:, 0]  # query head 0 of each KV head
        key_cache[block, :, slot] = firsts * 716 / (firsts**2).sum(-1, keepdim=True)  # its score: 716 * 0.125
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    assert out.isfinite().all()
    for seq in range(2):
        block, slot = tables[seq, token // 16], token % 16
        torch.testing.assert_close(out[seq, ::3], value_cache[block, :, slot], rtol=0, atol=1e-6)


def test_decode_is_the_same_on_one_thread_and_two():
    """Each work item is computed whole by one thread: the result does not depend on the thread count."""
    query, key_cache, value_cache, tables, lens = random_step(4, [1, 90, 700, 1500, 30], 16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
        torch.set_num_threads(2)
        two = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_decode_reads_only_the_blocks_in_use():
    """Block-table padding past a context (here an id far outside the cache) is never read, and
    garbage in the unused slots of a context's last block changes nothing."""
    query, key_cache, value_cache, tables, lens = random_step(5, [20, 3], 16)
    expected = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    tables[1, 1] = 10**9
    key_cache[tables[0, 1], :, 4:] = float("nan")
    value_cache[tables[1, 0], :, 3:] = float("inf")
    assert torch.equal(cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125), expected)


def test_decode_errors():
    query, key_cache, value_cache, tables, lens = random_step(6, [20, 40], 16)
    decode = cpu_ops.paged_attention_decode
    with pytest.raises(ValueError, match=r"^a context length \(40\) is beyond its block table \(2 blocks of 16\)$"):
        decode(query, key_cache, value_cache, tables[:, :2], lens, 0.125)
    bad = tables.clone()
    bad[1, 2] = NUM_BLOCKS
    with pytest.raises(ValueError, match=r"^a block table holds a block id outside the cache's 400 blocks$"):
        decode(query, key_cache, value_cache, bad, lens, 0.125)
    bad[1, 2] = -1
    with pytest.raises(ValueError, match=r"^a block table holds a block id outside the cache's 400 blocks$"):
        decode(query, key_cache, value_cache, bad, lens, 0.125)
    with pytest.raises(
        ValueError,
        match=r"^the CPU decode kernel reads a float32 query from float32, float8_e4m3fn or "
        r"bfloat16 caches, got query torch.bfloat16, caches torch.float32 and "
        r"torch.float32$",
    ):
        decode(query.bfloat16(), key_cache, value_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match=r"caches torch.float8_e5m2 and torch.float8_e5m2$"):
        decode(query, key_cache.to(torch.float8_e5m2), value_cache.to(torch.float8_e5m2), tables, lens, 0.125)
    with pytest.raises(ValueError, match=r"caches torch.float8_e4m3fn and torch.float32$"):
        decode(query, key_cache.to(torch.float8_e4m3fn), value_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match=r"^query \(2, 9, 64\) does not fit caches \(400, 2, 16, 64\)"):
        decode(query, key_cache[:, :2].contiguous(), value_cache[:, :2].contiguous(), tables, lens, 0.125)
    with pytest.raises(ValueError, match="^the CPU decode kernel needs contiguous caches"):
        decode(query, key_cache.transpose(2, 3).contiguous().transpose(2, 3), value_cache, tables, lens, 0.125)
    with pytest.raises(ValueError, match="^block tables and context lengths must be long, got torch.int32"):
        decode(query, key_cache, value_cache, tables.int(), lens, 0.125)
    with pytest.raises(ValueError, match=r"^2 queries but block tables \(1, 3\) and context lengths \(2,\)$"):
        decode(query, key_cache, value_cache, tables[:1], lens, 0.125)


def test_build_is_cached_by_source_flags_compiler_and_cpu(tmp_path, monkeypatch):
    """A fresh cache folder gets one built library; a second process finds it there and builds nothing."""
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path))
    script = (
        "from raypaged.attention import cpu_ops; import os; lib = cpu_ops.library(); "
        "print(sorted(os.listdir(os.path.join(os.environ['RAYPAGED_CACHE_DIR'], 'cpu_kernels'))))"
    )
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    built = list((tmp_path / "cpu_kernels").iterdir())
    assert len(built) == 1 and built[0].name.startswith("cpu_kernels-") and built[0].suffix == ".so"
    mtime = built[0].stat().st_mtime_ns
    second = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert first == second == f"{[built[0].name]}\n" and built[0].stat().st_mtime_ns == mtime


@pytest.mark.parametrize(
    ("cc", "reason"),
    [
        ("no-such-compiler", "^no C compiler found \\(set \\$CC, or install gcc\\)$"),
        (
            "false",
            "^false failed to build cpu_decode.c, cpu_prefill.c, cpu_fused.c, cpu_int8.c, cpu_gemm.c, cpu_step.c and "
            "cpu_sample.c: $",
        ),
    ],
)
def test_without_a_working_compiler_the_reason_is_given(tmp_path, monkeypatch, cc, reason):
    monkeypatch.setenv("RAYPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", cc)
    cpu_ops.library.cache_clear()
    try:
        assert cpu_ops.unavailable_reason() is not None
        with pytest.raises(cpu_ops.KernelUnavailable, match=reason):
            cpu_ops.library()
        assert not list((tmp_path / "cpu_kernels").glob("*.so")) if (tmp_path / "cpu_kernels").exists() else True
    finally:
        cpu_ops.library.cache_clear()


def test_the_kernel_shares_torchs_openmp_runtime():
    """Loading the kernel maps no second OpenMP runtime: one libgomp, torch's, serves both."""
    cpu_ops.library()
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "gomp" in line.rsplit("/", 1)[-1]}
    assert len(runtimes) == 1 and next(iter(runtimes)).startswith(torch.__path__[0]), runtimes


def prefill_step(seed, spans, block_size=16, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM):
    """Spans of (query_len, context_len) over a cache of garbage and shuffled block tables (padded with block 0),
    the query a strided view of fused qkv rows; the varlen inputs as ``build_varlen_prefill`` makes them."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = max(NUM_BLOCKS, sum(-(-c // block_size) for _, c in spans) + 16)
    key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen) * 3
    value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)
    tables, taken = torch.zeros(len(spans), max(-(-c // block_size) for _, c in spans), dtype=torch.long), 0
    for row, (_, context_len) in enumerate(spans):
        used = -(-context_len // block_size)
        tables[row, :used] = ids[taken : taken + used]
        taken += used
    tokens = sum(q for q, _ in spans)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    cu = torch.tensor([0, *torch.tensor([q for q, _ in spans]).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor([c for _, c in spans], dtype=torch.int32)
    return query, key_cache, value_cache, cu, context_lens, tables


def prefill_reference(query, key_cache, value_cache, cu, context_lens, tables, scale):
    """The torch backend's per-span path: gather each span's blocks, causal SDPA with its prefix visible."""
    block_size = key_cache.shape[2]
    return torch.cat(
        [
            torch_ops.paged_attention_prefill(
                query[cu[s] : cu[s + 1]],
                key_cache,
                value_cache,
                tables[s, : -(-int(length) // block_size)],
                int(length),
                scale,
            )
            for s, length in enumerate(context_lens.tolist())
        ]
    )


PREFILL_SPANS = [(5, 5), (40, 40), (17, 100), (1, 33), (130, 130), (16, 16), (33, 600)]


@pytest.mark.parametrize("block_size", [1, 8, 16, 32, 128])
def test_prefill_equals_the_torch_path(block_size):
    """Whole prompts, chunks after a cached prefix (or an earlier chunk), a one-token span, tiles of 16
    tokens and their ragged ends, key chunks of 64 across many blocks and inside one."""
    step = prefill_step(block_size, PREFILL_SPANS, block_size)
    expected = prefill_reference(*step, 0.125)
    out = cpu_ops.paged_prefill_attention(*step, 0.125, 130)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


PREFILL_LAYOUTS = [(4, 4, 64), (8, 1, 64), (12, 2, 128), (6, 3, 20), (10, 2, 64), (100, 2, 16)]


def check_prefill_layout(num_heads, num_kv_heads, head_dim):
    step = prefill_step(8, [(3, 3), (20, 45), (70, 70)], 16, num_heads, num_kv_heads, head_dim)
    expected = prefill_reference(*step, head_dim**-0.5)
    out = cpu_ops.paged_prefill_attention(*step, head_dim**-0.5, 70)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), PREFILL_LAYOUTS)
def test_prefill_head_layouts(num_heads, num_kv_heads, head_dim):
    """Multi-head, one KV head for eight, a head of 128, a head size that is not a whole number of vectors,
    5 query heads a KV head (tiles of 9 tokens: 45 rows and padding) and 50 (a tile of one token, more row
    vectors than one pass takes)."""
    check_prefill_layout(num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), PREFILL_LAYOUTS)
def test_prefill_head_layouts_on_the_avx2_path(num_heads, num_kv_heads, head_dim, avx2_build):
    check_prefill_layout(num_heads, num_kv_heads, head_dim)


def test_prefill_writes_into_out_and_is_the_same_on_one_thread_and_two():
    step = prefill_step(9, PREFILL_SPANS)
    threads = torch.get_num_threads()
    out = torch.full((step[0].shape[0] + 2, NUM_HEADS, HEAD_DIM), 7.0)
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_prefill_attention(*step, 0.125, 130)
        torch.set_num_threads(2)
        assert cpu_ops.paged_prefill_attention(*step, 0.125, 130, out=out[1:-1]).data_ptr() == out[1].data_ptr()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1:-1], one) and (out[0] == 7).all() and (out[-1] == 7).all()


def test_prefill_reads_only_the_blocks_in_use():
    """Padding past a context and the unused slots of its last block are never read."""
    query, key_cache, value_cache, cu, context_lens, tables = step = prefill_step(10, [(20, 20), (3, 35)])
    expected = cpu_ops.paged_prefill_attention(*step, 0.125, 20)
    tables[0, 2] = 10**9
    key_cache[tables[0, 1], :, 4:] = float("nan")
    value_cache[tables[1, 2], :, 3:] = float("inf")
    assert torch.equal(cpu_ops.paged_prefill_attention(*step, 0.125, 20), expected)


def test_prefill_errors():
    query, key_cache, value_cache, cu, context_lens, tables = prefill_step(11, [(20, 20), (5, 40)])
    prefill = cpu_ops.paged_prefill_attention

    def call(**changes):
        args = dict(
            query=query,
            key_cache=key_cache,
            value_cache=value_cache,
            cu_seqlens_q=cu,
            context_lens=context_lens,
            block_tables=tables,
            scale=0.125,
            max_query_len=20,
        )
        return prefill(**{**args, **changes})

    with pytest.raises(
        ValueError,
        match=r"^cu_seqlens_q \[0, 20, 20\] does not ascend within the query's 25 rows "
        r"with at least one token per span$",
    ):
        call(cu_seqlens_q=torch.tensor([0, 20, 20], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^cu_seqlens_q \[0, 20, 26\] does not ascend within the query's 25 rows"):
        call(cu_seqlens_q=torch.tensor([0, 20, 26], dtype=torch.int32))
    with pytest.raises(
        ValueError,
        match=r"^a span's query is longer than its context \(cu_seqlens_q \[0, 20, 25\], "
        r"context_lens \[19, 40\]\)$",
    ):
        call(context_lens=torch.tensor([19, 40], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^a context length \(40\) is beyond its block table \(2 blocks of 16\)$"):
        call(block_tables=tables[:, :2])
    bad = tables.clone()
    bad[1, 2] = NUM_BLOCKS
    with pytest.raises(ValueError, match=r"^a block table holds a block id outside the cache's 400 blocks$"):
        call(block_tables=bad)
    with pytest.raises(
        ValueError,
        match=r"^cu_seqlens_q and context_lens must be int32 and block_tables long, got "
        r"torch.int64, torch.int32 and torch.int64$",
    ):
        call(cu_seqlens_q=cu.long())
    with pytest.raises(
        ValueError,
        match=r"^cu_seqlens_q \(3,\), context_lens \(1,\) and block_tables \(2, 3\) do not "
        r"describe the same spans$",
    ):
        call(context_lens=context_lens[:1])
    with pytest.raises(
        ValueError,
        match=r"^out must be a contiguous float32 tensor of \(25, 9, 64\), got "
        r"torch.float32 \(24, 9, 64\)$",
    ):
        call(out=torch.empty(24, 9, 64))
    with pytest.raises(
        ValueError,
        match=r"^the CPU prefill kernel reads a float32 query from float32, float8_e4m3fn or "
        r"bfloat16 caches, got query torch.bfloat16",
    ):
        call(query=query.bfloat16())


def to_fp8(*caches):
    """Caches narrowed to fp8 e4m3 as the torch path writes them (scale 1)."""
    return tuple(cache.to(torch.float8_e4m3fn) for cache in caches)


@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_over_an_fp8_cache_equals_the_torch_path(block_size):
    """The kernel widens an fp8 e4m3 cache exactly as torch does; long contexts, partitions and head layouts."""
    query, key_cache, value_cache, tables, lens = random_step(12, [1, 15, 100, 700, 1300], block_size)
    key_cache, value_cache = to_fp8(key_cache, value_cache)
    expected = torch_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def test_prefill_over_an_fp8_cache_equals_the_torch_path():
    query, key_cache, value_cache, cu, context_lens, tables = prefill_step(13, PREFILL_SPANS)
    step = (query, *to_fp8(key_cache, value_cache), cu, context_lens, tables)
    torch.testing.assert_close(
        cpu_ops.paged_prefill_attention(*step, 0.125, 130), prefill_reference(*step, 0.125), rtol=1e-5, atol=2e-6
    )


def test_fp8_cache_on_the_avx2_path(avx2_build):
    query, key_cache, value_cache, tables, lens = random_step(14, [3, 200, 600], 16, 12, 2, 128)
    key_cache, value_cache = to_fp8(key_cache, value_cache)
    torch.testing.assert_close(
        cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1),
        torch_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.1),
        rtol=1e-5,
        atol=2e-6,
    )


def to_bf16(*caches):
    """Caches rounded to bf16 as the torch path writes them, and the fp32 caches of the same values."""
    rounded = tuple(cache.to(torch.bfloat16) for cache in caches)
    return rounded, tuple(cache.float() for cache in rounded)


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_decode_over_a_bf16_cache_is_the_fp32_caches_of_its_values_bit_for_bit(build, monkeypatch):
    """A bf16 model's cache (layers.bf16_linears_on_cpu): the kernel widens its rows exactly; long contexts,
    partitions, an odd block size; and a stale NaN beyond every context is never read."""
    if build == "avx2":
        use_kernels_without_avx512(monkeypatch)
    query, key_cache, value_cache, tables, lens = random_step(15, [1, 15, 100, 700, 1300], 8)
    (bf16_k, bf16_v), (fp32_k, fp32_v) = to_bf16(key_cache, value_cache)
    got = cpu_ops.paged_attention_decode(query, bf16_k, bf16_v, tables, lens, 0.125)
    assert torch.equal(got, cpu_ops.paged_attention_decode(query, fp32_k, fp32_v, tables, lens, 0.125))
    assert not torch.equal(got, cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125))


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_prefill_over_a_bf16_cache_is_the_fp32_caches_of_its_values_bit_for_bit(build, monkeypatch):
    if build == "avx2":
        use_kernels_without_avx512(monkeypatch)
    query, key_cache, value_cache, cu, context_lens, tables = prefill_step(16, PREFILL_SPANS)
    (bf16_k, bf16_v), (fp32_k, fp32_v) = to_bf16(key_cache, value_cache)
    got = cpu_ops.paged_prefill_attention(query, bf16_k, bf16_v, cu, context_lens, tables, 0.125, 130)
    fp32 = cpu_ops.paged_prefill_attention(query, fp32_k, fp32_v, cu, context_lens, tables, 0.125, 130)
    assert torch.equal(got, fp32)


def test_every_fp8_code_is_widened_as_torch_widens_it():
    """Over a context of one token the output is that token's V row widened, exactly: two sequences whose rows
    hold each of the 254 finite e4m3 codes (subnormals, the largest, both signs) once or more."""
    check_every_fp8_code()


def test_every_fp8_code_is_widened_as_torch_widens_it_on_the_avx2_path(avx2_build):
    check_every_fp8_code()


def check_every_fp8_code():
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    value_bytes = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, 16, HEAD_DIM, dtype=torch.uint8)
    value_bytes[:2, :, 0] = codes.repeat(2)[: 2 * NUM_KV_HEADS * HEAD_DIM].view(2, NUM_KV_HEADS, HEAD_DIM)
    value_cache = value_bytes.view(torch.float8_e4m3fn)
    key_cache = torch.ones(NUM_BLOCKS, NUM_KV_HEADS, 16, HEAD_DIM).to(torch.float8_e4m3fn)
    query = torch.randn(2, NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(16))
    tables, lens = torch.tensor([[0], [1]]), torch.tensor([1, 1])
    out = cpu_ops.paged_attention_decode(query, key_cache, value_cache, tables, lens, 0.125)
    group = NUM_HEADS // NUM_KV_HEADS
    expected = value_cache[:2, :, 0].float().repeat_interleave(group, dim=1)  # [2, heads, head_dim]
    assert torch.equal(out, expected)  # value for value (-0.0 comes out as 0.0: the output is a sum from 0.0)
