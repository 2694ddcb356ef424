"""The shard group's all-reduce through NCCL called directly (CuPy's binding), for CUDA graphs under tensor
parallelism (``$RAYPAGED_TP_CUDA_GRAPHS``).

A CUDA graph records the kernels a call launches, not the call: replaying it runs NCCL's kernel again with
nothing on the host. torch.distributed's collectives also keep host-side state per call (sequence numbers,
the watchdog's work queue), which a replay does not advance, so ranks that mix replays with eager collectives
can disagree on which collective is in flight. A communicator of its own, called with the current stream's
handle, has no such state: the same call serves eager steps and graph capture alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from raypaged.model.parallel import TensorParallel


class NcclAllReduce:
    """An in-place sum over the shard group on the current CUDA stream. Built by every rank together (a
    collective): rank 0's NCCL unique id reaches the others through the torch.distributed group."""

    def __init__(self, tp: TensorParallel) -> None:
        from cupy.cuda import nccl

        shared = [nccl.get_unique_id() if tp.rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        self._nccl = nccl
        self.comm = nccl.NcclCommunicator(tp.size, shared[0], tp.rank)
        self.types = {torch.float32: nccl.NCCL_FLOAT32, torch.float16: nccl.NCCL_FLOAT16}
        if hasattr(nccl, "NCCL_BFLOAT16"):  # NCCL 2.10 and later
            self.types[torch.bfloat16] = nccl.NCCL_BFLOAT16

    def __call__(self, x: torch.Tensor) -> None:
        if not x.is_cuda or not x.is_contiguous() or x.dtype not in self.types:
            raise ValueError(
                f"the NCCL all-reduce sums contiguous CUDA tensors of {', '.join(map(str, self.types))}, got "
                f"{x.dtype} on {x.device}{'' if x.is_contiguous() else ' (not contiguous)'}"
            )
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self.comm.allReduce(x.data_ptr(), x.data_ptr(), x.numel(), self.types[x.dtype], self._nccl.NCCL_SUM, stream)
