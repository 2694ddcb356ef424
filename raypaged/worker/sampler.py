"""Pick one token per sequence from its logits.

Order: penalties and ``min_tokens`` masking on the raw logits, then greedy
argmax or temperature → top-k → top-p → min-p → a draw by inverse CDF (one uniform a row;
a row with a top-k or top-p and no min-p is drawn among its candidates alone). A row whose masks (a
grammar's, ``allowed_token_ids``, ``bad_words``) leave no token is never drawn
from: ``sample`` raises :class:`NoTokenLeft` naming it (``min_tokens`` alone
never empties a row: it yields where a row allows nothing but ending). Logprobs are those of
the raw model distribution. A seeded request draws from a generator seeded by
``(seed, number of tokens generated so far)``, so its tokens do not depend on
what else is in the batch, nor on preemption.

Everything runs where the logits are (the GPU with CUDA): parameters become small
tensors on that device, and only the chosen tokens, their logprobs and the top
logprobs asked for cross to the host; no batch x vocabulary copy. Unseeded rows draw
their uniforms from the runner's generator on that device; a seeded row's comes
from a CPU generator (one number, copied over), so a seeded request draws
the same uniform on every device. On CPU the rows are drawn in C (``cpu_sample.c``: no sort, no
[rows, vocab] tensor written), but for rows that ask for ``logprob_token_ids`` or processed logprobs,
which torch draws; a row's own parameters pick its path, and both give the same token for the same uniform.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch

from raypaged.core.outputs import SampledToken
from raypaged.outputs import Logprob
from raypaged.sampling_params import PROCESSED_LOGITS, PROCESSED_LOGPROBS, RAW_LOGITS, RAW_LOGPROBS, SamplingParams


class NoTokenLeft(ValueError):
    """Rows of ``sample``'s logits whose masks left every token -inf: nothing can be drawn for them."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"rows {rows} have no token left to sample")
        self.rows = rows


@dataclass(slots=True)
class SamplingInput:
    """What the sampler needs to know of one sequence."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_id: int | None
    sample_index: int = 0  # samples of one request (n > 1) draw distinct streams


def sample(
    logits: torch.Tensor,
    inputs: list[SamplingInput],
    generator: torch.Generator,
    logprobs_mode: str = RAW_LOGPROBS,
    grammar_masked: bool = False,
) -> list[SampledToken]:
    """``logits``: [num_seqs, vocab]; returns one token per row. Each token's ``logprob`` (cumulative
    logprobs, best_of and beam ranking) is its raw log-probability; the logprobs rows ask for are of
    ``logprobs_mode`` (vLLM's ``--logprobs-mode``, see ``LOGPROBS_MODES``). ``grammar_masked``: a grammar's
    bitmask was applied to some rows (with ``allowed_token_ids`` and ``bad_words``, what can leave a row no
    token: ``NoTokenLeft``).

    On CPU the rows ``_in_c`` takes are drawn by ``cpu_sample.c`` in one call, the others (and any row the kernel
    leaves: a max or sum that is not finite) in torch. Which path draws a row depends on that row alone, never on
    its batch, and both give the same token for the same uniform (to float rounding)."""
    count = len(inputs)
    tokens: list[SampledToken | None] = [None] * count
    on_cpu = logits.device.type == "cpu" and _sample_kernel() is not None
    if on_cpu and (in_c := [i for i, s in enumerate(inputs) if _in_c(s.params, logprobs_mode)]):
        part = logits if len(in_c) == count else logits[in_c]
        for i, token in zip(in_c, _sample_in_c(part, [inputs[i] for i in in_c], generator) or []):
            tokens[i] = token
    if rest := [i for i, token in enumerate(tokens) if token is None]:
        part = logits if len(rest) == count else logits[rest]
        try:
            drawn = _sample_in_torch(part, [inputs[i] for i in rest], generator, logprobs_mode, grammar_masked)
        except NoTokenLeft as empty:
            raise NoTokenLeft([rest[r] for r in empty.rows]) from None
        for i, token in zip(rest, drawn):
            tokens[i] = token
    return cast(list[SampledToken], tokens)


def _in_c(params: SamplingParams, logprobs_mode: str) -> bool:
    """Whether ``cpu_sample.c`` draws a row of these parameters on CPU: it shows no logprobs (top or asked tokens')
    in a mode other than raw logprobs."""
    return logprobs_mode == RAW_LOGPROBS or (params.logprobs is None and not params.logprob_token_ids)


def _sample_in_torch(
    logits: torch.Tensor, inputs: list[SamplingInput], generator: torch.Generator, logprobs_mode: str, masked: bool
) -> list[SampledToken]:
    """``sample`` in torch ops, where the logits are (the GPU with CUDA); ``masked``: ``sample``'s
    ``grammar_masked``."""
    raw = logits.float()
    raw_logprobs = torch.log_softmax(raw, dim=-1)
    logits = _processed(raw, inputs)
    dead = None  # rows their masks left no token (their draws, in range, are void)
    if masked or any(s.params.allowed_token_ids is not None or s.params.bad_words_token_ids for s in inputs):
        dead = torch.isneginf(logits.amax(dim=-1))

    token_ids = torch.empty(len(inputs), dtype=torch.long, device=logits.device)
    greedy = [i for i, s in enumerate(inputs) if s.params.greedy]
    sampled = [i for i, s in enumerate(inputs) if not s.params.greedy]
    warped = None
    shows_processed = logprobs_mode in (PROCESSED_LOGPROBS, PROCESSED_LOGITS) and any(
        s.params.logprobs is not None for s in inputs
    )
    if greedy:
        token_ids[greedy] = logits[greedy].argmax(dim=-1)
    # rows drawn among their candidates alone; the others (and, below, their shown logprobs) as warped whole
    among = [i for i in sampled if _drawn_among_candidates(inputs[i].params, shows_processed and _asks(inputs[i]))]
    if among:
        token_ids[among] = _draw_candidates(logits[among], [inputs[i] for i in among], generator)
        drawn = set(among)
        sampled = [i for i in sampled if i not in drawn]
    if sampled:
        warped, probs = _warped(logits[sampled], [inputs[i].params for i in sampled], shows_processed)
        token_ids[sampled] = _draw(probs, [inputs[i] for i in sampled], generator)

    results = []
    if dead is None:
        token_list = token_ids.tolist()
    else:  # one copy to the host tells the dead rows too
        token_list = token_ids.masked_fill(dead, -1).tolist()
        if token_list and min(token_list) < 0:
            raise NoTokenLeft([i for i, token in enumerate(token_list) if token < 0])
    chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    if all(s.params.logprobs is None for s in inputs):
        return [SampledToken(token, logprob, None) for token, logprob in zip(token_list, chosen)]
    shown = _shown_logprobs(logprobs_mode, raw, raw_logprobs, logits, sampled, warped)
    shown_chosen_t = shown.gather(1, token_ids[:, None])
    shown_chosen = shown_chosen_t.squeeze(1).tolist()
    ranks = token_ranks(shown, shown_chosen_t)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_top := max(((s.params.logprobs or 0) for s in inputs if not s.params.logprob_token_ids), default=0):
        top_values_t, top_ids_t = shown.topk(max_top, dim=-1)
        top_values, top_ids = top_values_t.tolist(), top_ids_t.tolist()
    for i, s in enumerate(inputs):
        top = None
        if s.params.logprob_token_ids:
            top = _asked_entry(shown[i], token_list[i], shown_chosen[i], ranks[i], s.params.logprob_token_ids)
        elif s.params.logprobs is not None:
            num = s.params.logprobs
            top = logprob_entry(
                token_list[i],
                shown_chosen[i],
                ranks[i],
                top_ids[i][:num] if num else [],
                top_values[i][:num] if num else [],
            )
        results.append(SampledToken(token_list[i], chosen[i], top))
    return results


def _asks(row: SamplingInput) -> bool:
    """Whether the row shows logprobs."""
    return row.params.logprobs is not None or bool(row.params.logprob_token_ids)


def _shown_logprobs(
    mode: str,
    raw: torch.Tensor,
    raw_logprobs: torch.Tensor,
    processed: torch.Tensor,
    sampled: list[int],
    warped: torch.Tensor | None,
) -> torch.Tensor:
    """What the logprobs a request asks for hold: the raw logits or their log-softmax, or the processed ones
    (``processed``: after penalties, bias and masks; the sampled rows as drawn from, ``warped``: also after
    temperature, top-k, top-p and min-p, a cut token -inf), or their log-softmax."""
    if mode == RAW_LOGPROBS:
        return raw_logprobs
    if mode == RAW_LOGITS:
        return raw
    if warped is not None:
        processed = processed.clone()
        processed[sampled] = warped
    return processed if mode == PROCESSED_LOGITS else torch.log_softmax(processed, dim=-1)


def token_ranks(values: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    """The rank of each row's ``chosen`` value among ``values`` (1: the largest): one more than the values above
    it, counted in int32 (a [rows, vocab] comparison sums in half the time of int64)."""
    return ((values > chosen).sum(-1, dtype=torch.int32) + 1).tolist()


def logprob_entry(
    token_id: int,
    logprob: float,
    rank: int,
    top_ids: list[int],
    top_values: list[float],
    top_ranks: list[int] | None = None,
) -> dict:
    """One position's logprobs: the chosen token first, then the most likely ones in rank order, or the
    ``top_ids`` given with their own ``top_ranks`` (the chosen token keeps its own entry when it is among them)."""
    entry = {token_id: Logprob(logprob, rank)}
    for j, (top_id, top_value) in enumerate(zip(top_ids, top_values)):
        entry.setdefault(top_id, Logprob(top_value, j + 1 if top_ranks is None else top_ranks[j]))
    return entry


def _asked_entry(row: torch.Tensor, token_id: int, logprob: float, rank: int, asked: list[int]) -> dict:
    """One position's logprobs for ``logprob_token_ids``: the chosen token first, then each asked token
    with its own rank in ``row``."""
    values = row[torch.tensor(asked, device=row.device)]
    ranks = token_ranks(row[None, :], values[:, None])
    return logprob_entry(token_id, logprob, rank, asked, values.tolist(), ranks)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, every token of ``logits[rows[i]]`` that row ``i`` of ``bitmask``
    disallows. ``logits``: [num_seqs, vocab]; ``bitmask``: [len(rows), ceil(vocab / 32)] int32."""
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def greedy_fast_path(logits: torch.Tensor, inputs: list[SamplingInput]) -> list[SampledToken] | None:
    """``sample`` for a batch that is all plain greedy (no penalties, no min_tokens mask in force,
    no top logprobs): the same tokens and logprobs with no copy of the logits, computed where
    they are (on a GPU only two numbers per row cross to the host); ``None`` when any row
    needs the general path (or has no finite logit, which the general path names)."""
    for s in inputs:
        if not s.params.greedy or s.params.logprobs is not None or _penalized(s):
            return None
    logits = logits.float()
    if (picked := _greedy_on_cpu(logits)) is not None:
        return [SampledToken(t, lp, None) for t, lp in zip(*picked)]
    token_ids = logits.argmax(dim=-1)
    chosen = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None]).squeeze(1).tolist()
    if any(map(math.isnan, chosen)):  # a row without a finite logit (a grammar left it no token)
        return None
    return [SampledToken(t, lp, None) for t, lp in zip(token_ids.tolist(), chosen)]


@functools.cache
def _cpu_kernel(name: str) -> Callable[..., int] | None:
    """``cpu_sample.c``'s function ``name``, or None where the CPU kernels do not build."""
    from raypaged.attention import cpu_ops

    try:
        return getattr(cpu_ops.library(), name)
    except cpu_ops.KernelUnavailable:
        return None


def _greedy_kernel() -> Callable[..., int] | None:
    """The argmax and log-probability of each row."""
    return _cpu_kernel("raypaged_greedy_f32")


def _sample_kernel() -> Callable[..., int] | None:
    """The draw of each row, with its logprobs."""
    return _cpu_kernel("raypaged_sample_f32")


def _greedy_on_cpu(logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """Each row's argmax (its first occurrence) and log-probability in one C call over CPU logits
    ([rows, vocab] fp32, contiguous rows): about 6x less time than torch's argmax and log_softmax, the
    tokens the same and the log-probability within float rounding of log_softmax's. None (the torch
    path then runs) off the CPU, without the kernel, or for a batch with a row whose max or sum is not
    finite, whose NaN and inf cases torch defines."""
    kernel = _greedy_kernel() if logits.device.type == "cpu" and logits.dim() == 2 else None
    if kernel is None or logits.stride(1) != 1 or logits.shape[1] == 0:
        return None
    rows = logits.shape[0]
    token_ids = torch.empty(rows, dtype=torch.long)
    logprobs = torch.empty(rows, dtype=torch.float32)
    refused = kernel(
        logits.data_ptr(),
        rows,
        logits.shape[1],
        logits.stride(0),
        token_ids.data_ptr(),
        logprobs.data_ptr(),
        torch.get_num_threads(),
    )
    return None if refused else (token_ids.tolist(), logprobs.tolist())


def _sample_in_c(
    logits: torch.Tensor, inputs: list[SamplingInput], generator: torch.Generator
) -> list[SampledToken | None] | None:
    """``sample``'s tokens of CPU logits in one C call (``cpu_sample.c``): each row's token, raw log-probability and
    the raw logprobs it shows (its rank and the top ``logprobs``), with no sort and no [rows, vocab] tensor written
    (penalties, biases and bans apply as in torch, to a copy, when a row has any). None for a row the kernel leaves
    to torch (a max or sum that is not finite: a row its bans left no token among them); None in all for logits it
    cannot read."""
    raw = logits.float()
    processed = _processed(raw, inputs)
    params = [s.params for s in inputs]
    uniforms = torch.zeros(len(inputs), dtype=torch.float64)
    if sampled := [i for i, p in enumerate(params) if not p.greedy]:
        uniforms[sampled] = _uniforms([inputs[i] for i in sampled], generator, logits.device)
    if (drawn := _draw_on_cpu(processed, params, uniforms, raw)) is None:
        return None
    shown = (None if p.logprob_token_ids else p.logprobs for p in params)  # an asking row's entry is built below
    tokens = [
        None
        if token < 0
        else SampledToken(token, logprob, None if n is None else logprob_entry(token, logprob, rank, ids[:n], vals[:n]))
        for n, token, logprob, rank, ids, vals in zip(shown, *drawn)
    ]
    if asking := [i for i, p in enumerate(params) if p.logprob_token_ids and drawn.token_ids[i] >= 0]:
        rows = raw[asking]
        raw_logprobs = rows - torch.logsumexp(rows, dim=-1, keepdim=True)  # the rows' log-softmax
        for row, i in zip(raw_logprobs, asking):
            token, asked = tokens[i], params[i].logprob_token_ids
            assert token is not None and asked
            token.top_logprobs = _asked_entry(row, token.token_id, token.logprob, drawn.ranks[i], asked)
    return tokens


class Drawn(NamedTuple):
    """``_draw_on_cpu``'s rows: each token (-1 for a row left to torch), its raw log-probability, and for the rows
    showing logprobs its rank and the row's likeliest tokens and their log-probabilities (zeros for the others)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def _draw_on_cpu(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor, raw: torch.Tensor | None = None
) -> Drawn | None:
    """``cpu_sample.c``'s token (each row's ``params``, drawn by its uniform in ``uniforms``, float64) of each row of
    CPU ``logits`` [rows, vocab], and its log-probability in ``raw`` (the logits before penalties and bans; by
    default ``logits``), with the raw logprobs a row's ``logprobs`` asks for; a row whose max or sum is not finite
    gets token -1 (torch defines those cases). None without the kernel, or for rows that are not contiguous."""
    kernel = _sample_kernel() if logits.dim() == 2 else None
    logits = logits.float()
    raw = logits if raw is None else raw.float()
    if kernel is None or logits.stride(1) != 1 or raw.stride(1) != 1 or logits.shape[1] == 0:
        return None
    rows = len(params)
    token_ids = torch.empty(rows, dtype=torch.long)
    logprobs = torch.empty(rows, dtype=torch.float32)
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)  # held until the call returns
    top_k = torch.tensor([p.top_k or 0 for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    uniforms = uniforms.to(torch.float64).contiguous()
    # a row asking for tokens' logprobs gets its token's rank (0 top tokens)
    shown = [
        0 if p.logprob_token_ids else -1 if p.logprobs is None else min(p.logprobs, logits.shape[1]) for p in params
    ]
    max_top = max(max(shown), 0)
    tops = torch.tensor(shown, dtype=torch.int64)
    ranks = torch.zeros(rows, dtype=torch.int64)
    top_ids = torch.zeros(rows, max_top, dtype=torch.int64)
    top_logprobs = torch.zeros(rows, max_top, dtype=torch.float32)
    kernel(
        logits.data_ptr(),
        rows,
        logits.shape[1],
        logits.stride(0),
        None if raw is logits else raw.data_ptr(),
        raw.stride(0),
        temperature.data_ptr(),
        top_k.data_ptr(),
        top_p.data_ptr(),
        min_p.data_ptr(),
        uniforms.data_ptr(),
        token_ids.data_ptr(),
        logprobs.data_ptr(),
        tops.data_ptr() if max(shown) >= 0 else None,
        max_top,
        ranks.data_ptr(),
        top_ids.data_ptr(),
        top_logprobs.data_ptr(),
        torch.get_num_threads(),
    )
    return Drawn(token_ids.tolist(), logprobs.tolist(), ranks.tolist(), top_ids.tolist(), top_logprobs.tolist())


# the likeliest tokens a top-p row ranks first, then next, before it sorts its whole vocabulary
_TOP_P_CANDIDATES = (64, 1024)


def _apply_penalties(logits: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
    """Penalties, biases and bans in vLLM's order: repetition, presence and frequency, logit bias,
    allowed tokens, bad words, then ``min_tokens``' bans. Each runs once over all the rows that use
    it, as a gather and a scatter over the (row, token) pairs it touches (the arithmetic of row by
    row, to the bit); only matching bad words against each row's newest tokens is per row."""
    _repetition_penalty(logits, inputs)
    _presence_frequency_penalty(logits, inputs)
    _logit_bias(logits, inputs)
    _allowed_tokens(logits, inputs)
    _bad_words(logits, inputs)
    _min_tokens_bans(logits, inputs)
    return logits


def _processed(raw: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
    """The logits drawn from: penalties, biases and bans applied to a copy of ``raw``; without any, ``raw`` itself."""
    return _apply_penalties(raw.clone(), inputs) if any(map(_penalized, inputs)) else raw


def _penalized(row: SamplingInput) -> bool:
    """Whether ``_apply_penalties`` changes any of the row's logits (a superset: a presence penalty before any
    output, or a min_tokens without stop tokens, changes nothing but is counted)."""
    p = row.params
    return bool(
        p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or p.logit_bias
        or p.allowed_token_ids is not None
        or p.bad_words_token_ids
        or len(row.output_token_ids) < p.min_tokens
    )


def _allowed_tokens(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    """Rows with ``allowed_token_ids`` keep those logits and no other."""
    allowed = {i: ids for i, s in enumerate(inputs) if (ids := s.params.allowed_token_ids) is not None}
    if not allowed:
        return
    flat, kept = _pairs(logits, allowed)
    logits[torch.tensor(list(allowed), device=logits.device)] = float("-inf")
    logits.view(-1)[flat] = kept


def _bad_words(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    banned = {}
    for i, s in enumerate(inputs):
        if s.params.bad_words_token_ids and (ids := _banned_by_words(s.params.bad_words_token_ids, s.output_token_ids)):
            banned[i] = ids
    if banned:
        logits.view(-1)[_flat_token_index(logits, list(banned), list(banned.values()))] = float("-inf")


def _logit_bias(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    biases = {i: bias for i, s in enumerate(inputs) if (bias := s.params.logit_bias)}
    if not biases:
        return
    flat = _flat_token_index(logits, list(biases), [list(bias) for bias in biases.values()])
    values = torch.tensor([b for bias in biases.values() for b in bias.values()], dtype=logits.dtype)
    logits.view(-1)[flat] += values.to(logits.device)


def _min_tokens_bans(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    """Below ``min_tokens``, a sequence may not end: its stop token ids and EOS (unless ignored) are banned,
    unless they are all its row allows (a grammar that is complete, ``allowed_token_ids`` of stop tokens):
    then the ban is lifted there, and the sequence may end early (as vLLM lets a grammar end it)."""
    banned: dict[int, list[int]] = {}
    for i, s in enumerate(inputs):
        p = s.params
        if len(s.output_token_ids) < p.min_tokens:
            ids = list(p.stop_token_ids)
            if s.eos_token_id is not None and not p.ignore_eos:
                ids.append(s.eos_token_id)
            if ids:
                banned[i] = ids
    if not banned:
        return
    flat, kept = _pairs(logits, banned)
    view = logits.view(-1)
    view[flat] = float("-inf")
    emptied = torch.isneginf(logits.index_select(0, torch.tensor(list(banned), device=logits.device)).amax(dim=-1))
    counts = torch.tensor([len(ids) for ids in banned.values()], device=logits.device)
    view[flat] = torch.where(torch.repeat_interleave(emptied, counts), kept, float("-inf"))  # per banned pair


def _pairs(logits: torch.Tensor, tokens_by_row: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions in ``logits.view(-1)`` of each (row, token) pair of ``tokens_by_row``, and their logits now."""
    flat = _flat_token_index(logits, list(tokens_by_row), list(tokens_by_row.values()))
    return flat, logits.view(-1)[flat]


def _flat_token_index(logits: torch.Tensor, rows: list[int], tokens: list[list[int]]) -> torch.Tensor:
    """Positions in ``logits.view(-1)`` of each (row, token) pair: ``rows[k] * vocab + tokens[k][j]``."""
    row_index = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(t) for t in tokens]))
    token_ids = torch.tensor([t for row_tokens in tokens for t in row_tokens], dtype=torch.long)
    return (row_index * logits.shape[-1] + token_ids).to(logits.device)


def _repetition_penalty(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    """HF's rule on every distinct token of the prompt and output: positive logits divided by the
    penalty, negative ones multiplied. One gather and one scatter over the rows' tokens."""
    rows = [i for i, s in enumerate(inputs) if s.params.repetition_penalty != 1.0]
    if not rows:
        return
    flat = torch.unique(
        _flat_token_index(logits, rows, [inputs[i].prompt_token_ids + inputs[i].output_token_ids for i in rows])
    )
    penalty = torch.tensor([s.params.repetition_penalty for s in inputs], dtype=logits.dtype, device=logits.device)[
        flat // logits.shape[-1]
    ]
    view = logits.view(-1)
    values = view[flat]
    view[flat] = torch.where(values > 0, values / penalty, values * penalty)


def _presence_frequency_penalty(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    """OpenAI's: each output token's logit lowers by frequency x its count, plus presence once."""
    rows = [
        i
        for i, s in enumerate(inputs)
        if (s.params.presence_penalty or s.params.frequency_penalty) and s.output_token_ids
    ]
    if not rows:
        return
    flat, counts = torch.unique(
        _flat_token_index(logits, rows, [inputs[i].output_token_ids for i in rows]), return_counts=True
    )
    row = flat // logits.shape[-1]
    frequency = torch.tensor([s.params.frequency_penalty for s in inputs], dtype=logits.dtype, device=logits.device)
    presence = torch.tensor([s.params.presence_penalty for s in inputs], dtype=logits.dtype, device=logits.device)
    view = logits.view(-1)
    view[flat] -= frequency[row] * counts + presence[row] * (counts > 0)


def _banned_by_words(words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens the output just generated (a one-token word
    is always banned), as vLLM bans them."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def _warped(
    logits: torch.Tensor, params: list[SamplingParams], cut_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits as sampled from (after temperature, top-k and top-p, a cut token -inf; with ``cut_logits``,
    min-p's cut tokens -inf too) and the probabilities drawn from (min-p's cut tokens 0, the others as softmax
    gave them)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature[:, None]
    with_k = [i for i, p in enumerate(params) if p.top_k is not None]
    only_p = [i for i, p in enumerate(params) if p.top_k is None and p.top_p < 1.0]
    for rows in (with_k, only_p):  # rows with neither keep every token and pay nothing
        if rows:
            logits[rows] = _top_k_top_p(logits[rows], [params[i] for i in rows])
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        cut = probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(cut, 0.0)
        if cut_logits:  # only the processed logprobs show them
            logits = logits.masked_fill(cut, float("-inf"))
    return logits, probs


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [rows, vocab] with every token outside each row's top-k, then top-p, set to -inf
    (``_ranked_groups``)."""
    out = torch.full_like(logits, float("-inf"))
    groups = _ranked_groups(logits, params)
    if len(groups) == 1:  # every row in one group, in order
        _, ranked, order = groups[0]
        return out.scatter_(1, order, ranked)
    for rows, ranked, order in groups:
        out[rows] = out[rows].scatter_(1, order, ranked)
    return out


RankedGroup = tuple[list[int], torch.Tensor, torch.Tensor]  # rows, their ranked logits (a cut one -inf), columns


def _ranked_groups(logits: torch.Tensor, params: list[SamplingParams]) -> list[RankedGroup]:
    """Each row's likeliest tokens, those outside its top-k, then top-p, -inf: groups of rows (their indices in
    ``logits``), each with its rows' ranked logits [rows, width] (descending) and their columns.

    When every row has a top-k, only the largest k columns are ranked (``topk``), not the
    whole vocabulary: top-p after top-k only ever looks at those (and renormalizes over them). Rows with top-p
    alone rank their likeliest ``_TOP_P_CANDIDATES[0]`` tokens, the rows those hold less than ``top_p`` of the
    mass then their likeliest ``_TOP_P_CANDIDATES[1]``, and only the rows still short sort the whole vocabulary (a
    token past the candidates could then be kept): each row pays for the tokens its own mass needs.
    """
    vocab = logits.shape[-1]
    top_ks = [p.top_k for p in params if p.top_k is not None]
    if len(top_ks) == len(params):  # every row has a top-k
        ranked, order = logits.topk(min(max(top_ks), vocab), dim=-1)  # descending
        return [(list(range(len(params))), _cut(ranked, None, params), order)]
    groups: list[RankedGroup] = []
    pending = list(range(len(params)))
    log_total = logits.logsumexp(dim=-1, keepdim=True)
    for width in (*_TOP_P_CANDIDATES, vocab):
        rows = logits[pending] if len(pending) < len(params) else logits
        if width >= vocab:
            ranked, order = rows.sort(dim=-1, descending=True)
            groups.append((pending, _cut(ranked, None, [params[i] for i in pending]), order))
            break
        ranked, order = rows.topk(width, dim=-1)
        ranked_probs = (ranked - log_total[pending]).exp()
        top_p = torch.tensor([params[i].top_p for i in pending], dtype=ranked.dtype, device=ranked.device)
        enough = (ranked_probs.sum(dim=-1) >= top_p).tolist()
        if all(enough):
            groups.append((pending, _cut(ranked, ranked_probs, [params[i] for i in pending]), order))
            break
        if done := [j for j, ok in enumerate(enough) if ok]:
            cut = _cut(ranked[done], ranked_probs[done], [params[pending[j]] for j in done])
            groups.append(([pending[j] for j in done], cut, order[done]))
        pending = [pending[j] for j, ok in enumerate(enough) if not ok]
    return groups


def _cut(ranked: torch.Tensor, ranked_probs: torch.Tensor | None, params: list[SamplingParams]) -> torch.Tensor:
    """``ranked`` (each row's likeliest logits, descending) with every token past the row's top-k, then its
    top-p, -inf; ``ranked_probs``: their probabilities over the whole row, or None to renormalize over them."""
    width = ranked.shape[-1]
    top_p = torch.tensor([p.top_p for p in params], dtype=ranked.dtype, device=ranked.device)
    top_k = torch.tensor([min(p.top_k or width, width) for p in params], device=ranked.device)
    drop = torch.arange(width, device=ranked.device)[None, :] >= top_k[:, None]
    ranked = ranked.masked_fill(drop, float("-inf"))
    if ranked_probs is None:
        ranked_probs = ranked.softmax(dim=-1)
    mass_before = ranked_probs.cumsum(dim=-1) - ranked_probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    return ranked.masked_fill(drop, float("-inf"))


def _drawn_among_candidates(params: SamplingParams, asks_processed: bool) -> bool:
    """Whether a sampled row draws among its top-k / top-p candidates alone (``_draw_candidates``): it has a
    top-k or a top-p below 1, no min-p (which can keep tokens past the candidates), and shows no processed
    logprobs (which are of the whole warped row). A row's own parameters decide, never its batch."""
    return (params.top_k is not None or params.top_p < 1.0) and not params.min_p and not asks_processed


def _draw_candidates(logits: torch.Tensor, inputs: list[SamplingInput], generator: torch.Generator) -> torch.Tensor:
    """One token per row, as ``_warped`` then ``_draw`` would draw it (the same distribution, and for the same
    uniform the same token, to float rounding), but from each row's top-k / top-p candidates alone: no row of
    the whole vocabulary is cut, normalized or accumulated (but for rows whose top-p needed all of it, drawn as
    ``_draw`` draws). Each group's candidates are put in vocabulary order and drawn by inverse CDF, as ``_draw``
    walks a row."""
    params = [s.params for s in inputs]
    vocab = logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temperature[:, None]
    uniforms = _uniforms(inputs, generator, logits.device)
    tokens = torch.empty(len(inputs), dtype=torch.long, device=logits.device)
    with_k = [i for i, p in enumerate(params) if p.top_k is not None]
    only_p = [i for i, p in enumerate(params) if p.top_k is None]
    for subset in (with_k, only_p):  # as _warped: top-p renormalizes over a top-k
        if not subset:
            continue
        part = logits[subset] if len(subset) < len(params) else logits
        for rows, ranked, order in _ranked_groups(part, [params[i] for i in subset]):
            at = [subset[r] for r in rows]
            if ranked.shape[-1] == vocab:  # rows that sorted their whole vocabulary: drawn as the whole row is
                warped = torch.full_like(ranked, float("-inf")).scatter_(1, order, ranked)
                tokens[at] = _inverse_cdf(warped.softmax(dim=-1), uniforms[at])
                continue
            columns, position = order.sort(dim=-1)
            cdf = ranked.softmax(dim=-1).gather(1, position).cumsum(dim=-1, dtype=torch.float64)
            chosen, _ = _first_past(cdf, uniforms[at][:, None] * cdf[:, -1:])
            tokens[at] = columns.gather(1, chosen).squeeze(1)
    return tokens


# the draw's blocks of the vocabulary: a row's blocks are summed, then one block's tokens accumulated
DRAW_BLOCK = 1024


def _draw(probs: torch.Tensor, inputs: list[SamplingInput], generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` (each row's weights, which need not sum to one: min-p's cut tokens are 0),
    by inverse CDF: a uniform ``u`` per row, and the first token whose cumulative weight exceeds ``u`` times the
    row's total. ``generator`` (on the probabilities' device) draws the unseeded rows' ``u``; each seeded row draws
    its own from a CPU stream of its seed and position, so its token does not depend on the batch (nor on the
    device, to float rounding).

    The row is cut into blocks of ``DRAW_BLOCK`` tokens: their sums (float32, accumulated over the blocks in
    float64) pick the block, and that block's tokens alone are accumulated (float64) to pick the token. A token of
    weight 0 is never drawn. That is one pass over the row's weights and no random number per token: the
    exponential race (argmax p / E, E ~ Exp(1)) drew one exponential per token, about 1.2 ms a row of SmolLM2's
    49,152 tokens on a CPU core, against about 10 us here."""
    return _inverse_cdf(probs, _uniforms(inputs, generator, probs.device))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``_draw``'s token of each row of ``probs`` for its uniform in ``u`` (float64, one a row)."""
    rows, vocab = probs.shape
    device = probs.device
    full = vocab // DRAW_BLOCK
    sums = [probs[:, : full * DRAW_BLOCK].view(rows, full, DRAW_BLOCK).sum(dim=-1)] if full else []
    if vocab > full * DRAW_BLOCK:  # the last, shorter block
        sums.append(probs[:, full * DRAW_BLOCK :].sum(dim=-1, keepdim=True))
    blocks_cdf = torch.cat(sums, dim=-1).double().cumsum(dim=-1)  # [rows, blocks]
    block, target = _first_past(blocks_cdf, u[:, None] * blocks_cdf[:, -1:])
    before = torch.where(block > 0, blocks_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=device)  # [rows, DRAW_BLOCK]
    inside = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(columns >= vocab, 0.0)
    # the block's float64 sum may fall a rounding short of its float32 one: _first_past stays below it
    token, _ = _first_past(inside.cumsum(dim=-1, dtype=torch.float64), (target - before).clamp_(min=0.0))
    return (block * DRAW_BLOCK + token).squeeze(1).clamp_(max=vocab - 1)


def _first_past(cdf: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first column whose cumulative weight in ``cdf`` [rows, columns] (float64) exceeds its ``target``
    [rows, 1], with ``target`` kept below the row's total so that the column weighs above 0 (u x total may round
    up to the total); the columns [rows, 1] and the targets as kept."""
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1), target


def _uniforms(inputs: list[SamplingInput], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Each row's uniform in [0, 1) (float64): ``generator``'s, in row order, for the unseeded rows; a seeded
    row's from a CPU stream of its seed, its position and its sample index."""
    u = torch.empty(len(inputs), dtype=torch.float64, device=device)
    unseeded = [i for i, s in enumerate(inputs) if s.params.seed is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), generator=generator, device=device, dtype=torch.float64)
    for i, s in enumerate(inputs):
        if s.params.seed is not None:
            stream = (s.params.seed, len(s.output_token_ids)) + ((s.sample_index,) if s.sample_index else ())
            row_gen = torch.Generator().manual_seed(hash(stream) & 0x7FFF_FFFF_FFFF_FFFF)
            u[i] = torch.rand(1, generator=row_gen, dtype=torch.float64).item()
    return u
