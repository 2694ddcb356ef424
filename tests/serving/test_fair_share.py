"""Under FCFS the prompts of one multi-prompt completion share the batch as one request.

The gateway marks each prompt's engine request with the completion's id
(``GenerateRequest.parent_request_id``); at ``max_num_seqs`` a later request with nothing
running takes the slot of the newest prompt and gives it back when it ends.
"""

from __future__ import annotations

import json
import threading

import pytest

from tests.serving.conftest import Stack, tiny_config

MAX_NUM_SEQS = 4
CANARY = {"model": "tiny", "prompt": "The canary sings", "max_tokens": 6, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    stack = Stack([tiny_config(tiny_model_dir, "tiny", num_gpu_blocks_override=256, max_model_len=512, max_num_seqs=4)])
    yield stack
    stack.close()


def test_a_request_sent_later_does_not_wait_for_the_prompts_of_a_multi_prompt_completion(stack):
    with stack.client() as client:
        alone = client.post("/v1/completions", json=CANARY).json()["choices"][0]["text"]
    big = {
        "model": "tiny",
        "prompt": [f"prompt number {i}" for i in range(2 * MAX_NUM_SEQS)],
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    canary: dict[str, str] = {}
    done = threading.Event()

    def send_canary() -> None:
        with stack.client() as client:
            canary["text"] = client.post("/v1/completions", json=CANARY).json()["choices"][0]["text"]
        done.set()

    started: set[int] = set()
    canary_done_at_first_finish = None
    finished = 0
    with stack.client() as client, client.stream("POST", "/v1/completions", json=big) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                started.add(choice["index"])
                if choice["finish_reason"] is not None:
                    if canary_done_at_first_finish is None:
                        canary_done_at_first_finish = done.is_set()
                    finished += 1
            if len(started) == MAX_NUM_SEQS and not canary:
                canary["sent"] = "yes"
                threading.Thread(target=send_canary).start()
    assert finished == 2 * MAX_NUM_SEQS
    assert done.wait(30)
    # the first prompts held every slot for 400 tokens; the canary took the newest one's and ended first
    assert canary_done_at_first_finish is True
    assert canary["text"] == alone
    stats = stack.engine().stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
