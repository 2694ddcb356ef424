"""Beam search over forked sequences.

Every live beam of a group computes its next-token log-probabilities (the
top ``2 * beam_width``); once all have, the group keeps the ``beam_width``
best continuations by cumulative log-probability. A beam chosen k times is
forked k-1 times (its blocks shared), a beam not chosen is freed, and a
continuation that is EOS becomes a finished hypothesis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from raypaged.core.request import Gang, Request, RequestStatus
from raypaged.outputs import FinishReason
from raypaged.sampling_params import BeamSearchParams

if TYPE_CHECKING:
    from raypaged.core.scheduler import EndedRequest, Scheduler

__all__ = ["BeamGroup", "BeamSearchParams", "Continuation", "Hypothesis", "abort", "after_step"]


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens and scores."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per token: the candidates of its step


@dataclass(slots=True)
class Continuation:
    parent: Request
    token_id: int
    logprob: float
    candidates: dict[int, float]  # every token its parent's step weighed, with its logprob


@dataclass(eq=False, kw_only=True)
class BeamGroup(Gang):
    """A beam search: its live beams are the gang's ``members``, their candidates ``held``."""

    params: BeamSearchParams
    eos_token_id: int | None
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False
    hypotheses: list[Hypothesis] = field(default_factory=list)  # the ranked result, once done
    next_index: int = 1
    # constrained groups: per beam step, (parent beam id, beam id or None if dropped, token appended);
    # the engine core takes these to fork and advance the beams' grammar states
    lineage: list[list[tuple[str, str | None, int]]] = field(default_factory=list)

    @property
    def group_id(self) -> str:
        return self.gang_id

    def score(self, cumulative_logprob: float, num_tokens: int) -> float:
        return cumulative_logprob / max(num_tokens, 1) ** self.params.length_penalty

    def select(self) -> list[Continuation]:
        """The continuations that survive this step, best first; records finished hypotheses."""
        width = self.params.beam_width
        pool = sorted(
            (
                (beam.cumulative_logprob + logprob, order, token_id, beam, logprob)
                for order, beam in enumerate(self.members)
                for token_id, logprob in self.held[beam.request_id].items()
                if logprob != -math.inf  # ruled out by the beam's grammar
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: 2 * width]
        candidates, self.held = self.held, {}
        kept: list[Continuation] = []
        for rank, (total, _, token_id, beam, logprob) in enumerate(pool):
            if not self.params.ignore_eos and token_id == self.eos_token_id:
                if rank < width:
                    tokens = beam.output_token_ids + [token_id]
                    logprobs = beam.output_logprobs + [candidates[beam.request_id]]
                    self.finished.append(
                        Hypothesis(tokens, total, self.score(total, len(tokens)), FinishReason.STOP, logprobs)
                    )
                continue
            kept.append(Continuation(beam, token_id, logprob, candidates[beam.request_id]))
            if len(kept) == width:
                break
        return kept

    def should_stop(self, num_generated: int) -> bool:
        """No live beam can still beat the worst of ``beam_width`` finished hypotheses."""
        if len(self.finished) < self.params.beam_width:
            return False
        best_running = max((b.cumulative_logprob for b in self.members), default=float("-inf"))
        worst_finished = sorted(h.score for h in self.finished)[-self.params.beam_width]
        return self.score(best_running, num_generated) <= worst_finished

    def results(self) -> list[Hypothesis]:
        """The ``beam_width`` best hypotheses (live beams count as finished by length)."""
        hyps = self.finished + [
            Hypothesis(
                list(b.output_token_ids),
                b.cumulative_logprob,
                self.score(b.cumulative_logprob, b.num_output_tokens),
                FinishReason.LENGTH,
                list(b.output_logprobs),
            )
            for b in self.members
        ]
        return sorted(hyps, key=lambda h: h.score, reverse=True)[: self.params.beam_width]


def after_step(scheduler: Scheduler, groups: Iterable[BeamGroup], ended: dict[str, list[EndedRequest]]) -> None:
    """What a step means for beam searches, once the scheduler applied it (``update_from_output``,
    which held each beam's candidates): the beams the scheduler ended on its own (``ended``, by
    gang id) settled, then a beam step for every search whose live beams all sampled."""
    for group in groups:
        if (records := ended.get(group.gang_id)) is not None and not group.done:
            if any(record.whole_gang for record in records):  # it can never fit: it ends with what it has
                finish(scheduler, group)
            else:
                drop_members(scheduler, group, [record.request.request_id for record in records])
        if not group.done and group.ready():
            advance(scheduler, group)


def drop_members(scheduler: Scheduler, group: BeamGroup, beam_ids: list[str]) -> None:
    """Beams that ended apart from their search (out of KV cache, aborted): the rest go on, and
    the search ends once none is left."""
    dropped = set(beam_ids)
    group.members = [beam for beam in group.members if beam.request_id not in dropped]
    for beam_id in dropped:
        group.held.pop(beam_id, None)
    if not group.members:
        finish(scheduler, group)
    elif group.ready():
        advance(scheduler, group)


def advance(scheduler: Scheduler, group: BeamGroup) -> None:
    """One beam step, once every live beam has its candidates: keep the best continuations,
    fork beams chosen more than once (sharing their blocks), free the others."""
    chosen: dict[str, list[Continuation]] = {}
    for continuation in group.select():
        chosen.setdefault(continuation.parent.request_id, []).append(continuation)
    survivors = []
    dropped = []
    lineage: list[tuple[str, str | None, int]] = []
    for beam in group.members:
        picks = chosen.get(beam.request_id)
        if not picks:
            dropped.append(beam.request_id)
            lineage.append((beam.request_id, None, -1))
            continue
        for pick in picks[1:]:
            child = replace(
                beam,
                request_id=f"{group.gang_id}#{group.next_index}",
                output_token_ids=list(beam.output_token_ids),
                output_logprobs=list(beam.output_logprobs),
            )
            group.next_index += 1
            scheduler.fork(beam, child)
            child.append_output_token(pick.token_id, pick.logprob, pick.candidates)
            survivors.append(child)
            lineage.append((beam.request_id, child.request_id, pick.token_id))
        beam.append_output_token(picks[0].token_id, picks[0].logprob, picks[0].candidates)
        survivors.append(beam)
        lineage.append((beam.request_id, beam.request_id, picks[0].token_id))
    scheduler.finish_requests(dropped, RequestStatus.FINISHED_ABORTED)
    group.members = survivors
    if group.params.structured_outputs is not None:
        group.lineage.append(lineage)
    num_generated = survivors[0].num_output_tokens if survivors else 0
    if not survivors or num_generated >= survivors[0].max_tokens or group.should_stop(num_generated):
        finish(scheduler, group)


def finish(scheduler: Scheduler, group: BeamGroup) -> None:
    """The search is over: rank the hypotheses (live beams count as finished by length), free
    every live beam (those the scheduler already ended are gone from it)."""
    group.hypotheses = group.results()
    _end(scheduler, group, RequestStatus.FINISHED_LENGTH)


def abort(scheduler: Scheduler, group: BeamGroup) -> None:
    """The search is aborted (or failed): every live beam is freed, no hypothesis is kept."""
    _end(scheduler, group, RequestStatus.FINISHED_ABORTED)


def _end(scheduler: Scheduler, group: BeamGroup, status: RequestStatus) -> None:
    scheduler.finish_requests([beam.request_id for beam in group.members], status)
    group.members = []
    group.done = True
