"""Verifying a run of draft tokens against the target model's own samples.

A step that verifies drafts ``d_1..d_k`` computes the target's logits at every position of the
run, and the sampler draws a token ``t_j`` at each position ``j`` exactly as it would without
speculation: the same penalties, masks and warping, with the context as if ``d_1..d_j`` were
already accepted (and, for a seeded request, the noise of that output position). Then
``d_1..d_a`` are accepted while ``t_j == d_{j+1}``, and ``t_a`` (the first disagreement, or the
bonus token after ``d_k``) ends the run.

This is the rejection rule of Leviathan et al. and Chen et al. for drafts proposed
deterministically (n-gram lookups, a greedy draft model), where the draft distribution ``q`` is
one-hot on ``d``: accepting with probability ``min(1, p(d) / q(d)) = p(d)`` is drawing
``t ~ p`` and checking ``t == d``, and on rejection the residual ``max(p - q, 0)`` renormalized is
``p`` with ``d`` removed, which is ``t``'s distribution given ``t != d``. So every token has the
target's distribution; greedy outputs equal the outputs without speculation, and so do seeded
ones (each position draws the noise it would have drawn).
"""

from __future__ import annotations

from raypaged.core.outputs import SampledToken


def accepted_run(samples: list[SampledToken], drafts: list[int]) -> list[SampledToken]:
    """The tokens a step keeps: ``samples`` (the target's token at each of the ``len(drafts) + 1``
    positions) up to and including the first that disagrees with its draft."""
    for j, draft in enumerate(drafts):
        if samples[j].token_id != draft:
            return samples[: j + 1]
    return samples
