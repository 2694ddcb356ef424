"""generation_config.json as vLLM reads it: every EOS id stops, and its sampling defaults fill
what a request leaves unset (LLM, gRPC and HTTP), on a copy of the real SmolLM2 weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig, GenerationDefaults
from raypaged.inputs.limits import InputLimits
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.protocol import sampling_params_from_proto
from tests.serving.conftest import Stack

pytestmark = pytest.mark.slow
STORY = "Once upon a time"  # its 5th greedy token becomes a second EOS id
CAPITAL = "The capital of France is"  # its greedy run ends on the primary EOS (id 2) at token 30
WRITE = [{"role": "user", "content": "Write a story about a dragon."}]
SMALL = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=64)


def greedy(llm: LLM, prompt: str, **params):
    return llm.generate(prompt, SamplingParams(temperature=0, **params))[0].outputs[0]


def model_copy(root: Path, smollm2_dir: Path, generation_config: dict | None) -> Path:
    """SmolLM2's config, tokenizer and (linked) weights, with this generation config or none."""
    root.mkdir(parents=True, exist_ok=True)
    for path in smollm2_dir.iterdir():
        if path.name == "model.safetensors":
            (root / path.name).symlink_to(path)
        elif path.name != "generation_config.json":
            shutil.copy(path, root / path.name)
    if generation_config is not None:
        (root / "generation_config.json").write_text(json.dumps(generation_config))
    return root


@pytest.fixture(scope="module")
def reference(smollm2_llm):
    """Unmodified greedy runs of 30 tokens, EOS ignored."""
    return {
        prompt: greedy(smollm2_llm, prompt, max_tokens=30, ignore_eos=True).token_ids for prompt in (STORY, CAPITAL)
    }


@pytest.fixture(scope="module")
def extra_eos(reference) -> int:
    token_id = reference[STORY][4]
    assert token_id != 2 and token_id not in reference[CAPITAL] and token_id not in reference[CAPITAL][:7]
    return token_id


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, smollm2_dir, extra_eos) -> Path:
    config = {"bos_token_id": 1, "eos_token_id": [2, extra_eos], "temperature": 0, "max_new_tokens": 7}
    return model_copy(tmp_path_factory.mktemp("generation_config") / "model", smollm2_dir, config)


@pytest.fixture(scope="module")
def llm(gen_dir):
    return LLM(model=str(gen_dir), **SMALL)


@pytest.fixture(scope="module")
def stack(gen_dir):
    auto = EngineConfig(model=str(gen_dir), served_model_name="auto", **SMALL)
    overridden = EngineConfig(
        model=str(gen_dir),
        served_model_name="vllm",
        generation_config="vllm",
        override_generation_config={"max_new_tokens": 3},
        **SMALL,
    )
    stack = Stack([auto, overridden])
    yield stack
    stack.close()


def grpc_tokens(stack: Stack, **fields) -> tuple[list[int], int, int | str]:
    """(token ids, finish reason, stop reason: the stop token id, else the stop string) of one gRPC Generate."""
    ids, reason, stop_reason = [], pb.FINISH_REASON_UNSPECIFIED, ""
    for response in stack.grpc_stub().Generate(pb.GenerateRequest(**fields)):
        for delta in response.outputs:
            ids.extend(delta.token_ids)
            if delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                reason = delta.finish_reason
                stop_reason = delta.stop_token_id if delta.HasField("stop_token_id") else delta.stop_reason
    return ids, reason, stop_reason


# ---- every EOS id stops ------------------------------------------------------
def test_a_second_eos_id_stops_with_its_id_as_stop_reason(llm, reference, extra_eos):
    assert llm.llm_engine.eos_token_ids == (2, extra_eos) and llm.llm_engine.eos_token_id == 2
    out = greedy(llm, STORY, max_tokens=30)
    assert out.token_ids == reference[STORY][:5] and out.token_ids[-1] == extra_eos
    assert (out.finish_reason, out.stop_reason) == ("stop", extra_eos)


def test_the_primary_eos_stops_with_no_stop_reason(llm, reference):
    out = greedy(llm, CAPITAL, max_tokens=30)
    assert out.token_ids == reference[CAPITAL] and out.token_ids[-1] == 2
    assert (out.finish_reason, out.stop_reason) == ("stop", None)


def test_ignore_eos_ignores_every_eos_id(llm, reference):
    out = greedy(llm, STORY, max_tokens=30, ignore_eos=True)
    assert out.token_ids == reference[STORY]
    assert (out.finish_reason, out.stop_reason) == ("length", None)


def test_min_tokens_bans_the_second_eos_id_until_reached(llm, reference, extra_eos):
    out = greedy(llm, STORY, max_tokens=30, min_tokens=6)
    tokens = out.token_ids
    assert tokens[:4] == reference[STORY][:4] and tokens[4] != extra_eos
    assert not {2, extra_eos} & set(tokens[:6])  # banned while fewer than min_tokens were generated
    assert not {2, extra_eos} & set(tokens[:-1])
    assert (out.finish_reason == "stop") == (tokens[-1] in (2, extra_eos))
    assert out.finish_reason == "stop" or len(tokens) == 30


def test_user_stop_token_ids_stay_as_given(llm, extra_eos):
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[7])
    out = llm.generate(STORY, params)[0].outputs[0]
    assert params.stop_token_ids == [7]
    assert (out.finish_reason, out.stop_reason) == ("stop", extra_eos)


def test_grpc_and_http_stop_on_the_second_eos_id(stack, llm, reference, extra_eos):
    ids, reason, stop_reason = grpc_tokens(
        stack,
        model="auto",
        text=STORY,
        sampling=pb.SamplingParameters(temperature=0),
        stopping=pb.StoppingCriteria(max_tokens=30),
    )
    assert ids == reference[STORY][:5]
    assert (reason, stop_reason) == (pb.FINISH_REASON_STOP, extra_eos)
    with stack.client() as client:
        body = client.post(
            "/v1/completions", json={"model": "auto", "prompt": STORY, "max_tokens": 30, "temperature": 0}
        ).json()
    [choice] = body["choices"]
    assert choice["text"] == greedy(llm, STORY, max_tokens=30).text
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", extra_eos)  # a number, as vLLM
    assert body["usage"]["completion_tokens"] == 5


# ---- sampling defaults ---------------------------------------------------------
def test_llm_default_sampling_params_are_the_generation_config(llm, reference):
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0, max_tokens=7)
    out = llm.generate(CAPITAL)[0].outputs[0]
    assert out.token_ids == reference[CAPITAL][:7] and out.finish_reason == "length"
    explicit = llm.generate(CAPITAL, SamplingParams(max_tokens=2, seed=3))[0].outputs[0]
    assert len(explicit.token_ids) == 2


def test_server_defaults_fill_only_unset_fields(stack, smollm2_llm, reference):
    ids, reason, _ = grpc_tokens(stack, model="auto", text=CAPITAL)
    assert ids == reference[CAPITAL][:7] and reason == pb.FINISH_REASON_LENGTH
    own, _, _ = grpc_tokens(stack, model="auto", text=CAPITAL, sampling=pb.SamplingParameters(temperature=1, seed=1))
    sampled = smollm2_llm.generate(CAPITAL, SamplingParams(temperature=1, seed=1, max_tokens=7))[0].outputs[0]
    assert own == sampled.token_ids and own != ids
    with stack.client() as client:
        body = client.post("/v1/chat/completions", json={"model": "auto", "messages": WRITE}).json()
    expected = smollm2_llm.chat(WRITE, SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    assert body["choices"][0]["message"]["content"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids) == 7


def test_vllm_mode_ignores_the_file_and_the_override_wins(stack, smollm2_llm, extra_eos):
    engine = stack.engine("vllm")
    assert engine.config.generation_defaults == GenerationDefaults(max_tokens=3)
    ids, reason, _ = grpc_tokens(stack, model="vllm", text=CAPITAL, sampling=pb.SamplingParameters(seed=1))
    sampled = smollm2_llm.generate(CAPITAL, SamplingParams(temperature=1, seed=1, max_tokens=3))[0].outputs[0]
    assert ids == sampled.token_ids and reason == pb.FINISH_REASON_LENGTH
    assert engine.config.generation_eos_token_ids == (2, extra_eos)  # vLLM's "vllm" keeps the EOS ids


def test_proto_defaults_apply_to_its_optional_fields_only():
    defaults = GenerationDefaults(temperature=0.5, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.1, max_tokens=5)
    params = sampling_params_from_proto(pb.GenerateRequest(text="x"), InputLimits(), defaults)
    assert (params.temperature, params.top_p, params.repetition_penalty, params.max_tokens) == (0.5, 0.9, 1.1, 5)
    assert (params.top_k, params.min_p) == (None, 0.0)  # not optional in the message: unset reads as 0
    given = pb.GenerateRequest(
        text="x",
        sampling=pb.SamplingParameters(temperature=0, top_p=1.0, repetition_penalty=1.0),
        stopping=pb.StoppingCriteria(max_tokens=9),
    )
    params = sampling_params_from_proto(given, InputLimits(), defaults)
    assert (params.temperature, params.top_p, params.repetition_penalty, params.max_tokens) == (0.0, 1.0, 1.0, 9)


# ---- reading the generation config -----------------------------------------------
def test_modes_folders_and_missing_files(tmp_path, smollm2_dir):
    bare = model_copy(tmp_path / "bare", smollm2_dir, None)
    config = EngineConfig(model=str(bare))
    assert (config.generation_defaults, config.generation_eos_token_ids) == (GenerationDefaults(), ())
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 9, "top_k": 20, "min_p": 0.05}))
    config = EngineConfig(model=str(bare), generation_config=str(other))
    assert config.generation_defaults == GenerationDefaults(top_k=20, min_p=0.05)
    assert config.generation_eos_token_ids == (9,)
    config = EngineConfig(model=str(bare), generation_config=str(other), override_generation_config={"top_k": 5})
    assert config.generation_defaults.sampling_params() == SamplingParams(top_k=5, min_p=0.05)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"generation_config": "hf"},
            "--generation-config must be auto, vllm or a folder holding generation_config.json, got 'hf'",
        ),
        ({"override_generation_config": [1]}, "--override-generation-config must be a JSON object, got [1]"),
        (
            {"override_generation_config": {"seed": 1}},
            "--override-generation-config: unknown field 'seed'; "
            "allowed: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens",
        ),
        (
            {"override_generation_config": {"temperature": -1}},
            "the generation config's sampling defaults "
            "{'temperature': -1} are invalid: temperature must be non-negative, got -1",
        ),
    ],
)
def test_bad_settings_raise_value_errors(smollm2_dir, kwargs, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(model=str(smollm2_dir), **kwargs)
    assert str(err.value) == message


def test_a_folder_without_the_file_and_a_broken_file_are_errors(tmp_path, smollm2_dir):
    with pytest.raises(ValueError, match=f"--generation-config '{tmp_path}' holds no generation_config.json"):
        EngineConfig(model=str(smollm2_dir), generation_config=str(tmp_path))
    (tmp_path / "generation_config.json").write_text("{broken")
    with pytest.raises(ValueError, match="generation_config.json cannot be read"):
        EngineConfig(model=str(smollm2_dir), generation_config=str(tmp_path))
