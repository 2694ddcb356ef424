"""Finish reasons are an enum that stays equal to, and serializes as, the strings
users and clients see."""

import json

from raypaged import LLM, SamplingParams
from raypaged.outputs import FinishReason
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)


def test_outputs_carry_finish_reason_members(tiny_model_dir):  # noqa: F811
    llm = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=16, max_model_len=128)
    [by_length] = llm.generate("hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    completion = by_length.outputs[0]
    assert completion.finish_reason is FinishReason.LENGTH and completion.finish_reason == "length"
    first = completion.token_ids[0]
    [by_stop] = llm.generate(
        "hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, stop_token_ids=[first]), use_tqdm=False
    )
    assert by_stop.outputs[0].finish_reason is FinishReason.STOP
    assert by_stop.outputs[0].stop_reason == first
    assert json.dumps({"finish_reason": completion.finish_reason}) == '{"finish_reason": "length"}'
    assert [str(reason) for reason in FinishReason] == ["stop", "length", "abort", "error"]
