"""The sampler: the greedy fast path and the CPU draw in C equal the general path, and top-k/top-p rows equal a full
sort of each row."""

import dataclasses

import pytest
import torch

from raypaged.sampling_params import PROCESSED_LOGPROBS, RAW_LOGPROBS, SamplingParams
from raypaged.worker import sampler
from raypaged.worker.sampler import SamplingInput, greedy_fast_path, sample


def inputs(params: SamplingParams, rows: int, output_len: int = 3) -> list[SamplingInput]:
    return [SamplingInput(params, [5, 6, 7], list(range(10, 10 + output_len)), 2) for _ in range(rows)]


def test_greedy_fast_path_equals_sample():
    """The same tokens as the general path; on CPU the logprob comes from cpu_sample.c's sum, within
    float rounding of log_softmax's (and closer to the float64 value than it)."""
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 4
    batch = inputs(SamplingParams(temperature=0.0, max_tokens=8), 6)
    fast = greedy_fast_path(logits, batch)
    general = sampler._sample_in_torch(logits, batch, torch.Generator().manual_seed(0), RAW_LOGPROBS, False)
    assert [(t.token_id, t.top_logprobs) for t in fast] == [(t.token_id, t.top_logprobs) for t in general]
    assert [t.token_id for t in fast] == logits.argmax(-1).tolist()
    assert [t.logprob for t in fast] == pytest.approx([t.logprob for t in general], abs=2e-6)
    exact = torch.log_softmax(logits.double(), -1).amax(-1).tolist()
    assert [t.logprob for t in fast] == pytest.approx(exact, abs=1e-6)


@pytest.mark.skipif(sampler._greedy_kernel() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 33, 1000, 49152])
def test_cpu_greedy_kernel_takes_the_first_max_at_every_vocab_edge(vocab):
    """Rows of few distinct values (many ties) and every tail length: torch.argmax's first occurrence,
    and the max's log-probability as float64 log_softmax gives it; rows that skip every other value of
    a wider tensor (a row stride past the vocabulary) too; strided columns are left to torch."""
    generator = torch.Generator().manual_seed(vocab)
    wide = torch.randint(0, 4, (40, 2 * vocab), generator=generator).float() * 1.5
    assert sampler._greedy_on_cpu(wide[:, ::2]) is None
    for logits in (wide[:, :vocab].contiguous(), wide[:, :vocab]):
        token_ids, logprobs = sampler._greedy_on_cpu(logits) or ([], [])  # [] when it declines
        assert token_ids == logits.argmax(-1).tolist()
        assert logprobs == pytest.approx(torch.log_softmax(logits.double(), -1).amax(-1).tolist(), abs=1e-6)


@pytest.mark.skipif(sampler._greedy_kernel() is None, reason="the CPU kernels do not build here")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["first", "last", "every"])
def test_cpu_greedy_kernel_leaves_rows_with_nan_or_inf_to_torch(bad, where):
    """A row whose max or sum is not finite goes to torch's argmax and log_softmax; one whose chosen logprob is
    then NaN goes to the general path (which names a row of -inf alone: nothing can be drawn from it); a -inf
    that is not the max changes nothing."""
    logits = torch.randn(3, 100)
    column = {"first": [0], "last": [99], "every": slice(None)}[where]
    logits[1, column] = bad
    torch_path = (logits.argmax(-1).tolist(), torch.log_softmax(logits, -1).amax(-1).tolist())
    batch = inputs(SamplingParams(temperature=0.0), 3)
    fast = greedy_fast_path(logits, batch)
    if bad == float("-inf") and where != "every":
        assert sampler._greedy_on_cpu(logits) is not None
        assert [t.token_id for t in fast] == torch_path[0]
        return
    assert sampler._greedy_on_cpu(logits) is None
    assert fast is None
    if bad == float("-inf"):
        with pytest.raises(sampler.NoTokenLeft) as raised:  # (as a grammar's bitmask leaves a row)
            sample(logits, batch, torch.Generator(), grammar_masked=True)
        assert raised.value.rows == [1]
    else:
        assert [t.token_id for t in sample(logits, batch, torch.Generator())] == torch_path[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=5, max_tokens=8),
    ],
    ids=["temperature", "logprobs", "repetition", "presence", "frequency", "min_tokens"],
)
def test_greedy_fast_path_declines_what_it_cannot_do(params):
    batch = inputs(SamplingParams(temperature=0.0), 2) + inputs(params, 1)
    assert greedy_fast_path(torch.zeros(3, 50), batch) is None


def reference_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, the plain way: temperature, sort the whole vocabulary, top-k, top-p, min-p."""
    row = logits / p.temperature
    ranked, order = row.sort(descending=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if p.top_k is not None:
        keep[p.top_k :] = False
    probs = ranked.masked_fill(~keep, float("-inf")).softmax(-1)
    keep &= (probs.cumsum(-1) - probs) < p.top_p
    keep[0] = True
    warped = torch.full_like(row, float("-inf"))
    warped[order[keep]] = ranked[keep]
    out = warped.softmax(-1)
    if p.min_p:
        out = out.masked_fill(out < p.min_p * out.max(), 0.0)
    return out


def test_top_k_and_top_p_rows_equal_a_full_sort_of_each_row():
    from raypaged.worker.sampler import _warped

    torch.manual_seed(0)
    logits = torch.randn(7, 500) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.8),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.9, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=600, min_p=0.1),  # k past the vocabulary: every token
        SamplingParams(temperature=0.5, top_p=0.95, min_p=0.05),
    ]
    warped_logits, warped = _warped(logits.clone(), params, cut_logits=True)
    for row, p in enumerate(params):
        assert torch.allclose(warped[row], reference_warp(logits[row], p), atol=1e-6), p
    assert (warped[0] > 0).sum() == 5 and (warped[4] > 0).sum() == 1
    assert torch.equal(warped_logits.isfinite(), warped > 0)  # the logits drawn from: every cut token -inf


def test_top_p_alone_ranks_the_whole_vocabulary_only_when_the_likeliest_fall_short():
    from raypaged.worker import sampler

    torch.manual_seed(1)
    peaked = torch.randn(3, 5000) * 8  # the likeliest 1024 tokens hold almost all the mass
    flat = torch.randn(3, 5000) * 0.01  # they hold about a fifth: the full sort runs
    params = [SamplingParams(temperature=1.0, top_p=q) for q in (0.5, 0.9, 0.99)]
    for logits in (peaked, flat):
        warped = sampler._warped(logits.clone(), params)[1]
        for row, p in enumerate(params):
            assert torch.allclose(warped[row], reference_warp(logits[row], p), atol=1e-6)


def test_each_top_p_row_ranks_only_as_many_tokens_as_its_mass_needs(monkeypatch):
    """One batch of a peaked row (its 64 likeliest tokens suffice), a middling one (its 1,024 do) and a flat one:
    each equals a full sort of its own, and only the flat row sorts the whole vocabulary."""
    torch.manual_seed(2)
    logits = torch.stack([torch.randn(5000) * 8, torch.randn(5000) * 2.5, torch.randn(5000) * 0.01])
    mass = [logits[r].softmax(-1).topk(k).values.sum().item() for r, k in ((0, 64), (1, 64), (1, 1024))]
    assert mass[0] > 0.9 and mass[1] < 0.9 < mass[2]
    sorted_rows = []
    original = torch.Tensor.sort

    def spy(self, *args, **kwargs):
        sorted_rows.append(self.shape[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", spy)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 3
    warped = sampler._warped(logits.clone(), params)[1]
    assert sorted_rows == [1]
    monkeypatch.undo()
    for row, p in enumerate(params):
        assert torch.allclose(warped[row], reference_warp(logits[row], p), atol=1e-6)


def penalties_row_by_row(logits: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
    """Penalties, logit bias, allowed tokens and min_tokens bans one row at a time (the arithmetic
    the batched ops must reproduce to the bit)."""
    vocab = logits.shape[-1]
    for i, s in enumerate(inputs):
        p = s.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(s.prompt_token_ids) | set(s.output_token_ids)), dtype=torch.long)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and s.output_token_ids:
            counts = torch.bincount(torch.tensor(s.output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.allowed_token_ids is not None:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.long)
            kept = logits[i, allowed]
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        for word in p.bad_words_token_ids or []:
            if len(word) == 1 or s.output_token_ids[len(s.output_token_ids) - len(word) + 1 :] == word[:-1]:
                logits[i, word[-1]] = float("-inf")
        if len(s.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + (
                [s.eos_token_id] if s.eos_token_id is not None and not p.ignore_eos else []
            )
            if banned:
                logits[i, banned] = float("-inf")
    return logits


def test_batched_penalties_and_bans_equal_row_by_row_to_the_bit():
    from raypaged.worker.sampler import _apply_penalties

    generator = torch.Generator().manual_seed(0)
    vocab = 300
    inputs = []
    for i in range(12):
        prompt = torch.randint(
            0, vocab, (int(torch.randint(1, 40, (1,), generator=generator)),), generator=generator
        ).tolist()
        output = torch.randint(0, vocab, (i * 3,), generator=generator).tolist()  # repeats, and row 0 empty
        params = SamplingParams(
            repetition_penalty=[1.0, 1.3, 0.7][i % 3],
            presence_penalty=[0.0, 0.5][i % 2],
            frequency_penalty=[0.0, 0.25, -0.4][i % 3],
            logit_bias={7 * i: 1.5, 290 - i: -2.25} if i % 4 == 1 else None,
            allowed_token_ids=[3, 5, 7 * i, 299] if i % 5 == 2 else None,
            min_tokens=16 if i % 3 == 0 else 0,
            stop_token_ids=[11, 12] if i % 2 == 0 else None,
            bad_words_token_ids=[[40 + i], output[-2:] + [250], [299, 298]] if i % 3 == 1 else None,
        )
        inputs.append(SamplingInput(params, prompt, output, eos_token_id=2 if i % 4 else None))
    logits = torch.randn(12, vocab, generator=generator) * 3
    batched = _apply_penalties(logits.clone(), inputs)
    assert torch.equal(batched, penalties_row_by_row(logits.clone(), inputs))
    assert not torch.equal(batched, logits)


def test_logprobs_modes_show_raw_or_processed_logprobs_or_logits_and_keep_the_raw_logprob():
    """vLLM's --logprobs-mode: a greedy row with a repetition penalty and a sampled row with temperature and
    top-k, their logprobs as each mode shows them; the token's own logprob (cumulative logprobs) stays raw."""
    from raypaged.sampling_params import LOGPROBS_MODES

    torch.manual_seed(0)
    logits = torch.randn(2, 50) * 3
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3)
    warm = SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=7)
    batch = [SamplingInput(greedy, [5, 6], [7], None), SamplingInput(warm, [5, 6], [7], None)]
    penalized = logits.clone()
    for token in (5, 6, 7):  # the greedy row's prompt and output tokens, penalized as the sampler does
        value = penalized[0, token]
        penalized[0, token] = value / 1.5 if value > 0 else value * 1.5
    scaled = logits[1] / 0.5
    kept = scaled.topk(2).indices
    drawn = torch.full_like(scaled, float("-inf"))
    drawn[kept] = scaled[kept]
    expected = {
        "raw_logprobs": torch.log_softmax(logits, -1),
        "raw_logits": logits,
        "processed_logits": torch.stack([penalized[0], drawn]),
        "processed_logprobs": torch.log_softmax(torch.stack([penalized[0], drawn]), -1),
    }
    raw = torch.log_softmax(logits, -1)
    for mode in LOGPROBS_MODES:
        tokens = sample(logits, batch, torch.Generator().manual_seed(0), mode)
        assert tokens[0].token_id == int(penalized[0].argmax()) and tokens[1].token_id in kept.tolist()
        for row, token in enumerate(tokens):
            shown = expected[mode][row]
            top = shown.topk(3)
            assert token.logprob == pytest.approx(float(raw[row, token.token_id]), abs=1e-6)
            assert token.top_logprobs[token.token_id].logprob == pytest.approx(float(shown[token.token_id]), abs=1e-5)
            for rank, (value, top_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                entry = token.top_logprobs[top_id]
                assert entry.rank == rank and (
                    entry.logprob == pytest.approx(value, abs=1e-5) or value == entry.logprob
                )


def test_logprob_token_ids_show_the_chosen_and_the_asked_tokens_with_their_own_ranks():
    """Rows asking for tokens get exactly those (and the chosen one), each with its rank in the row; a row
    in the same batch asking for the top 2 still gets its top 2."""
    torch.manual_seed(1)
    logits = torch.randn(2, 50) * 3
    asked = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, logprob_token_ids=[7, 3, 7, 41])
    top = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    first, second = sample(logits, [*inputs(asked, 1), *inputs(top, 1)], torch.Generator().manual_seed(0))
    row = torch.log_softmax(logits[0], -1)
    chosen = int(row.argmax())
    rank = {t: int((row > row[t]).sum()) + 1 for t in range(50)}
    assert list(first.top_logprobs) == list(dict.fromkeys([chosen, 7, 3, 41]))
    for t, entry in first.top_logprobs.items():
        assert (entry.logprob, entry.rank) == (pytest.approx(row[t].item(), abs=1e-6), rank[t])
    assert len(second.top_logprobs) == 2 + (int(logits[1].argmax()) not in logits[1].topk(2).indices.tolist())


def inverse_cdf(row: list[float], u: float) -> int:
    """The first token whose cumulative weight (summed in order, in float64) exceeds u times the row's total."""
    total = sum(row)
    cumulative = 0.0
    for token, weight in enumerate(row):
        cumulative += weight
        if cumulative > u * total:
            return token
    raise AssertionError("no token")


@pytest.mark.parametrize("vocab", [700, 1024, 2500])  # one short block, one whole block, two and a short one
def test_each_unseeded_row_draws_the_inverse_cdf_token_of_its_uniform(vocab):
    """The generator gives one float64 uniform per unseeded row, in row order; the token is the inverse CDF's of
    the row's weights (not summing to one, many of them 0, whole blocks of them too)."""
    rows = 300
    weights = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(1)) ** 4
    weights[weights < 0.3] = 0.0  # most tokens weigh nothing
    weights[: rows // 2, : min(vocab // 2, 1024)] = 0.0  # half the rows: their first block, or half, weigh nothing
    generator = torch.Generator().manual_seed(7)
    uniforms = torch.rand(rows, generator=torch.Generator().manual_seed(7), dtype=torch.float64).tolist()
    drawn = sampler._draw(weights, inputs(SamplingParams(temperature=1.0), rows), generator).tolist()
    expected = [inverse_cdf(row, u) for row, u in zip(weights.double().tolist(), uniforms)]
    assert drawn == expected
    assert all(weights[i, token] > 0 for i, token in enumerate(drawn))


def test_draws_follow_the_probabilities_and_never_take_a_token_of_weight_zero():
    """20,000 draws of one row whose weight sits at block edges: counts pass a chi-square test against the
    probabilities at p = 0.001 (3 degrees of freedom: 16.27), no other token is drawn; a u at the very top of
    [0, 1) still draws a weighted token."""
    row = torch.zeros(3000)
    chosen = {0: 0.1, 1023: 0.2, 1024: 0.3, 2999: 0.4}
    for token, weight in chosen.items():
        row[token] = weight
    draws = sampler._draw(row.expand(20000, -1), inputs(SamplingParams(temperature=1.0), 20000), torch.Generator())
    counts = torch.bincount(draws, minlength=3000)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(chosen)
    chi2 = sum((counts[t].item() - 20000 * w) ** 2 / (20000 * w) for t, w in chosen.items())
    assert chi2 < 16.27, counts[list(chosen)]


def test_a_uniform_at_the_top_of_its_range_draws_the_last_weighted_token(monkeypatch):
    """u = the largest float64 below 1, on a row whose last weighted block's float32 sum (40.0000032) exceeds its
    tokens' float64 one: still the last token of weight above 0, never one of weight 0 after it."""
    original = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: original(*args, **kwargs).fill_(1.0 - 2.0**-53))
    row = torch.zeros(1, 3000)
    row[0, 2048:2448] = 0.1
    assert row[:, 2048:].sum().item() > row[:, 2048:].double().sum().item()
    assert sampler._draw(row, inputs(SamplingParams(temperature=1.0), 1), torch.Generator()).tolist() == [2447]


def test_a_seeded_rows_token_does_not_depend_on_its_batch():
    weights = torch.rand(6, 5000, generator=torch.Generator().manual_seed(2))
    seeded = [SamplingInput(SamplingParams(temperature=1.0, seed=s), [5], [10, 11], 2) for s in range(6)]
    alone = [sampler._draw(weights[i : i + 1], [seeded[i]], torch.Generator()).item() for i in range(6)]
    mixed = inputs(SamplingParams(temperature=1.0), 6)
    batch = [x for pair in zip(seeded, mixed) for x in pair]
    together = sampler._draw(weights.repeat_interleave(2, dim=0), batch, torch.Generator().manual_seed(3))
    assert together[::2].tolist() == alone


def test_rows_drawn_among_their_candidates_take_the_tokens_of_the_whole_row_draw():
    """A row with a top-k or a top-p (no min-p) is drawn from its candidates alone: for the same uniforms, the
    tokens of warping and drawing the whole row, over rows whose mass needs 64, 1,024 or all of their tokens."""
    rows, vocab = 240, 3000
    generator = torch.Generator().manual_seed(4)
    scales = torch.tensor([8.0, 2.5, 0.01])[torch.arange(rows) % 3][:, None]
    logits = torch.randn(rows, vocab, generator=generator) * scales
    choices = [
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=40),
        SamplingParams(temperature=0.7, top_k=200, top_p=0.9),
        SamplingParams(temperature=1.2, top_p=0.5, seed=3),
    ]
    batch = [SamplingInput(choices[i % 4], [5], list(range(i % 7)), 2) for i in range(rows)]
    assert all(sampler._drawn_among_candidates(s.params, False) for s in batch)
    among = sampler._draw_candidates(logits.clone(), batch, torch.Generator().manual_seed(9))
    probs = sampler._warped(logits.clone(), [s.params for s in batch])[1]
    whole = sampler._draw(probs, batch, torch.Generator().manual_seed(9))
    assert among.tolist() == whole.tolist()


def test_min_p_and_processed_logprobs_keep_a_row_on_the_whole_row_draw():
    top_p = SamplingParams(temperature=1.0, top_p=0.9)
    assert sampler._drawn_among_candidates(top_p, asks_processed=False)
    assert not sampler._drawn_among_candidates(top_p, asks_processed=True)  # its logprobs are of the warped row
    assert not sampler._drawn_among_candidates(SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1), False)
    assert not sampler._drawn_among_candidates(SamplingParams(temperature=1.0), False)  # every token a candidate


CPU_DRAW = pytest.mark.skipif(sampler._sample_kernel() is None, reason="the CPU kernels do not build here")
ROW_CHOICES = [
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.7, top_k=200, top_p=0.9),
    SamplingParams(temperature=1.2, top_p=0.5, seed=3),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=50, top_p=0.8, min_p=0.2),
    SamplingParams(temperature=0.0),
]


def cpu_draw(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> tuple[list, list]:
    drawn = sampler._draw_on_cpu(logits, params, uniforms)
    assert drawn is not None
    return drawn.token_ids, drawn.logprobs


def torch_draw(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> list[int]:
    """The torch path's tokens for these uniforms: ``_warped`` then the inverse CDF; a greedy row's argmax."""
    tokens = logits.argmax(-1)
    if sampled := [i for i, p in enumerate(params) if not p.greedy]:
        probs = sampler._warped(logits[sampled].clone(), [params[i] for i in sampled])[1]
        tokens[sampled] = sampler._inverse_cdf(probs, uniforms[sampled])
    return tokens.tolist()


@CPU_DRAW
@pytest.mark.parametrize("vocab", [1, 5, 17, 1000, 1025, 3000])
def test_cpu_draw_takes_the_torch_paths_token_for_each_uniform(vocab):
    """Rows whose mass needs a few, many or all of their tokens (a flat row's top-p is found by splitting its
    histogram's buckets), under temperature, top-k, top-p, min-p and their combinations, and greedy rows: for the
    same uniforms, the tokens of warping and drawing each whole row, and the raw log-probability."""
    rows = 240
    generator = torch.Generator().manual_seed(vocab)
    scales = torch.tensor([8.0, 2.5, 0.01])[torch.arange(rows) % 3][:, None]
    logits = torch.randn(rows, vocab, generator=generator) * scales
    params = [ROW_CHOICES[i % len(ROW_CHOICES)] for i in range(rows)]
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    tokens, logprobs = cpu_draw(logits, params, uniforms)
    assert tokens == torch_draw(logits, params, uniforms)
    raw = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert logprobs == pytest.approx(raw.tolist(), abs=1e-5)


def stable_reference_draw(row: torch.Tensor, p: SamplingParams, u: float) -> int:
    """One row in float64, tied logits in index order: temperature, top-k, top-p over the top-k's mass, min-p,
    then the inverse CDF of the kept weights."""
    x = row.double() / p.temperature
    ranked, order = x.sort(descending=True, stable=True)
    weights = (ranked - ranked[0]).exp()
    keep = torch.ones_like(weights, dtype=torch.bool)
    if p.top_k is not None:
        keep[p.top_k :] = False
    mass = weights.masked_fill(~keep, 0.0).cumsum(-1)
    keep &= (mass - weights) < p.top_p * mass[-1]
    keep &= weights >= p.min_p
    kept = torch.zeros_like(x).index_put_((order,), weights.masked_fill(~keep, 0.0))
    return inverse_cdf(kept.tolist(), u)


@CPU_DRAW
@pytest.mark.parametrize("vocab", [1, 7, 1000, 5000])
def test_cpu_draw_keeps_tied_tokens_in_index_order_and_never_draws_a_masked_one(vocab):
    """Logits of six values (at 5,000 tokens, about 800 ties each: more than the kernel sorts) and rows masked to
    -inf in part (a grammar's mask), most of them, or all but one: top-k and top-p keep tied tokens lowest index
    first, and a -inf token is never drawn, however far a top-k reaches past the finite ones."""
    rows = 120
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 6, (rows, vocab), generator=generator).float() * 0.75
    masked = torch.rand(rows, vocab, generator=generator) < torch.tensor([0.0, 0.5, 0.99])[torch.arange(rows) % 3, None]
    logits[masked] = float("-inf")
    logits[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=generator)] = 4.5  # one finite at least
    logits[-1] = float("-inf")
    logits[-1, vocab // 2] = 0.0
    choices = [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_k=max(1, vocab // 2)),
        SamplingParams(temperature=0.9, top_p=0.6),
        SamplingParams(temperature=1.1, top_k=10, top_p=0.83),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.0, top_k=min(vocab, 4000), top_p=0.97),
    ]
    params = [choices[i % len(choices)] for i in range(rows)]
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    tokens, _ = cpu_draw(logits, params, uniforms)
    expected = [stable_reference_draw(logits[i], params[i], uniforms[i].item()) for i in range(rows)]
    assert tokens == expected
    assert all(logits[i, t] > float("-inf") for i, t in enumerate(tokens))
    assert tokens[-1] == vocab // 2


@CPU_DRAW
def test_cpu_draw_leaves_a_row_with_nan_or_no_finite_logit_to_torch():
    """Such a row gets token -1 (``sample`` draws it in torch, which names a row of -inf alone), and the other rows
    their tokens as without it."""
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 3
    uniforms = torch.full((3,), 0.5, dtype=torch.float64)
    clean = cpu_draw(logits, params, uniforms)[0]
    assert min(clean) >= 0
    for bad in (float("nan"), float("-inf")):
        broken = logits.clone()
        broken[1, :] = bad
        assert cpu_draw(broken, params, uniforms)[0] == [clean[0], -1, clean[2]]
    broken[1, :] = 0.0
    broken[1, 40] = float("nan")
    assert cpu_draw(broken, params, uniforms)[0] == [clean[0], -1, clean[2]]
    # a NaN past the max of a penalized copy (the logprob from the clean raw row): found by a sampled row's weights
    # and by a greedy row's sum
    for row in (params[1], SamplingParams(temperature=0.0)):
        copy = logits.clone()
        copy[1, int(logits[1].argmin())] = float("nan")
        drawn = sampler._draw_on_cpu(copy, [params[0], row, params[2]], uniforms, logits)
        assert drawn is not None and drawn.token_ids == [clean[0], -1, clean[2]]


@CPU_DRAW
def test_rows_drawn_in_c_take_the_tokens_and_logprobs_of_torch_and_each_row_picks_its_own_path():
    """Batches of seeded rows, plain, then with penalties, a bias, bans and a min_tokens ban in force (applied to a
    copy as torch applies them; the logprob stays the raw row's): C's tokens and logprobs are torch's. A row asking
    for ``logprob_token_ids`` is drawn in torch, and a row its bans leave no token is named, without changing any
    other row's token."""
    torch.manual_seed(3)
    logits = torch.randn(8, 2000) * 3
    batch = [SamplingInput(dataclasses.replace(ROW_CHOICES[i], seed=100 + i), [5], list(range(i)), 2) for i in range(8)]
    penalized = [
        dataclasses.replace(ROW_CHOICES[0], seed=7, repetition_penalty=1.3),
        dataclasses.replace(ROW_CHOICES[1], seed=8, presence_penalty=0.5, frequency_penalty=0.7),
        dataclasses.replace(ROW_CHOICES[2], seed=9, logit_bias={int(logits[2].argmax()): -100.0, 3: 5.0}),
        dataclasses.replace(ROW_CHOICES[3], seed=10, allowed_token_ids=[3, 5, 8, 13, 21]),
        dataclasses.replace(ROW_CHOICES[7], bad_words_token_ids=[[int(logits[5].argmax())]]),
        dataclasses.replace(ROW_CHOICES[7], min_tokens=20, max_tokens=30, stop_token_ids=[int(logits[6].argmax())]),
        dataclasses.replace(ROW_CHOICES[7], repetition_penalty=2.0),
    ]
    mixed = batch[:1] + [SamplingInput(p, [5, 6, 7], [1, 1, 2, 3, 5, 8], 2) for p in penalized]
    for rows in (batch, mixed):
        in_c = sampler._sample_in_c(logits, rows, torch.Generator())
        in_torch = sampler._sample_in_torch(logits, rows, torch.Generator(), RAW_LOGPROBS, False)
        assert [t.token_id for t in in_c] == [t.token_id for t in in_torch]
        assert [t.logprob for t in in_c] == pytest.approx([t.logprob for t in in_torch], abs=1e-5)
        assert [t.token_id for t in sample(logits, rows, torch.Generator())] == [t.token_id for t in in_c]
    assert in_c[4].token_id in [3, 5, 8, 13, 21]  # mixed's row 4: penalized[3]
    assert in_c[5].token_id != int(logits[5].argmax()) and in_c[6].token_id != int(logits[6].argmax())
    alone = [t.token_id for t in sample(logits[:7], batch[:7], torch.Generator())]
    asks_ids = SamplingParams(temperature=1.0, logprobs=0, logprob_token_ids=[4])
    assert sampler._in_c(asks_ids, RAW_LOGPROBS) and not sampler._in_c(asks_ids, PROCESSED_LOGPROBS)
    beside = sample(logits, batch[:7] + inputs(asks_ids, 1), torch.Generator(), PROCESSED_LOGPROBS)
    assert [t.token_id for t in beside[:7]] == alone and list(beside[7].top_logprobs)[1:] == [4]
    no_token = SamplingParams(temperature=1.0, allowed_token_ids=[3], bad_words_token_ids=[[3]])
    assert sampler._sample_in_c(logits[:2], [*inputs(no_token, 1), batch[0]], torch.Generator())[0] is None
    with pytest.raises(sampler.NoTokenLeft) as raised:
        sample(logits, batch[:6] + inputs(no_token, 1) + batch[6:7], torch.Generator())
    assert raised.value.rows == [6]


def batch_of(logits: torch.Tensor, params: list[SamplingParams]) -> list[SamplingInput]:
    """Rows of these parameters after the prompt [5, 6], each having generated its own likeliest token and 7."""
    return [SamplingInput(p, [5, 6], [int(logits[i].argmax()), 7], 2) for i, p in enumerate(params)]


def drawn_both_ways(logits: torch.Tensor, batch: list[SamplingInput]) -> tuple[list, list]:
    """The batch drawn in C and in torch (the same uniforms), which take the same tokens."""
    in_c = sampler._sample_in_c(logits, batch, torch.Generator())
    in_torch = sampler._sample_in_torch(logits, batch, torch.Generator(), RAW_LOGPROBS, False)
    assert in_c is not None and [t.token_id for t in in_c] == [t.token_id for t in in_torch]
    return in_c, in_torch


def assert_same_entries(c, t) -> None:
    """The same shown tokens in the same order, each with torch's rank and log-probability."""
    assert list(c.top_logprobs) == list(t.top_logprobs)
    for token_id, entry in c.top_logprobs.items():
        assert entry.rank == t.top_logprobs[token_id].rank
        assert entry.logprob == pytest.approx(t.top_logprobs[token_id].logprob, abs=1e-5)


@CPU_DRAW
def test_rows_drawn_in_c_show_the_raw_logprobs_torch_shows():
    """Rows showing 0, 1, 5 and 20 logprobs beside rows showing none, greedy, sampled and penalized: the chosen
    token's rank and the likeliest tokens in order, with their log-probabilities, as torch gives them (raw
    logprobs); in another logprobs mode, rows showing logprobs are drawn in torch."""
    from raypaged.sampling_params import PROCESSED_LOGPROBS

    torch.manual_seed(5)
    logits = torch.randn(8, 3000) * torch.tensor([0.5, 2.0, 4.0, 8.0] * 2)[:, None]
    shown = [0, 1, 5, 20, None, 5, 3, None]
    batch = batch_of(
        logits,
        [
            dataclasses.replace(ROW_CHOICES[i], seed=30 + i, logprobs=shown[i], repetition_penalty=1.0 + 0.2 * (i % 2))
            for i in range(8)
        ],
    )
    for row, (c, t) in enumerate(zip(*drawn_both_ways(logits, batch))):
        assert c.logprob == pytest.approx(t.logprob, abs=1e-5)
        if shown[row] is None:
            assert c.top_logprobs is None and t.top_logprobs is None
            continue
        assert_same_entries(c, t)
        assert len(c.top_logprobs) >= shown[row]
    assert [sampler._in_c(s.params, PROCESSED_LOGPROBS) for s in batch] == [n is None for n in shown]


@CPU_DRAW
def test_rows_drawn_in_c_show_the_asked_tokens_logprobs_torch_shows():
    """Rows asking for ``logprob_token_ids`` (greedy, sampled and penalized; the chosen token among the asked ones
    or not, an id asked twice, the row's least likely token) beside rows showing their top logprobs and rows showing
    none: each asked token's raw log-probability and rank, in the asked order after the chosen token, as torch
    gives them."""
    torch.manual_seed(6)
    logits = torch.randn(6, 3000) * torch.tensor([0.5, 2.0, 4.0, 8.0, 3.0, 1.0])[:, None]
    asked = [[5, 7, 5], [int(logits[1].argmax()), 3], None, [int(logits[3].argmin()), 0, 2999], [7], None]
    batch = batch_of(
        logits,
        [
            dataclasses.replace(
                ROW_CHOICES[(i * 3) % 8],
                seed=60 + i,
                logprobs=None if i == 5 else 2,
                logprob_token_ids=asked[i],
                repetition_penalty=1.0 + 0.3 * (i % 2),
            )
            for i in range(6)
        ],
    )
    for row, (c, t) in enumerate(zip(*drawn_both_ways(logits, batch))):
        if asked[row] is None:
            assert (c.top_logprobs is None) == (t.top_logprobs is None) == (row == 5)
            continue
        assert_same_entries(c, t)
        assert list(c.top_logprobs) == list(dict.fromkeys([c.token_id, *asked[row]]))
