"""A worker's adapters: loaded ones cached on the CPU, resident ones in the model's device slots.

Loading (:meth:`LoRAManager.add`) reads, checks and shards an adapter once; the CPU cache
keeps the ``--max-cpu-loras`` most recently used (a miss reads the folder again). A running
request holds its adapter's slot (:meth:`acquire` / :meth:`release`); each step maps its
tokens to slots (:meth:`set_mapping`) before the forward.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from raypaged.lora.config import LoRAConfig
from raypaged.lora.layers import LoRAModel, attach_lora
from raypaged.lora.layout import read_checked_adapter, shard_adapter
from raypaged.lora.ops import build_lora_mapping
from raypaged.lora.registry import UnknownLoRAError
from raypaged.lora.request import LoRARequest
from raypaged.lora.slots import SlotTable
from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.parallel import TensorParallel

ShardedAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]  # target path -> this rank's (A^T, B^T), on the CPU


class LoRAManager:
    """LoRA for one model shard; attaches to ``model`` (whose weights are loaded) on construction."""

    def __init__(self, model: LlamaForCausalLM, config: LoRAConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.model_config = model.config
        self.device = device
        self.dtype = dtype
        self.lora_model: LoRAModel = attach_lora(model, config.max_loras, config.max_lora_rank, tp, dtype, device)
        self.slots = SlotTable(config.max_loras)
        self._requests: dict[int, LoRARequest] = {}
        self._cpu_cache: OrderedDict[int, ShardedAdapter] = OrderedDict()

    def add(self, request: LoRARequest) -> None:
        """Load, check and cache ``request``'s adapter (``ValueError`` naming what does not fit);
        adding the same adapter again does nothing."""
        known = self._requests.get(request.lora_int_id)
        if known is not None:
            if known == request and known.lora_path == request.lora_path:
                return
            raise ValueError(f"lora_int_id {request.lora_int_id} of {request.lora_name!r} is already used by "
                             f"{known.lora_name!r}")
        self._cache(request.lora_int_id, self._read(request))
        self._requests[request.lora_int_id] = request

    def remove(self, lora_int_id: int) -> None:
        """Forget an adapter; ``ValueError`` while a running request holds it."""
        if lora_int_id not in self._requests:
            raise UnknownLoRAError(f"no LoRA adapter has lora_int_id {lora_int_id}")
        slot = self.slots.remove(lora_int_id)
        if slot is not None:
            self._write_slot(slot, None)
        self._cpu_cache.pop(lora_int_id, None)
        del self._requests[lora_int_id]

    def acquire(self, lora_int_id: int) -> int | None:
        """Hold the adapter in a device slot for a running request (the slot), writing it there if it
        is not resident; ``None`` when every slot is held by other adapters (the request waits)."""
        if lora_int_id not in self._requests:
            raise UnknownLoRAError(f"no LoRA adapter has lora_int_id {lora_int_id}")
        placement = self.slots.acquire(lora_int_id)
        if placement is None:
            return None
        if placement.loaded:
            self._write_slot(placement.slot, self._sharded(lora_int_id))
        return placement.slot

    def release(self, lora_int_id: int) -> None:
        """A request holding the adapter finished or was preempted."""
        self.slots.release(lora_int_id)

    def set_mapping(self, token_lora_ids: Sequence[int | None]) -> None:
        """The next forward's adapter per token (``None``: the base model); each adapter must be resident."""
        slot_of: dict[int, int] = {}
        for lora_int_id in {i for i in token_lora_ids if i is not None}:
            slot = self.slots.slot_of(lora_int_id)
            if slot is None:
                raise ValueError(f"LoRA adapter {lora_int_id} is not in a device slot (acquire it first)")
            slot_of[lora_int_id] = slot
        token_slots = [None if i is None else slot_of[i] for i in token_lora_ids]
        self.lora_model.step.mapping = build_lora_mapping(token_slots, self.device)

    def clear_mapping(self) -> None:
        """Forwards from now on run the base model only (profiling, warm-up, CUDA graph capture)."""
        self.lora_model.step.mapping = None

    def cpu_cached_ids(self) -> list[int]:
        """Adapters whose shards are on the CPU, least recently used first."""
        return list(self._cpu_cache)

    def _read(self, request: LoRARequest) -> ShardedAdapter:
        adapter = read_checked_adapter(request, self.model_config, self.config.max_lora_rank)
        return shard_adapter(adapter, self.lora_model.targets, self.dtype)

    def _sharded(self, lora_int_id: int) -> ShardedAdapter:
        sharded = self._cpu_cache.get(lora_int_id)
        if sharded is None:
            sharded = self._read(self._requests[lora_int_id])
        self._cache(lora_int_id, sharded)
        return sharded

    def _cache(self, lora_int_id: int, sharded: ShardedAdapter) -> None:
        self._cpu_cache[lora_int_id] = sharded
        self._cpu_cache.move_to_end(lora_int_id)
        while len(self._cpu_cache) > self.config.num_cpu_loras:
            self._cpu_cache.popitem(last=False)

    def place(self, slot: int, request: LoRARequest) -> None:
        """Write ``request``'s adapter into ``slot`` as the driver's slot plan says (its ``lora_loads``);
        the adapter there before is replaced. The CPU cache is keyed by id and path, so an id reused
        for another folder is read afresh."""
        known = self._requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            self._cpu_cache.pop(request.lora_int_id, None)
        self._requests[request.lora_int_id] = request
        self._write_slot(slot, self._sharded(request.lora_int_id))

    def set_slot_mapping(self, token_slots: Sequence[int | None]) -> None:
        """The next forward's slot per token (``None``: the base model), slots as the driver placed them."""
        self.lora_model.step.mapping = build_lora_mapping(token_slots, self.device)

    def _write_slot(self, slot: int, sharded: ShardedAdapter | None) -> None:
        for path, linear in self.lora_model.linears.items():
            linear.set_slot(slot, None if sharded is None else sharded.get(path))
