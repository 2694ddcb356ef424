"""vLLM's --hf-overrides (``LLM(hf_overrides=...)``): a JSON object read as if the model's config.json held it,
an object merged into the one it names; the model then runs as transformers runs that config."""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from raypaged import LLM, SamplingParams
from raypaged.entrypoints.cli import build_parser, engine_configs
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

PROMPT = [1, 523, 9001, 77, 4100, 12]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_the_flag_merges_into_the_models_config(tiny_model_dir):
    [config] = engine_configs(
        build_parser().parse_args(
            [
                "serve",
                str(tiny_model_dir),
                "--hf-overrides",
                '{"max_position_embeddings": 96, "rope_parameters": {"rope_theta": 1000.0}}',
            ]
        )
    )
    assert config.hf_config.max_position_embeddings == 96 and config.resolved_max_model_len == 96
    assert config.hf_config.rope_parameters == {"rope_theta": 1000.0, "rope_type": "default"}


def tokens(llm: LLM) -> list[int]:
    try:
        [output] = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return list(output.outputs[0].token_ids)


def test_the_model_runs_its_overridden_config_as_transformers_does(tiny_model_dir):
    options = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "num_gpu_blocks_override": 32}
    llm = LLM(str(tiny_model_dir), hf_overrides={"rope_parameters": {"rope_theta": 50.0}}, **options)
    hf_config = llm.llm_engine.config.hf_config
    ours = tokens(llm)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=hf_config, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
    assert ours == out[0, len(PROMPT) :].tolist()
    assert ours != tokens(LLM(str(tiny_model_dir), **options))  # the override changed the model


def test_an_override_the_model_cannot_run_is_refused_at_startup(tiny_model_dir):
    with pytest.raises(ValueError, match=re.escape("rope type 'sliding' is not supported")):
        LLM(str(tiny_model_dir), hf_overrides={"rope_parameters": {"rope_type": "sliding"}})
    with pytest.raises(ValueError, match=re.escape("--hf-overrides takes a JSON object, got [1]")):
        LLM(str(tiny_model_dir), hf_overrides=[1])
