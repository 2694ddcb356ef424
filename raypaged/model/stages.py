"""How pipeline parallelism splits a model's layers over its stages (no torch: the config checks it)."""

from __future__ import annotations


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Each pipeline stage's layers: ``num_layers // num_stages`` each, the remainder one more each on the stages
    before the last, from the last but one back (the last stage also runs the LM head), as vLLM splits them."""
    sizes = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        sizes[-i] += 1
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]
