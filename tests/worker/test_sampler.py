"""The greedy fast path gives exactly what the general sampler gives, and steps aside when it cannot."""

import pytest
import torch

from raypaged.sampling_params import SamplingParams
from raypaged.worker.sampler import SamplingInput, greedy_fast_path, sample


def inputs(params: SamplingParams, rows: int, output_len: int = 3) -> list[SamplingInput]:
    return [SamplingInput(params, [5, 6, 7], list(range(10, 10 + output_len)), 2) for _ in range(rows)]


def test_greedy_fast_path_equals_sample():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 4
    batch = inputs(SamplingParams(temperature=0.0, max_tokens=8), 6)
    fast = greedy_fast_path(logits, batch)
    general = sample(logits, batch, torch.Generator().manual_seed(0))
    assert [(t.token_id, t.logprob, t.top_logprobs) for t in fast] == [
        (t.token_id, t.logprob, t.top_logprobs) for t in general
    ]
    assert [t.token_id for t in fast] == logits.argmax(-1).tolist()


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
