"""The sampler on the logits' device: every sampling mode gives on CUDA the tokens and logprobs it
gives on the CPU (seeded rows draw the same CPU noise on both), and the runner samples where the
logits are."""

import pytest
import torch

from raypaged.sampling_params import SamplingParams
from raypaged.worker import model_runner
from raypaged.worker.sampler import SamplingInput, sample
from tests.gpu import NEEDS_CUDA_AND_CUPY

pytestmark = NEEDS_CUDA_AND_CUPY

VOCAB, EOS = 4096, 2
DETERMINED = [  # every row whose token the CPU run fixes exactly (greedy, or seeded)
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.4),
    SamplingParams(temperature=0.0, min_tokens=10, max_tokens=20, stop_token_ids=[7]),
    SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
    SamplingParams(temperature=0.0, allowed_token_ids=[3, 40, 500]),
    SamplingParams(temperature=0.0),  # bad words, below
    SamplingParams(temperature=0.9, seed=5),
    SamplingParams(temperature=0.8, top_k=20, seed=6, logprobs=2),
    SamplingParams(temperature=1.1, top_p=0.7, seed=7),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, seed=8),
    SamplingParams(temperature=0.7, seed=9, repetition_penalty=1.1),
]


DETERMINED[7].bad_words_token_ids = [[40, 11], [9]]  # 11 follows the output's 40; 9 is always banned


def _inputs(params: list[SamplingParams]) -> list[SamplingInput]:
    return [SamplingInput(p, [5, 6, 7, 11], [10 + i, 11, 40, 40], EOS, i % 2) for i, p in enumerate(params)]


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_every_sampling_mode_on_cuda_equals_the_cpu():
    batch = _inputs(DETERMINED)
    logits = _logits(len(batch))
    on_cpu = sample(logits, batch, torch.Generator().manual_seed(0))
    on_gpu = sample(logits.cuda(), batch, torch.Generator(device="cuda").manual_seed(0))
    assert [t.token_id for t in on_gpu] == [t.token_id for t in on_cpu]
    for row, (gpu, cpu) in enumerate(zip(on_gpu, on_cpu)):
        assert gpu.logprob == pytest.approx(cpu.logprob, abs=1e-4), row
        if cpu.top_logprobs is None:
            assert gpu.top_logprobs is None, row
            continue
        assert list(gpu.top_logprobs) == list(cpu.top_logprobs), row
        for token, entry in cpu.top_logprobs.items():
            assert gpu.top_logprobs[token].rank == entry.rank, row
            assert gpu.top_logprobs[token].logprob == pytest.approx(entry.logprob, abs=1e-4), row


def test_unseeded_rows_draw_on_the_device_within_their_top_k():
    params = [SamplingParams(temperature=1.0, top_k=5)] * 64
    logits = _logits(64).cuda()
    tokens = sample(logits, _inputs(params), torch.Generator(device="cuda").manual_seed(0))
    top5 = logits.topk(5, dim=-1).indices.tolist()
    assert all(t.token_id in allowed for t, allowed in zip(tokens, top5))
    again = sample(logits, _inputs(params), torch.Generator(device="cuda").manual_seed(0))
    assert [t.token_id for t in again] == [t.token_id for t in tokens]  # the device generator's stream


def test_the_runner_samples_on_the_logits_device(monkeypatch):
    seen = []
    inner = model_runner.sample

    def spy(logits, inputs, generator):
        seen.append((logits.device.type, generator.device.type))
        return inner(logits, inputs, generator)

    monkeypatch.setattr(model_runner, "sample", spy)
    from raypaged import LLM

    llm = LLM(model=str(_tiny_model_dir()), load_format="dummy", device="cuda", max_model_len=128)
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4
    assert seen and set(seen) == {("cuda", "cuda")}


def _tiny_model_dir():
    import tempfile
    from pathlib import Path

    from raypaged.model.synthetic import write_synthetic_model

    return write_synthetic_model(
        Path(tempfile.mkdtemp()) / "tiny",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
