"""Mistral's own checkpoint format (vLLM's --config-format mistral and --load-format mistral): params.json and
consolidated.safetensors give transformers' tokens for the same weights in Hugging Face's format, a folder holding
both formats reads Hugging Face's unless told otherwise, and what the reader does not know is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from tests.conftest import hf_greedy, make_tiny_mistral_format

PROMPTS = [[1, 17, 400, 2000, 31], [1, 9000, 120000, 5, 5, 77, 3]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, smollm2_dir):
    return make_tiny_mistral_format(tmp_path_factory.mktemp("mistral"), smollm2_dir)


@pytest.fixture(scope="module")
def expected(folders):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folders[0], dtype=torch.float32).eval()
    return [hf_greedy(model, prompt, 8) for prompt in PROMPTS]


def greedy(model, **options) -> list[list[int]]:
    llm = LLM(model=str(model), num_gpu_blocks_override=32, max_model_len=128, **options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("flags", [{}, {"config_format": "mistral", "load_format": "mistral"}])
def test_params_json_and_consolidated_weights_give_transformers_tokens(folders, expected, flags):
    """No config.json: params.json is read (auto) as with the flags; the query and key rows are permuted back."""
    hf, consolidated = folders
    assert greedy(consolidated, tokenizer=str(hf), **flags) == expected


def test_a_mixtral_in_mistrals_format_gives_transformers_tokens(tmp_path, smollm2_dir):
    """params.json's moe (4 experts, 2 a token) makes a Mixtral; each layer's router and experts are read from
    feed_forward.gate and feed_forward.experts.N.w1/w2/w3."""
    from transformers import AutoModelForCausalLM

    hf, consolidated = make_tiny_mistral_format(tmp_path, smollm2_dir, arch="mixtral")
    config = EngineConfig(model=str(consolidated), tokenizer=str(hf))
    assert config.hf_config.architectures == ["MixtralForCausalLM"] and config.hf_config.num_local_experts == 4
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert greedy(consolidated, tokenizer=str(hf)) == [hf_greedy(model, prompt, 8) for prompt in PROMPTS]


def test_a_folder_with_both_formats_reads_hugging_faces_unless_told(folders, expected, tmp_path):
    """As Mistral's repositories: config.json and model.safetensors beside params.json and consolidated.safetensors.
    auto reads Hugging Face's (the consolidated file is left out, not loaded twice); the flags read Mistral's."""
    hf, consolidated = folders
    both = tmp_path / "both"
    shutil.copytree(hf, both)
    shutil.copy(consolidated / "params.json", both)
    shutil.copy(consolidated / "consolidated.safetensors", both)
    assert EngineConfig(model=str(both)).hf_config.model_type == "mistral"
    assert greedy(both) == expected
    (both / "model.safetensors").rename(both / "model.safetensors.unused")  # only Mistral's weights are left
    assert greedy(both, config_format="mistral", load_format="mistral") == expected
    with pytest.raises(ValueError) as refused:
        greedy(both, config_format="hf")
    assert str(refused.value) == (
        f"no Hugging Face *.safetensors weights in {both}, only Mistral's consolidated*.safetensors (--load-format "
        "mistral reads them)"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"moe": {"num_experts": 8}},
            "--config-format mistral: params.json's 'moe' must hold num_experts and num_experts_per_tok, got "
            '{"num_experts": 8}',
        ),
        (
            {"vision_encoder": {}},
            "--config-format mistral: params.json has 'vision_encoder': Mistral-format image models are not read: "
            "serve the repository's Hugging Face format",
        ),
        ({"yarn": {"factor": 4}}, "--config-format mistral: params.json has 'yarn', which raypaged does not read"),
        ({"n_layers": None}, "--config-format mistral: params.json lacks 'n_layers'"),
    ],
)
def test_what_the_reader_does_not_know_is_refused_by_name(folders, tmp_path, change, message):
    consolidated = tmp_path / "m"
    shutil.copytree(folders[1], consolidated)
    params = json.loads((consolidated / "params.json").read_text())
    params.update(change)
    params = {k: v for k, v in params.items() if v is not None}
    (consolidated / "params.json").write_text(json.dumps(params))
    with pytest.raises(ValueError) as refused:
        EngineConfig(model=str(consolidated), tokenizer=str(folders[0]))
    assert str(refused.value) == message


def test_flags_that_find_no_such_files_are_refused(folders):
    hf, consolidated = folders
    with pytest.raises(ValueError, match=r"^--config-format mistral: .* has no params\.json$"):
        EngineConfig(model=str(hf), config_format="mistral")
    with pytest.raises(ValueError, match=r"^--load-format mistral: .* has no consolidated\*\.safetensors$"):
        greedy(hf, load_format="mistral")


def test_a_hub_id_fetches_one_formats_weights(folders, tmp_path):
    """A repository with both formats (most of Mistral's) fetches Hugging Face's weights unless Mistral's are read;
    one with params.json alone fetches its consolidated files (decided from the configs fetched first)."""
    from raypaged.model.hub import MODEL_FILES, weight_patterns

    hf, consolidated = folders
    both = tmp_path / "both"
    both.mkdir()
    for source in (hf / "config.json", consolidated / "params.json"):
        shutil.copy(source, both)
    mistral = (*[f for f in MODEL_FILES if f != "*.safetensors"], "consolidated*.safetensors")
    assert weight_patterns(hf, "auto", "auto") == (MODEL_FILES, ("consolidated*.safetensors",))
    assert weight_patterns(both, "auto", "auto") == (MODEL_FILES, ("consolidated*.safetensors",))
    assert weight_patterns(both, "mistral", "auto") == (mistral, ())
    assert weight_patterns(both, "hf", "mistral") == (mistral, ())
    assert weight_patterns(consolidated, "auto", "auto") == (mistral, ())
