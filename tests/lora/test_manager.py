"""A worker's LoRA manager on a tiny Llama: CPU cache and slots, and outputs unchanged across
eviction and reload."""

from __future__ import annotations

import pytest
import torch

from raypaged.lora.config import LoRAConfig
from raypaged.lora.manager import LoRAManager
from raypaged.lora.registry import UnknownLoRAError
from raypaged.lora.request import LoRARequest
from raypaged.model.parallel import TensorParallel
from tests.lora.conftest import load_raypaged, make_peft_adapter, prefill_logits

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def requests(tmp_path_factory, tiny_llama_dir) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("tiny_adapters")
    targets = [["q_proj", "o_proj"], ["gate_proj", "down_proj"], "all-linear"]
    return [LoRARequest(f"ad{i}", i, str(make_peft_adapter(tiny_llama_dir, root / f"ad{i}", seed=i, std=0.3, r=2 * i,
                                                               target_modules=targets[i - 1])))
            for i in (1, 2, 3)]


def new_manager(tiny_llama_dir, **config) -> tuple[LoRAManager, torch.nn.Module]:
    model = load_raypaged(tiny_llama_dir)
    return LoRAManager(model, LoRAConfig(**config), TensorParallel(), torch.float32, torch.device("cpu")), model


def logits_with(manager: LoRAManager, model, lora_int_id: int | None) -> torch.Tensor:
    manager.set_mapping([lora_int_id] * sum(map(len, PROMPTS)))
    return torch.cat(prefill_logits(model, PROMPTS))


def test_outputs_survive_eviction_from_the_device_and_the_cpu_cache(tiny_llama_dir, requests):
    manager, model = new_manager(tiny_llama_dir, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    for request in requests:
        manager.add(request)
    assert manager.cpu_cached_ids() == [2, 3]  # the least recently used fell out
    assert manager.acquire(1) == 0  # read again from its folder
    first = logits_with(manager, model, 1)
    base = logits_with(manager, model, None)
    assert (first - base).abs().max() > 0.1
    assert manager.acquire(2) is None  # the one slot is held
    manager.release(1)
    assert manager.acquire(2) == 0  # adapter 1 evicted from the slot
    assert not torch.equal(logits_with(manager, model, 2), first)
    with pytest.raises(ValueError, match=r"^LoRA adapter 1 is not in a device slot \(acquire it first\)$"):
        manager.set_mapping([None, 1])
    manager.release(2)
    manager.acquire(3)
    manager.release(3)
    assert manager.acquire(1) == 0
    torch.testing.assert_close(logits_with(manager, model, 1), first, rtol=0, atol=0)


def test_remove_and_unknown_ids(tiny_llama_dir, requests):
    manager, model = new_manager(tiny_llama_dir, max_loras=2, max_lora_rank=8)
    manager.add(requests[0])
    manager.add(requests[0])  # the same adapter again: nothing to do
    with pytest.raises(ValueError, match=r"^lora_int_id 1 of 'other' is already used by 'ad1'$"):
        manager.add(LoRARequest("other", 1, requests[1].lora_path))
    manager.acquire(1)
    with pytest.raises(ValueError, match=r"^LoRA adapter 1 is in use by 1 running requests$"):
        manager.remove(1)
    manager.release(1)
    base = logits_with(manager, model, None)
    manager.remove(1)
    assert all(not linear.lora_a.any() and not linear.lora_b.any() for linear in manager.lora_model.linears.values())
    with pytest.raises(UnknownLoRAError, match=r"^no LoRA adapter has lora_int_id 1$"):
        manager.acquire(1)
    with pytest.raises(UnknownLoRAError, match=r"^no LoRA adapter has lora_int_id 1$"):
        manager.remove(1)
    torch.testing.assert_close(logits_with(manager, model, None), base, rtol=0, atol=0)


def test_a_mapping_of_another_step_is_an_error_and_clearing_it_runs_the_base(tiny_llama_dir, requests):
    manager, model = new_manager(tiny_llama_dir, max_loras=1, max_lora_rank=8)
    manager.add(requests[2])
    manager.acquire(3)
    manager.set_mapping([None] * 7)
    base = logits_with(manager, model, None)
    manager.set_mapping([3, 3, 3])
    with pytest.raises(RuntimeError, match=r"^the LoRA mapping is for 3 tokens but the step has 7$"):
        prefill_logits(model, PROMPTS)
    manager.clear_mapping()
    torch.testing.assert_close(torch.cat(prefill_logits(model, PROMPTS)), base, rtol=0, atol=0)


def test_a_linear_no_active_adapter_touches_runs_its_base_alone(tiny_llama_dir, requests):
    manager, _ = new_manager(tiny_llama_dir, max_loras=2, max_lora_rank=8)
    manager.add(requests[0])  # rank 2 on q_proj and o_proj
    manager.add(requests[2])  # rank 6 on every projection
    manager.acquire(1)
    linears = manager.lora_model.linears
    ranks = {path.rsplit(".", 1)[1]: linear.slot_ranks for path, linear in linears.items() if ".0." in path}
    assert ranks == {"qkv_proj": [2, 0], "o_proj": [2, 0], "gate_up_proj": [0, 0], "down_proj": [0, 0]}
    manager.acquire(3)
    assert linears["model.layers.0.self_attn.qkv_proj"].slot_ranks == [2, 18]  # q, k and v stacked
    manager.set_mapping([1, 1, None])
    gate_up = linears["model.layers.1.mlp.gate_up_proj"]
    x = torch.randn(3, 64)
    assert torch.equal(gate_up(x), gate_up.base(x))
    manager.release(1)
    manager.remove(1)
    assert linears["model.layers.0.self_attn.o_proj"].slot_ranks == [0, 6]
