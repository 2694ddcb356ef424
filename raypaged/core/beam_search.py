"""Beam search over forked sequences.

Every live beam of a group computes its next-token log-probabilities (the
top ``2 * beam_width``); once all have, the group keeps the ``beam_width``
best continuations by cumulative log-probability. A beam chosen k times is
forked k-1 times (its blocks shared), a beam not chosen is freed, and a
continuation that is EOS becomes a finished hypothesis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from raypaged.core.request import Request
from raypaged.outputs import FinishReason
from raypaged.sampling_params import BeamSearchParams

__all__ = ["BeamGroup", "BeamSearchParams", "Continuation", "Hypothesis"]


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


@dataclass(eq=False)
class BeamGroup:
    group_id: str
    params: BeamSearchParams
    eos_token_id: int | None
    beams: list[Request] = field(default_factory=list)  # live
    finished: list[Hypothesis] = field(default_factory=list)
    candidates: dict[str, dict[int, float]] = field(default_factory=dict)  # beam id -> token -> logprob
    done: bool = False
    hypotheses: list[Hypothesis] = field(default_factory=list)  # the ranked result, once done
    next_index: int = 1
    # constrained groups: per beam step, (parent beam id, beam id or None if dropped, token appended);
    # the engine takes these to fork and advance the beams' grammar states
    lineage: list[list[tuple[str, str | None, int]]] = field(default_factory=list)

    def score(self, cumulative_logprob: float, num_tokens: int) -> float:
        return cumulative_logprob / max(num_tokens, 1) ** self.params.length_penalty

    def ready(self) -> bool:
        return bool(self.beams) and all(beam.request_id in self.candidates for beam in self.beams)

    def select(self) -> list[Continuation]:
        """The continuations that survive this step, best first; records finished hypotheses."""
        width = self.params.beam_width
        pool = sorted(
            (
                (beam.cumulative_logprob + logprob, order, token_id, beam, logprob)
                for order, beam in enumerate(self.beams)
                for token_id, logprob in self.candidates[beam.request_id].items()
                if logprob != -math.inf  # ruled out by the beam's grammar
            ),
            key=lambda c: (-c[0], c[1], c[2]),
        )[: 2 * width]
        candidates, self.candidates = self.candidates, {}
        kept: list[Continuation] = []
        for rank, (total, _, token_id, beam, logprob) in enumerate(pool):
            if not self.params.ignore_eos and token_id == self.eos_token_id:
                if rank < width:
                    tokens = beam.output_token_ids + [token_id]
                    logprobs = beam.output_logprobs + [candidates[beam.request_id]]
                    self.finished.append(Hypothesis(tokens, total, self.score(total, len(tokens)), FinishReason.STOP, logprobs))
                continue
            kept.append(Continuation(beam, token_id, logprob, candidates[beam.request_id]))
            if len(kept) == width:
                break
        return kept

    def should_stop(self, num_generated: int) -> bool:
        """No live beam can still beat the worst of ``beam_width`` finished hypotheses."""
        if len(self.finished) < self.params.beam_width:
            return False
        best_running = max((b.cumulative_logprob for b in self.beams), default=float("-inf"))
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
            for b in self.beams
        ]
        return sorted(hyps, key=lambda h: h.score, reverse=True)[: self.params.beam_width]
