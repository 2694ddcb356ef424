"""Adapters under tensor parallelism (gloo, one process per rank): the same logits as one shard,
with even KV-head shards (tp 3), replicated KV heads (tp 4 over 2 heads), and Phi-3's fused qkv_proj and
gate_up_proj adapted whole (tp 2)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raypaged.lora.config import LoRAConfig
from raypaged.lora.manager import LoRAManager
from raypaged.lora.request import LoRARequest
from raypaged.model.parallel import TensorParallel
from tests.conftest import make_tiny_model
from tests.lora.conftest import load_raypaged, make_peft_adapter, prefill_logits

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
PROMPT_SLOTS = [0, None, 1]


def mixed_logits(model_dir: Path, adapter_dirs: list[Path], tp: TensorParallel) -> torch.Tensor:
    model = load_raypaged(model_dir, tp)
    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), tp, torch.float32, torch.device("cpu"))
    for slot, path in enumerate(adapter_dirs):
        manager.place(slot, LoRARequest(f"ad{slot}", slot + 1, str(path)))
    manager.set_slot_mapping([s for s, p in zip(PROMPT_SLOTS, PROMPTS) for _ in p])
    return torch.cat(prefill_logits(model, PROMPTS))


def _rank_main(rank: int, size: int, port: int, model_dir: Path, adapter_dirs: list[Path], out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        logits = mixed_logits(model_dir, adapter_dirs, TensorParallel(rank, size))
        if rank == 0:
            torch.save(logits, out)
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("tp_size", "arch", "shape"),
    [
        (3, "llama", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96}),
        (4, "llama", {}),  # 8 heads, 2 KV heads: each rank holds one KV head, two ranks the same one
        (2, "phi3", {"pad_token_id": 0}),
    ],
)
def test_sharded_adapters_equal_one_shard(tmp_path, smollm2_dir, tp_size, arch, shape):
    model_dir = make_tiny_model(tmp_path, smollm2_dir, arch, **shape)
    targets = ["qkv_proj", "down_proj"] if arch == "phi3" else ["k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    adapter_dirs = [
        make_peft_adapter(model_dir, tmp_path / "ad1", seed=1, std=0.3, r=4, target_modules="all-linear"),
        make_peft_adapter(model_dir, tmp_path / "ad2", seed=2, std=0.3, r=8, use_rslora=True, target_modules=targets),
    ]
    out = tmp_path / "logits.pt"
    mp.spawn(_rank_main, args=(tp_size, free_port(), model_dir, adapter_dirs, out), nprocs=tp_size)
    want = mixed_logits(model_dir, adapter_dirs, TensorParallel())
    got = torch.load(out)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    base = prefill_logits(load_raypaged(model_dir), PROMPTS)
    for adapter, part, base_part in zip(PROMPT_SLOTS, got.split([len(p) for p in PROMPTS]), base):
        if adapter is None:
            torch.testing.assert_close(part, base_part, atol=1e-4, rtol=1e-4)
        else:
            assert (part - base_part).abs().max() > 0.1


def test_a_row_parallel_lora_term_rides_in_its_bases_all_reduce(tmp_path, smollm2_dir, monkeypatch):
    """o_proj's and down_proj's adapter products join their base's partial sums before its one
    all-reduce: a step with adapters all-reduces exactly as often as one without."""
    model_dir = make_tiny_model(tmp_path, smollm2_dir, "llama")
    adapter = make_peft_adapter(model_dir, tmp_path / "ad", seed=1, std=0.3, r=4, target_modules="all-linear")
    calls = []
    all_reduce = TensorParallel.all_reduce
    monkeypatch.setattr(
        TensorParallel, "all_reduce", lambda self, x: calls.append(tuple(x.shape)) or all_reduce(self, x)
    )
    model = load_raypaged(model_dir)
    manager = LoRAManager(
        model, LoRAConfig(max_loras=1, max_lora_rank=8), TensorParallel(), torch.float32, torch.device("cpu")
    )
    manager.place(0, LoRARequest("ad", 1, str(adapter)))
    counts = []
    for slot in (None, 0):
        manager.set_slot_mapping([slot] * len(PROMPTS[0]))
        calls.clear()
        prefill_logits(model, PROMPTS[:1])
        counts.append(list(calls))
    assert counts[1] == counts[0] and all(shape[-1] == 64 for shape in counts[0])  # hidden-wide sums only
