"""A worker's adapters: read ones cached on the CPU, placed ones in the model's device slots.

The driver plans the slots (``raypaged/core/lora_plan.py``) and checks each adapter before any
request uses it (``layout.read_checked_adapter``); a worker writes an adapter into the slot the
plan names (:meth:`LoRAManager.place`) and maps each step's tokens to slots
(:meth:`LoRAManager.set_slot_mapping`) before the forward. The CPU cache keeps the
``--max-cpu-loras`` most recently placed adapters' shards; a miss reads the folder again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from raypaged import envs
from raypaged.kernels import loader
from raypaged.lora.config import LoRAConfig
from raypaged.lora.layers import LoRAModel, attach_lora
from raypaged.lora.layout import read_checked_adapter, shard_adapter
from raypaged.lora.ops import build_bgmv_mapping, build_lora_mapping
from raypaged.lora.request import LoRARequest
from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.parallel import TensorParallel

ShardedAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]  # target path -> this rank's (A^T, B^T), on the CPU


class LoRAManager:
    """LoRA for one model shard; attaches to ``model`` (whose weights are loaded) on construction."""

    def __init__(
        self, model: LlamaForCausalLM, config: LoRAConfig, tp: TensorParallel, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.config = config
        self.model_config = model.config
        self.device = device
        self.dtype = dtype
        self.lora_model: LoRAModel = attach_lora(model, config.max_loras, config.max_lora_rank, tp, dtype, device)
        # BGMV mappings: the CUDA kernels, and a LoRA product the CUDA graphs can record
        self.bgmv = envs.lora_kernels() and loader.runs_on(device)
        self._cpu_cache: OrderedDict[tuple[int, str], ShardedAdapter] = OrderedDict()  # by (id, path)

    def place(self, slot: int, request: LoRARequest) -> None:
        """Write ``request``'s adapter into ``slot`` as the driver's slot plan says (its ``lora_loads``);
        the adapter there before is replaced. The cache is keyed by id and path, so an id reused
        for another folder is read afresh."""
        key = (request.lora_int_id, request.lora_path)
        sharded = self._cpu_cache.pop(key, None)
        if sharded is None:
            adapter = read_checked_adapter(request, self.model_config, self.config.max_lora_rank)
            sharded = shard_adapter(adapter, self.lora_model.targets, self.dtype)
        self._cpu_cache[key] = sharded
        while len(self._cpu_cache) > self.config.num_cpu_loras:
            self._cpu_cache.popitem(last=False)
        for path, linear in self.lora_model.linears.items():
            linear.set_slot(slot, sharded.get(path))

    def set_slot_mapping(self, token_slots: Sequence[int | None]) -> None:
        """The next forward's slot per token (``None``: the base model), slots as the driver placed them."""
        build = build_bgmv_mapping if self.bgmv else build_lora_mapping
        self.lora_model.step.mapping = build(token_slots, self.device)
