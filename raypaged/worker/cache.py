"""The KV cache tensors of one worker: device blocks, CPU swap blocks, block copies."""

from __future__ import annotations

import itertools

import torch

from raypaged.core.outputs import BlockOp, BlockOpKind
from raypaged.worker.host_memory import zeros_on_huge_pages


class KVCache:
    """``[layers, 2, num_blocks, kv_heads, block_size, head_dim]`` on the device, the
    same with ``num_cpu_blocks`` in host memory (pinned on CUDA) for swapping."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_cpu_blocks: int,
        block_shape: tuple[int, int, int],  # kv_heads, block_size, head_dim
        dtype: torch.dtype,
        device: torch.device,
        use_kernels: bool = False,
    ) -> None:
        """``use_kernels``: block copies and swaps run as the ``copy_blocks`` CUDA kernel, one launch
        per run of same-kind ops, reading and writing pinned host blocks directly."""
        # zeros: masked-out slots of a partly filled block are read (weight 0) and must be finite
        shape = (num_layers, 2, num_blocks, *block_shape)
        if device.type == "cpu":  # attention reads scattered blocks: fewer TLB misses on huge pages
            self.device_blocks = zeros_on_huge_pages(shape, dtype)
        else:
            self.device_blocks = torch.zeros(shape, dtype=dtype, device=device)
        self.cpu_blocks = torch.empty(
            (num_layers, 2, num_cpu_blocks, *block_shape), dtype=dtype, pin_memory=device.type == "cuda"
        )
        self.layers = [(self.device_blocks[i, 0], self.device_blocks[i, 1]) for i in range(num_layers)]
        self.use_kernels = use_kernels

    def run_block_ops(self, ops: list[BlockOp]) -> None:
        """Whole-block copies in order: ``copy`` on device, ``swap_out`` to CPU, ``swap_in`` back."""
        if self.use_kernels:
            self._run_with_kernels(ops)
            return
        for op in ops:
            if op.kind == BlockOpKind.COPY:
                self.device_blocks[:, :, op.dst].copy_(self.device_blocks[:, :, op.src])
            elif op.kind == BlockOpKind.SWAP_OUT:
                self.cpu_blocks[:, :, op.dst].copy_(self.device_blocks[:, :, op.src], non_blocking=True)
            elif op.kind == BlockOpKind.SWAP_IN:
                self.device_blocks[:, :, op.dst].copy_(self.cpu_blocks[:, :, op.src], non_blocking=True)
            else:
                raise ValueError(f"unknown block op {op.kind!r}")

    def _run_with_kernels(self, ops: list[BlockOp]) -> None:
        from raypaged import kernels

        pools = {
            BlockOpKind.COPY: (self.device_blocks, self.device_blocks),
            BlockOpKind.SWAP_OUT: (self.device_blocks, self.cpu_blocks),
            BlockOpKind.SWAP_IN: (self.cpu_blocks, self.device_blocks),
        }
        for kind, run in itertools.groupby(ops, key=lambda op: op.kind):  # runs keep their order
            if kind not in pools:
                raise ValueError(f"unknown block op {kind!r}")
            mapping = torch.tensor([(op.src, op.dst) for op in run], dtype=torch.long)
            src, dst = pools[kind]
            kernels.copy_blocks(src, dst, mapping.to(self.device_blocks.device))
