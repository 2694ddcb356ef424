"""The piecewise forward (raypaged/worker/piecewise_graphs.py) without graphs, on the CPU: the
pieces run eagerly over padded token buckets, the attention between them on the real rows.
It must give the normal forward's bits, hidden states and caches, for the plain path and for
the fused path (its ops the torch references, as in tests/model/test_fused_path.py),
and its padding rows must write nothing. The graphs themselves: tests/gpu/test_piecewise_graphs.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from raypaged.attention.backend import TORCH
from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.worker.graph_sizes import token_buckets
from raypaged.worker.piecewise_graphs import PiecewiseGraphs
from tests import fused_reference as ref

BLOCK_SIZE, NUM_BLOCKS = 8, 12  # block 11 is no sequence's: a slot -1 written by mistake lands in it
BLOCK_IDS = {"a": [5, 2, 8], "b": [0, 7], "c": [3, 9], "d": [1, 6]}
# per step: (sequence, first position, tokens, a decode), decodes first as the runner orders them
STEPS = [
    [("a", 0, 9, False), ("b", 0, 6, False)],  # two whole prompts, 15 tokens in a bucket of 16
    [("b", 6, 1, True), ("a", 9, 3, False), ("c", 0, 5, False)],  # a chunk over 9 cached tokens, a prompt
    [("a", 12, 1, True), ("b", 7, 1, True), ("c", 5, 1, False), ("d", 0, 1, False)],  # 1-token spans
    [("a", 13, 1, True), ("b", 8, 1, True), ("c", 6, 1, True), ("d", 1, 13, False)],  # 16: no padding
    [("a", 14, 1, True), ("b", 9, 1, True), ("c", 7, 1, True), ("d", 14, 1, True)],  # decodes only
]
MAX_NUM_BATCHED_TOKENS = 20  # buckets 8, 16, 20


def step_inputs(step, generator: torch.Generator, vocab_size: int, device: str = "cpu"):
    ids, positions, slots, decodes, prefills, start = [], [], [], [], [], 0
    for seq, first, count, decode in step:
        blocks = BLOCK_IDS[seq]
        span = list(range(first, first + count))
        positions += span
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
        if decode:
            decodes.append((blocks[: -(-(first + 1) // BLOCK_SIZE)], first + 1))
        else:
            used = blocks[: -(-(first + count) // BLOCK_SIZE)]
            prefills.append(PrefillSpan(start, count, first + count, torch.tensor(used, device=device)))
        start += count
    width = max((len(b) for b, _ in decodes), default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        num_decode_tokens=len(decodes),
        decode_block_tables=torch.tensor(
            [b + [0] * (width - len(b)) for b, _ in decodes], dtype=torch.long, device=device
        ).view(len(decodes), width),
        decode_context_lens=torch.tensor([n for _, n in decodes], dtype=torch.long, device=device),
        prefills=prefills,
    )
    ids = torch.randint(0, vocab_size, (start,), generator=generator).to(device)
    return ids, torch.tensor(positions, device=device), meta


def new_caches(model, fill: float, device: str = "cpu"):
    attn = model.model.layers[0].self_attn
    shape = (NUM_BLOCKS, attn.num_kv_heads, BLOCK_SIZE, attn.head_dim)
    like = dict(dtype=model.model.norm.weight.dtype, device=device)
    return [(torch.full(shape, fill, **like), torch.full(shape, fill, **like)) for _ in model.model.layers]


def test_buckets_are_capped_at_512_and_at_the_step_budget():
    assert token_buckets(8192) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert token_buckets(512)[-1] == 512 and len(token_buckets(512)) == 12
    assert token_buckets(100) == [8, 16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(20) == [8, 16, 20]
    assert token_buckets(5) == [5]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_piecewise_forward_on_padded_buckets_gives_the_forward_bits(architecture, fused):
    model = ref.random_model(ref.tiny_config(architecture), torch.float32, "cpu")
    model.set_attention_backend(ref.fused_torch_backend() if fused else TORCH)
    normal_caches, piece_caches = new_caches(model, 0.0), new_caches(model, 0.0)
    pieces = PiecewiseGraphs(model, piece_caches, MAX_NUM_BATCHED_TOKENS, torch.device("cpu"))
    assert pieces.buckets == [8, 16, 20] and pieces.num_pieces == 3 and not pieces.graphs
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for index, step in enumerate(STEPS):
            ids, positions, meta = step_inputs(step, generator, model.config.vocab_size)
            expected = model(ids, positions, normal_caches, meta)
            assert pieces.fits(len(ids))
            got = pieces.run(ids, positions, meta)
            assert got.shape == expected.shape
            assert torch.equal(got, expected), f"step {index}"
            for (k1, v1), (k2, v2) in zip(normal_caches, piece_caches):
                assert torch.equal(k1, k2) and torch.equal(v1, v2), f"step {index}"
    assert all(k.abs().sum() > 0 for k, _ in piece_caches)
    assert pieces.replays == 0  # no graphs: the pieces ran eagerly
    assert not pieces.fits(MAX_NUM_BATCHED_TOKENS + 1)


def test_padding_rows_write_nothing_into_the_cache():
    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    model.set_attention_backend(TORCH)
    caches = new_caches(model, 7.0)  # every slot holds 7 until a real token writes it
    pieces = PiecewiseGraphs(model, caches, MAX_NUM_BATCHED_TOKENS, torch.device("cpu"))
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for step in STEPS[:3]:  # 15, 9 and 4 tokens: 1, 7 and 4 padding rows
            ids, positions, meta = step_inputs(step, generator, model.config.vocab_size)
            pieces.run(ids, positions, meta)
            written[meta.slot_mapping] = True
            bucket = next(b for b in pieces.buckets if b >= len(ids))
            assert bucket > len(ids) and pieces.slot_mapping[len(ids) : bucket].eq(-1).all()
    for key_cache, value_cache in caches:
        for cache in (key_cache, value_cache):
            slots = cache.transpose(1, 2).reshape(NUM_BLOCKS * BLOCK_SIZE, -1)  # [slot, heads * head_dim]
            assert slots[~written].eq(7.0).all()
            assert slots[written].ne(7.0).any(dim=1).all()


def test_the_runner_sends_steps_with_prefill_spans_that_fit_to_the_pieces(monkeypatch):
    """Decode-only steps and steps past the largest bucket run the plain forward; every other step
    runs the pieces; the greedy tokens are the plain forward's either way."""
    from raypaged.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from raypaged.sampling_params import SamplingParams
    from raypaged.worker.cache import KVCache
    from raypaged.worker.model_runner import ModelRunner

    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    model.set_attention_backend(TORCH)
    attn = model.model.layers[0].self_attn
    cpu = torch.device("cpu")

    def new_runner():
        cache = KVCache(
            len(model.model.layers), NUM_BLOCKS, 0, (attn.num_kv_heads, BLOCK_SIZE, attn.head_dim), torch.float32, cpu
        )
        return ModelRunner(model, cache, BLOCK_SIZE, eos_token_id=None, seed=0, device=cpu)

    plain, pieced = new_runner(), new_runner()
    pieced.piecewise = PiecewiseGraphs(model, pieced.cache.layers, MAX_NUM_BATCHED_TOKENS, cpu)
    ran: list[int] = []
    run = pieced.piecewise.run
    monkeypatch.setattr(pieced.piecewise, "run", lambda ids, *args: ran.append(len(ids)) or run(ids, *args))
    prompts = {"a": list(range(3, 15)), "b": [9, 8, 7, 6, 5], "c": list(range(40, 64)), "d": [4, 44, 4]}
    blocks = {"a": [5, 2], "b": [0, 7], "c": [3, 9, 10, 4], "d": [1]}
    # (request, tokens) per step; a new request's first entry starts it
    schedule = [
        {"a": 9, "b": 5},
        {"b": 1, "a": 3},
        {"a": 1, "b": 1},
        {"a": 1, "b": 1, "c": 24},
        {"a": 1, "b": 1, "c": 1, "d": 3},
    ]
    computed: dict[str, int] = {}
    unsent: dict[str, list[int]] = {}
    for step in schedule:
        so = SchedulerOutput(num_scheduled_tokens=dict(step))
        for rid in step:
            if rid not in computed:
                so.new_requests.append(
                    NewRequestData(rid, prompts[rid], [], SamplingParams(temperature=0), blocks[rid], 0)
                )
                computed[rid] = 0
            else:
                so.cached_requests.append(CachedRequestData(rid, unsent.pop(rid, []), [], computed[rid]))
        outs = [runner.execute_model(so) for runner in (plain, pieced)]
        tokens = [{rid: token.token_id for rid, token in out.sampled.items()} for out in outs]
        assert tokens[0] == tokens[1]
        for rid, token in outs[0].sampled.items():
            unsent[rid] = [token.token_id]
        for rid, n in step.items():
            computed[rid] += n
    assert ran == [14, 4, 6]  # not the decode-only step, nor the one of 26 tokens
    assert pieced.piecewise.replays == 0


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: remembers the piece captured into it, and
    replaying runs that piece eagerly. Checks what capture records and what a step replays."""

    capturing: FakeGraph | None = None
    pools: list = []  # the pool each capture was given

    def __init__(self) -> None:
        self.piece = None

    def pool(self):
        return "pool"

    def replay(self) -> None:
        run_piece, tokens, index = self.piece
        run_piece(tokens, index)


@contextlib.contextmanager
def fake_capture(graph: FakeGraph, pool=None):
    FakeGraph.pools.append(pool)
    FakeGraph.capturing = graph
    yield
    FakeGraph.capturing = None


def test_capture_records_every_bucket_and_piece_and_a_step_replays_its_buckets(monkeypatch):
    class Stream:
        def wait_stream(self, other) -> None:
            pass

    for name, fake in dict(
        CUDAGraph=FakeGraph,
        graph=fake_capture,
        Stream=Stream,
        current_stream=Stream,
        stream=lambda s: contextlib.nullcontext(),
        mem_get_info=lambda: (0, 0),
        synchronize=lambda: None,
    ).items():
        monkeypatch.setattr(torch.cuda, name, fake)
    monkeypatch.setattr(FakeGraph, "pools", [])
    model = ref.random_model(ref.tiny_config("qwen3"), torch.float32, "cpu")
    model.set_attention_backend(TORCH)
    normal_caches, piece_caches = new_caches(model, 0.0), new_caches(model, 0.0)
    pieces = PiecewiseGraphs(model, piece_caches, MAX_NUM_BATCHED_TOKENS, torch.device("cpu"))
    run_piece, warm_ups = pieces._piece, []

    def piece(tokens: int, index: int) -> None:
        if FakeGraph.capturing is not None:  # recorded, not run
            FakeGraph.capturing.piece = (run_piece, tokens, index)
        else:
            warm_ups.append((tokens, index))
            run_piece(tokens, index)

    monkeypatch.setattr(pieces, "_piece", piece)
    pieces.capture(pool="decode graphs' pool")
    assert FakeGraph.pools == ["decode graphs' pool"] + ["pool"] * (3 * 3 - 1)  # one pool, largest bucket first
    assert {bucket: [g.piece[1:] for g in graphs] for bucket, graphs in pieces.graphs.items()} == {
        bucket: [(bucket, index) for index in range(3)] for bucket in (20, 16, 8)
    }
    assert warm_ups == [(bucket, index) for bucket in (20, 16, 8) for _ in range(2) for index in range(3)]
    warm_ups.clear()
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for _index, step in enumerate(STEPS):
            ids, positions, meta = step_inputs(step, generator, model.config.vocab_size)
            assert torch.equal(pieces.run(ids, positions, meta), model(ids, positions, normal_caches, meta))
    assert not warm_ups and pieces.replays == len(STEPS)
    for (k1, v1), (k2, v2) in zip(normal_caches, piece_caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def attach_random_lora(model, device: torch.device):
    """Three LoRA slots on every target of ``model``: random adapters of ranks 4 and 8 in slots 0
    and 2, slot 1 empty."""
    from raypaged.lora.layers import attach_lora
    from raypaged.model.parallel import TensorParallel

    lora = attach_lora(model, 3, 8, TensorParallel(), torch.float32, device)
    generator = torch.Generator().manual_seed(3)
    for linear in lora.linears.values():
        for slot, rank in ((0, 4), (2, 8)):
            a_t = torch.randn(linear.target.in_features, rank, generator=generator) / linear.target.in_features**0.5
            b_t = torch.randn(rank, linear.target.out_features, generator=generator) * 0.5
            linear.set_slot(slot, (a_t.to(device), b_t.to(device)))
    return lora


def lora_slots(step_index: int, num_tokens: int) -> list[int | None]:
    """The slots of step ``step_index``'s tokens: the base model, an empty slot and both adapters, in turn."""
    return [(None, 0, 1, 2)[(i + step_index) % 4] for i in range(num_tokens)]


def test_pieces_recording_lora_give_the_forward_bits_for_any_slots():
    """With the LoRA product recorded (BGMV, each row's slot read from a static buffer), the pieces
    over padded buckets equal the forward under the step's BGMV mapping, and the per-slot matmul
    path within rounding; the padding rows read no adapter."""
    from raypaged.lora.ops import build_bgmv_mapping, build_lora_mapping

    model = ref.random_model(ref.tiny_config("llama"), torch.float32, "cpu")
    model.set_attention_backend(TORCH)
    lora = attach_random_lora(model, torch.device("cpu"))
    caches = {name: new_caches(model, 0.0) for name in ("bgmv", "segments", "pieces", "base")}
    pieces = PiecewiseGraphs(model, caches["pieces"], MAX_NUM_BATCHED_TOKENS, torch.device("cpu"), lora.step)
    assert pieces.records_lora
    inputs = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for index, step in enumerate(STEPS):
            ids, positions, meta = step_inputs(step, inputs, model.config.vocab_size)
            token_slots = lora_slots(index, len(ids))
            lora.step.mapping = build_lora_mapping(token_slots)
            by_segments = model(ids, positions, caches["segments"], meta).clone()
            lora.step.mapping = build_bgmv_mapping(token_slots)
            expected = model(ids, positions, caches["bgmv"], meta).clone()
            got = pieces.run(ids, positions, meta)
            assert torch.equal(got, expected), f"step {index}"
            torch.testing.assert_close(got, by_segments, rtol=1e-5, atol=1e-5)
            bucket = next(b for b in pieces.buckets if b >= len(ids))
            assert pieces.lora.slot_of[:bucket].tolist() == [-1 if s is None else s for s in token_slots] + [-1] * (
                bucket - len(ids)
            )
            assert lora.step.mapping.slot_of is not None  # the step's mapping is back after the pieces
            if index == 0:  # the adapters matter
                lora.step.mapping = None
                base = model(ids, positions, caches["base"], meta)
                adapted = torch.tensor([s in (0, 2) for s in token_slots])
                assert (got - base).abs().amax(dim=1)[adapted].min() > 1e-2
