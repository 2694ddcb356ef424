"""``--long-prefill-token-threshold`` (vLLM's): long prompts prefilled in chunks of the threshold, several prompts
sharing a step, give the tokens and logprobs of whole-prompt prefills."""

from __future__ import annotations

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.entrypoints.cli import build_parser, engine_configs
from tests.conftest import make_tiny_model
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[float]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [e[t].logprob for o in outputs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
    logprobs += [e[t].logprob for o in outputs for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    return tokens, logprobs


def test_chunks_of_the_threshold_equal_whole_prefills(tmp_path, smollm2_dir):
    model_dir = make_tiny_model(tmp_path, smollm2_dir)
    prompts = [list(range(100 + i, 100 + i + n)) for i, n in enumerate((41, 7, 23, 3))]
    results = []
    for threshold in (0, 5):
        llm = LLM(model=str(model_dir), num_gpu_blocks_override=64, long_prefill_token_threshold=threshold)
        results.append(run(llm, prompts))
        if threshold:
            assert llm.llm_engine.core.scheduler.config.long_prefill_token_threshold == 5
    assert results[1][0] == results[0][0]
    torch.testing.assert_close(torch.tensor(results[1][1]), torch.tensor(results[0][1]), atol=1e-5, rtol=0)


def test_the_flag_reaches_the_engine_and_a_negative_one_is_refused(tiny_model_dir):
    [config] = engine_configs(
        build_parser().parse_args(["serve", str(tiny_model_dir), "--long-prefill-token-threshold", "1k"])
    )
    assert config.long_prefill_token_threshold == 1000
    with pytest.raises(ValueError) as refused:
        engine_configs(build_parser().parse_args(["serve", str(tiny_model_dir), "--long-prefill-token-threshold=-1"]))
    assert str(refused.value) == "--long-prefill-token-threshold must be 0 or more, got -1"


def test_long_prompt_chunk_is_128_on_cpu_and_a_negative_one_is_refused(tiny_model_dir):
    """On CPU a prompt longer than a step's budget computes 128 tokens a step, leaving the rest to the requests
    arriving during its prefill (a budget of 256 or less: none); ``--long-prompt-chunk 0`` gives it the budget."""

    def config(*flags: str):
        [parsed] = engine_configs(build_parser().parse_args(["serve", str(tiny_model_dir), *flags]))
        return parsed

    default = config()
    assert (default.resolved_max_num_batched_tokens, default.resolved_long_prompt_chunk) == (512, 128)
    assert config("--max-num-batched-tokens", "2k").resolved_long_prompt_chunk == 128
    assert config("--max-num-batched-tokens", "256").resolved_long_prompt_chunk == 0
    assert config("--long-prompt-chunk", "0").resolved_long_prompt_chunk == 0
    assert default.long_prefill_token_threshold == 0  # vLLM's flag keeps vLLM's default
    with pytest.raises(ValueError) as refused:
        config("--long-prompt-chunk=-1")
    assert str(refused.value) == "--long-prompt-chunk must be 0 or more, got -1"
