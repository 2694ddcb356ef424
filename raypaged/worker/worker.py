"""One model shard: weights, KV cache and the model runner."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from raypaged.config import DEFAULT_CPU_KV_CACHE_SPACE_GIB, EngineConfig
from raypaged.core.outputs import ModelRunnerOutput, SchedulerOutput
from raypaged.model.llama import head_dim_of, num_kv_heads_per_rank
from raypaged.model.loader import load_model
from raypaged.model.parallel import TensorParallel
from raypaged.worker.cache import KVCache
from raypaged.worker.model_runner import ModelRunner

logger = logging.getLogger("raypaged")

_GIB = 1 << 30
_COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class Worker:
    """Rank ``tp.rank`` of a shard group: with ``tp.size > 1`` it first joins the group's
    torch.distributed process group at ``init_method`` (gloo on CPU, NCCL on CUDA)."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_id: int | None,
        tp: TensorParallel = TensorParallel(),
        init_method: str | None = None,
    ) -> None:
        self.config = config
        self.tp = tp
        self.device = torch.device(config.resolved_device)
        self.dtype = getattr(torch, config.resolved_dtype)
        self.eos_token_id = eos_token_id
        if tp.size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=init_method, rank=tp.rank, world_size=tp.size, timeout=_COLLECTIVE_TIMEOUT
            )
        torch.manual_seed(config.seed)
        self.model = load_model(
            config.model_path, config.hf_config, config.max_model_len, self.dtype, self.device, tp
        )
        self.runner: ModelRunner | None = None

    def bytes_per_block(self) -> int:
        hf = self.config.hf_config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        num_kv_heads = num_kv_heads_per_rank(hf, self.tp.size)
        return 2 * hf.num_hidden_layers * self.config.block_size * num_kv_heads * head_dim_of(hf) * elem

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) this worker can hold."""
        per_block = self.bytes_per_block()
        num_cpu_blocks = int(self.config.resolved_swap_space * _GIB) // per_block
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override, num_cpu_blocks
        space = self.config.kv_cache_space or DEFAULT_CPU_KV_CACHE_SPACE_GIB
        return max(1, int(space * _GIB) // per_block), num_cpu_blocks

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        hf = self.config.hf_config
        block_shape = (self.config.block_size, num_kv_heads_per_rank(hf, self.tp.size), head_dim_of(hf))
        cache = KVCache(hf.num_hidden_layers, num_blocks, num_cpu_blocks, block_shape, self.dtype, self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB), %d CPU swap blocks",
            num_blocks,
            self.config.block_size,
            num_blocks * self.bytes_per_block() / _GIB,
            num_cpu_blocks,
        )
        self.runner = ModelRunner(
            self.model,
            cache,
            self.config.block_size,
            self.eos_token_id,
            self.config.seed,
            self.device,
            samples=self.tp.rank == 0,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
