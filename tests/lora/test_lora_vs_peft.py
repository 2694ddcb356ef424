"""SmolLM2 with three peft-made adapters attached: one mixed forward, and greedy tokens, equal peft's."""

from __future__ import annotations

import pytest
import torch

from raypaged.lora.config import LoRAConfig
from raypaged.lora.manager import LoRAManager
from raypaged.lora.request import LoRARequest
from raypaged.model.parallel import TensorParallel
from tests.conftest import hf_greedy
from tests.lora.conftest import ADAPTERS, load_raypaged, peft_logits, prefill_logits

PROMPTS = [[1, 504, 3458, 282, 260, 4649], [28, 339, 1113, 4533, 30, 216, 2], [9745, 314, 253], [1, 1, 1, 900, 28]]
NUM_NEW_TOKENS = 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def manager(smollm2_dir, smollm2_adapters):
    model = load_raypaged(smollm2_dir)
    manager = LoRAManager(
        model, LoRAConfig(max_loras=3, max_lora_rank=16), TensorParallel(), torch.float32, torch.device("cpu")
    )
    for slot, (name, path) in enumerate(smollm2_adapters.items()):
        manager.place(slot, LoRARequest(name, slot + 1, str(path)))
    return manager, model


# one sequence per adapter and one of the base model, in an order that interleaves them
SEQUENCE_ADAPTERS = ["kogd-r16", None, "qv-r4", "all-r8-rslora"]


@pytest.mark.parametrize("bgmv", [False, True], ids=["segments", "bgmv"])
def test_one_mixed_forward_equals_peft_per_adapter(manager, peft_smollm2, bgmv, monkeypatch):
    """Both mappings: matmuls per active slot, and BGMV's every token by its slot at full rank (on CUDA
    the kernels of kernels/lora_bgmv.cu; here their torch equivalent)."""
    lora, model = manager
    monkeypatch.setattr(lora, "bgmv", bgmv)
    slots = {name: i for i, name in enumerate(ADAPTERS)}
    lora.set_slot_mapping([slots.get(name) for name, p in zip(SEQUENCE_ADAPTERS, PROMPTS) for _ in p])
    assert (lora.lora_model.step.mapping.slot_of is not None) is bgmv
    logits = prefill_logits(model, PROMPTS)
    for name, prompt, got in zip(SEQUENCE_ADAPTERS, PROMPTS, logits):
        want = peft_logits(peft_smollm2, name, prompt)
        # fp32 rounding: peft and raypaged sum in their own orders over 30 layers (up to 2.7e-4 on logits of about
        # 25 with peft 0.21); an adapter moves them by more than 0.5 (below)
        torch.testing.assert_close(got, want, atol=5e-4, rtol=1e-4, msg=f"adapter {name}")
        if name is not None:  # the adapter changes the logits well beyond the tolerance
            assert (want - peft_logits(peft_smollm2, None, prompt)).abs().max() > 0.5


def test_mixed_batch_greedy_tokens_equal_peft_generate(manager, peft_smollm2):
    lora, model = manager
    slots = {name: i for i, name in enumerate(ADAPTERS)}
    sequences = [list(p) for p in PROMPTS]
    for _ in range(NUM_NEW_TOKENS):  # a full forward per token: no cache, every sequence in one batch
        lora.set_slot_mapping([slots.get(name) for name, s in zip(SEQUENCE_ADAPTERS, sequences) for _ in s])
        for seq, logits in zip(sequences, prefill_logits(model, sequences)):
            seq.append(int(logits[-1].argmax()))
    generated = {name: s[len(p) :] for name, s, p in zip(SEQUENCE_ADAPTERS, sequences, PROMPTS)}
    for name, prompt in zip(SEQUENCE_ADAPTERS, PROMPTS):
        if name is None:
            with peft_smollm2.disable_adapter():
                want = hf_greedy(peft_smollm2, prompt, NUM_NEW_TOKENS)
        else:
            peft_smollm2.set_adapter(name)
            want = hf_greedy(peft_smollm2, prompt, NUM_NEW_TOKENS)
            with peft_smollm2.disable_adapter():
                assert want != hf_greedy(peft_smollm2, prompt, NUM_NEW_TOKENS)  # the adapter matters
        assert generated[name] == want, name
