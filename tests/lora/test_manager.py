"""A worker's LoRA manager on a tiny Llama: slots written where the driver says, the CPU cache,
and outputs unchanged when an adapter leaves its slot and comes back."""

from __future__ import annotations

import shutil

import pytest
import torch

from raypaged.lora.config import LoRAConfig
from raypaged.lora.manager import LoRAManager
from raypaged.lora.request import LoRARequest
from raypaged.model.parallel import TensorParallel
from tests.lora.conftest import load_raypaged, make_peft_adapter, prefill_logits

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
NUM_TOKENS = sum(map(len, PROMPTS))


@pytest.fixture(scope="module")
def requests(tmp_path_factory, tiny_llama_dir) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("tiny_adapters")
    targets = [["q_proj", "o_proj"], ["gate_proj", "down_proj"], "all-linear"]
    return [
        LoRARequest(
            f"ad{i}",
            i,
            str(
                make_peft_adapter(
                    tiny_llama_dir, root / f"ad{i}", seed=i, std=0.3, r=2 * i, target_modules=targets[i - 1]
                )
            ),
        )
        for i in (1, 2, 3)
    ]


def new_manager(tiny_llama_dir, **config) -> tuple[LoRAManager, torch.nn.Module]:
    model = load_raypaged(tiny_llama_dir)
    return LoRAManager(model, LoRAConfig(**config), TensorParallel(), torch.float32, torch.device("cpu")), model


def logits_with(manager: LoRAManager, model, slot: int | None) -> torch.Tensor:
    manager.set_slot_mapping([slot] * NUM_TOKENS)
    return torch.cat(prefill_logits(model, PROMPTS))


def test_an_adapter_replaced_in_its_slot_and_placed_again_gives_the_same_outputs(tiny_llama_dir, requests):
    manager, model = new_manager(tiny_llama_dir, max_loras=1, max_lora_rank=8)
    base = logits_with(manager, model, None)
    manager.place(0, requests[0])
    first = logits_with(manager, model, 0)
    assert (first - base).abs().max() > 0.1
    manager.place(0, requests[1])  # replaces adapter 1 entirely: its q/o columns are zero again
    second = logits_with(manager, model, 0)
    assert (second - first).abs().max() > 0.1
    manager.place(0, requests[0])
    torch.testing.assert_close(logits_with(manager, model, 0), first, rtol=0, atol=0)
    torch.testing.assert_close(logits_with(manager, model, None), base, rtol=0, atol=0)


def test_the_cpu_cache_keeps_the_most_recently_placed(tmp_path, tiny_llama_dir, requests):
    manager, model = new_manager(tiny_llama_dir, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    copies = []
    for request in requests:
        path = tmp_path / request.lora_name
        shutil.copytree(request.lora_path, path)
        copies.append(LoRARequest(request.lora_name, request.lora_int_id, str(path)))
    for request in copies:
        manager.place(0, request)
        shutil.rmtree(request.lora_path)  # placing again must not need the folder while cached
    manager.place(0, copies[1])  # cached
    with_ad2 = logits_with(manager, model, 0)
    manager.place(0, copies[2])  # cached
    with pytest.raises(ValueError, match="^LoRA adapter 'ad1': no adapter_config.json in "):
        manager.place(0, copies[0])  # fell out of the two-adapter cache: read again, and its folder is gone
    manager.place(0, LoRARequest("ad3", 3, requests[1].lora_path))  # id 3 from ad2's folder: read afresh
    torch.testing.assert_close(logits_with(manager, model, 0), with_ad2, rtol=0, atol=0)


def test_a_linear_no_active_adapter_touches_runs_its_base_alone(tiny_llama_dir, requests):
    manager, _ = new_manager(tiny_llama_dir, max_loras=2, max_lora_rank=8)
    manager.place(0, requests[0])  # rank 2 on q_proj and o_proj
    linears = manager.lora_model.linears
    ranks = {path.rsplit(".", 1)[1]: linear.slot_ranks for path, linear in linears.items() if ".0." in path}
    assert ranks == {"qkv_proj": [2, 0], "o_proj": [2, 0], "gate_up_proj": [0, 0], "down_proj": [0, 0]}
    manager.place(1, requests[2])  # rank 6 on every projection
    assert linears["model.layers.0.self_attn.qkv_proj"].slot_ranks == [2, 18]  # q, k and v stacked
    manager.set_slot_mapping([0, 0, None])
    gate_up = linears["model.layers.1.mlp.gate_up_proj"]
    x = torch.randn(3, 64)
    assert torch.equal(gate_up(x), gate_up.base(x))
    manager.place(0, requests[1])  # gate and down only
    assert linears["model.layers.0.self_attn.o_proj"].slot_ranks == [0, 6]


def test_a_mapping_of_another_step_is_an_error(tiny_llama_dir, requests):
    manager, model = new_manager(tiny_llama_dir, max_loras=1, max_lora_rank=8)
    manager.place(0, requests[2])
    manager.set_slot_mapping([0, 0, 0])
    with pytest.raises(RuntimeError, match=r"^the LoRA mapping is for 3 tokens but the step has 7$"):
        prefill_logits(model, PROMPTS)


def test_the_bgmv_switch_is_for_cuda_devices_only(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("RAYPAGED_LORA_KERNELS", "1")
    manager, _ = new_manager(tiny_llama_dir)
    assert manager.bgmv is False  # on CPU the per-slot matmuls are the fast path
    manager.set_slot_mapping([0, None])
    assert manager.lora_model.step.mapping.slot_of is None
    monkeypatch.setenv("RAYPAGED_LORA_KERNELS", "yes")
    with pytest.raises(ValueError, match=r"^\$RAYPAGED_LORA_KERNELS must be 0 or 1, got 'yes'$"):
        new_manager(tiny_llama_dir)
