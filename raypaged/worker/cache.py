"""The KV cache tensors of one worker: device blocks, CPU swap blocks, block copies."""

from __future__ import annotations

import torch

from raypaged.core.outputs import BlockOp


class KVCache:
    """``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` on the device, the
    same with ``num_cpu_blocks`` in host memory (pinned on CUDA) for swapping."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_cpu_blocks: int,
        block_shape: tuple[int, int, int],  # block_size, kv_heads, head_dim
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # zeros: masked-out slots of a partly filled block are read (weight 0) and must be finite
        self.device_blocks = torch.zeros((num_layers, 2, num_blocks, *block_shape), dtype=dtype, device=device)
        self.cpu_blocks = torch.empty(
            (num_layers, 2, num_cpu_blocks, *block_shape), dtype=dtype, pin_memory=device.type == "cuda"
        )
        self.layers = [(self.device_blocks[i, 0], self.device_blocks[i, 1]) for i in range(num_layers)]

    def run_block_ops(self, ops: list[BlockOp]) -> None:
        """Whole-block copies in order: ``copy`` on device, ``swap_out`` to CPU, ``swap_in`` back."""
        for op in ops:
            if op.kind == "copy":
                self.device_blocks[:, :, op.dst].copy_(self.device_blocks[:, :, op.src])
            elif op.kind == "swap_out":
                self.cpu_blocks[:, :, op.dst].copy_(self.device_blocks[:, :, op.src], non_blocking=True)
            elif op.kind == "swap_in":
                self.device_blocks[:, :, op.dst].copy_(self.cpu_blocks[:, :, op.src], non_blocking=True)
            else:
                raise ValueError(f"unknown block op {op.kind!r}")
