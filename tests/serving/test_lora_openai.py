"""LoRA adapters over HTTP through the official ``openai`` client, with SmolLM2: adapters named by
``--lora-modules`` and loaded at runtime are models of their own (``/v1/models`` lists them with their
parent); concurrent requests for several adapters and the base model each return what ``peft``
generates for theirs; unloaded and bad adapters are refused by name."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from raypaged.config import EngineConfig
from tests.conftest import hf_greedy, make_peft_adapter
from tests.serving.conftest import Stack

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dirs(smollm2_adapters):
    return smollm2_adapters


@pytest.fixture(scope="module")
def expected(smollm2_dir, adapter_dirs, peft_smollm2) -> dict[str, str]:
    """peft's greedy text for the prompt, per adapter ("smollm2": the base model)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    with peft_smollm2.disable_adapter():
        found = {"smollm2": tokenizer.decode(hf_greedy(peft_smollm2, ids, MAX_TOKENS))}
    for name in adapter_dirs:
        peft_smollm2.set_adapter(name)
        found[name] = tokenizer.decode(hf_greedy(peft_smollm2, ids, MAX_TOKENS))
    return found


@pytest.fixture(scope="module")
def stack(smollm2_dir, adapter_dirs):
    first = next(iter(adapter_dirs))
    stack = Stack(
        [
            EngineConfig(
                model=str(smollm2_dir),
                served_model_name="smollm2",
                dtype="float32",
                num_gpu_blocks_override=256,
                max_model_len=512,
                enable_lora=True,
                max_loras=2,
                max_lora_rank=16,
            )
        ],
        lora_modules={first: str(adapter_dirs[first])},
    )
    yield stack
    stack.close()


def complete(client: openai.OpenAI, model: str) -> str:
    return (
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


def test_adapters_are_models_and_each_answers_as_peft(stack, adapter_dirs, expected):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none")
    names = list(adapter_dirs)
    with httpx.Client(base_url=stack.url) as http:
        for name in names[1:]:
            loaded = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dirs[name])})
            assert (loaded.status_code, loaded.text) == (200, f"Success: LoRA adapter '{name}' added successfully.")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"smollm2", *names}
    assert all(cards[name].parent == "smollm2" and cards[name].root == str(adapter_dirs[name]) for name in names)
    assert cards["smollm2"].parent is None
    jobs = ["smollm2", *names] * 2  # three adapters over two slots, and the base model, at once
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda model: complete(client, model), jobs))
    assert texts == [expected[model] for model in jobs]
    chat = client.chat.completions.create(model=names[1], messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == names[1]
    with httpx.Client(base_url=stack.url) as http:
        metrics = http.get("/metrics").text
    [info] = [line for line in metrics.splitlines() if line.startswith("raypaged:lora_requests_info{")]
    assert 'max_lora="2"' in info and 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info


def test_unloading_and_bad_adapters_are_refused_by_name(stack, adapter_dirs, tmp_path):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none")
    name = list(adapter_dirs)[-1]
    with httpx.Client(base_url=stack.url) as http:
        if name not in {m.id for m in client.models.list().data}:
            http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dirs[name])})
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
        assert (gone.status_code, gone.text) == (200, f"Success: LoRA adapter '{name}' removed successfully.")
        with pytest.raises(openai.NotFoundError, match=f"The model `{name}` does not exist"):
            complete(client, name)
        again = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
        assert again.status_code == 404
        assert again.json()["error"]["message"] == f"The lora adapter '{name}' cannot be found."
        twice = http.post("/v1/load_lora_adapter", json={"lora_name": list(adapter_dirs)[0], "lora_path": "/x"})
        assert twice.status_code == 400 and "has already been loaded" in twice.json()["error"]["message"]
        odd = tmp_path / "odd"
        shutil.copytree(adapter_dirs[list(adapter_dirs)[0]], odd)
        config = json.loads((odd / "adapter_config.json").read_text())
        config["target_modules"] = ["q_proj", "c_attn"]
        (odd / "adapter_config.json").write_text(json.dumps(config))
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "odd", "lora_path": str(odd)})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith(
            "LoRA adapter 'odd' targets module 'c_attn', which the model lacks"
        )
        big = make_peft_adapter(
            stack_model_dir(stack), tmp_path / "big", 0, r=32, lora_alpha=32, target_modules=["q_proj"]
        )
        refused = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "LoRA adapter 'big' has rank 32, above --max-lora-rank 16"
    assert {m.id for m in client.models.list().data} == {"smollm2", *list(adapter_dirs)[:-1]}


def stack_model_dir(stack: Stack) -> str:
    return str(next(iter(stack.engine_server.models.values())).engine.config.model_path)
