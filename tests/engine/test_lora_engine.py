"""Multi-LoRA in the engine, with SmolLM2 and three adapters made by ``peft``: one batch mixes the
adapters and the base model, with more adapters in flight than device slots, and every request's
greedy tokens equal ``peft``'s for its adapter (the base model's for the others)."""

from __future__ import annotations

import re

import pytest

from raypaged.config import EngineConfig
from raypaged.engine.llm_engine import LLMEngine
from raypaged.lora.request import LoRARequest
from raypaged.sampling_params import SamplingParams
from tests.conftest import hf_greedy_batch, make_peft_adapter

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(smollm2_adapters) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(smollm2_adapters.items())}


@pytest.fixture(scope="module")
def expected(smollm2_dir, adapters, peft_smollm2) -> dict[tuple[str | None, str], list[int]]:
    """peft's greedy tokens for each (adapter or None, prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    with peft_smollm2.disable_adapter():
        found = dict(zip([(None, p) for p in PROMPTS], hf_greedy_batch(peft_smollm2, ids, MAX_TOKENS)))
    for name in adapters:
        peft_smollm2.set_adapter(name)
        found |= zip([(name, p) for p in PROMPTS], hf_greedy_batch(peft_smollm2, ids, MAX_TOKENS))
    return found


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return LLMEngine(
        EngineConfig(
            model=str(smollm2_dir),
            dtype="float32",
            num_gpu_blocks_override=256,
            max_model_len=512,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=16,
        )
    )


def run(engine: LLMEngine, jobs: list[tuple[str | None, str]], adapters: dict[str, LoRARequest]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = {
        engine.add_request(prompt, params, lora_request=adapters[name] if name else None): (name, prompt)
        for name, prompt in jobs
    }
    found = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                found[ids[output.request_id]] = output.outputs[0].token_ids
    return found


def test_one_batch_of_three_adapters_and_the_base_model_equals_peft(engine, adapters, expected):
    jobs = [(name, prompt) for prompt in PROMPTS for name in [None, *adapters]]  # 12 requests, 2 slots
    assert run(engine, jobs, adapters) == {job: expected[job] for job in jobs}
    assert len({expected[(name, PROMPTS[0])][0] for name in [None, *adapters]}) > 1  # the adapters do differ
    stats = engine.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
    # again, now that prompts are in the prefix cache: each adapter's blocks are its own
    assert run(engine, jobs[::-1], adapters) == {job: expected[job] for job in jobs}


def test_bad_adapters_are_refused_by_name(engine, adapters, smollm2_dir, tmp_path):
    params = SamplingParams(max_tokens=2)
    big = LoRARequest(
        "big",
        9,
        str(make_peft_adapter(smollm2_dir, tmp_path / "big", 0, r=32, lora_alpha=32, target_modules=["q_proj"])),
    )
    with pytest.raises(ValueError, match=re.escape("rank 32") + ".*" + re.escape("16")):
        engine.add_request("x", params, lora_request=big)
    first = next(iter(adapters.values()))
    engine.check_lora(first)  # known to the engine whichever test ran before
    with pytest.raises(ValueError, match=re.escape(f"clashes with {first.lora_name!r} (lora_int_id 1")):
        engine.add_request("x", params, lora_request=LoRARequest("other", 1, first.lora_path))
    assert not engine.has_unfinished_requests()


def test_lora_off_refuses_an_adapter(smollm2_dir, adapters):
    engine = LLMEngine(
        EngineConfig(model=str(smollm2_dir), dtype="float32", num_gpu_blocks_override=32, max_model_len=256)
    )
    with pytest.raises(ValueError, match=re.escape("LoRA adapter 'qv-r4' asked for, but LoRA is off (--enable-lora")):
        engine.add_request("x", SamplingParams(max_tokens=2), lora_request=adapters["qv-r4"])


def test_llm_generate_takes_one_lora_request_or_one_per_prompt(smollm2_dir, adapters, expected):
    from raypaged import LLM
    from raypaged import LoRARequest as Exported

    assert Exported is LoRARequest
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        num_gpu_blocks_override=128,
        max_model_len=512,
        enable_lora=True,
        max_loras=1,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [None, *adapters]
    per_prompt = llm.generate(
        [PROMPTS[0]] * len(names), params, use_tqdm=False, lora_request=[adapters[n] if n else None for n in names]
    )
    assert [o.outputs[0].token_ids for o in per_prompt] == [expected[(n, PROMPTS[0])] for n in names]
    one = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=adapters["qv-r4"])
    assert [o.outputs[0].token_ids for o in one] == [expected[("qv-r4", p)] for p in PROMPTS]
    with pytest.raises(ValueError, match="got 2 lora_request for 3 prompts"):
        llm.generate(PROMPTS, params, lora_request=[None, None])
    conversation = [{"role": "user", "content": PROMPTS[0]}]
    rendered = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    chat = llm.chat(conversation, params, use_tqdm=False, lora_request=adapters["qv-r4"])[0].outputs[0].token_ids
    generated = llm.generate(
        {"prompt_token_ids": list(rendered)}, params, lora_request=adapters["qv-r4"], use_tqdm=False
    )
    assert chat == generated[0].outputs[0].token_ids
    assert chat != llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].token_ids  # the adapter changes it


def test_lora_info_names_running_and_waiting_adapters(engine, adapters):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    names = list(adapters)
    for name in names:  # three adapters, two slots: the third waits
        engine.add_request(PROMPTS[0], params, lora_request=adapters[name])
    engine.add_request(PROMPTS[0], params)
    engine.step()
    assert engine.lora_info() == (sorted(names[:2]), [names[2]])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.lora_info() == ([], [])


def test_adapters_never_share_prefix_cache_blocks(engine, adapters):
    params = SamplingParams(temperature=0, max_tokens=1)
    prompt = "A prompt long enough to fill two blocks of sixteen tokens, so that a prefix-cache hit would show up here."

    def cached(lora: LoRARequest | None) -> int:
        request_id = engine.add_request(prompt, params, lora_request=lora)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.finished:
                    found = output.num_cached_tokens
        return found

    first, second = adapters["qv-r4"], adapters["kogd-r16"]
    assert cached(None) == 0
    assert cached(first) == 0 and cached(second) == 0  # the base model's blocks are not theirs
    hits = cached(None)
    assert hits >= 16 and cached(first) == hits and cached(second) == hits  # each finds its own
