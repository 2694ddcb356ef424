"""CUDA graphs of the decode-only forward pass.

A decode step launches a few kernels per layer for one token per sequence, so on a
GPU its time goes to launch overhead rather than to arithmetic. For each batch size
of a ladder (1, 2, 4, then multiples of 8 up to ``max_num_seqs``) the whole forward is
recorded once into a graph that reads static input buffers; a step copies its inputs
into those buffers, pads the batch to the next recorded size and replays the graph.

Padding rows write nowhere (slot -1) and attend over one token of block 0, so they
cost a little work and change nothing. The block-table buffer is as wide as
``max_model_len`` needs, so the same graph serves every context length. All graphs
share one memory pool, recorded largest first, as PyTorch recommends.

With LoRA's BGMV kernels (``$RAYPAGED_LORA_KERNELS``) the graphs record the LoRA product too, at
the slots' full rank, reading each row's slot from a static buffer (``-1``: the base model, and
every padding row): one graph per batch size serves any adapters in any of the fixed slots.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from typing import TYPE_CHECKING

import torch

from raypaged.attention.metadata import AttentionMetadata
from raypaged.lora.layers import LoRAStep, StaticSlots
from raypaged.worker.graph_sizes import batch_size_ladder

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger("raypaged")


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        lora_step: LoRAStep | None = None,
        sizes: list[int] | None = None,
    ) -> None:
        """``lora_step``: the LoRA model's step, when the graphs record its BGMV product; ``sizes``: the batch
        sizes to record (default: ``batch_size_ladder(max_num_seqs)``)."""
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sizes if sizes is not None else batch_size_ladder(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.long, device=device)
        self.context_lens = torch.ones(n, dtype=torch.long, device=device)
        self.lora = StaticSlots(lora_step, n, device) if lora_step is not None else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.pool: _POOL_HANDLE | None = None  # the graphs' memory pool, once captured (the piecewise graphs share it)

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_context_lens=self.context_lens[:batch],
            prefills=[],
        )

    def _forward(self, batch: int) -> torch.Tensor:
        with self.lora.recording(batch) if self.lora is not None else contextlib.nullcontext():
            return self.model(self.input_ids[:batch], self.positions[:batch], self.kv_caches, self._meta(batch))

    @property
    def records_lora(self) -> bool:
        return self.lora is not None

    @torch.inference_mode()
    def capture(self) -> None:
        started = time.monotonic()
        free_before = torch.cuda.mem_get_info()[0]
        pool: _POOL_HANDLE | None = None
        for batch in reversed(self.sizes):
            # warm up on a side stream: lazy initialisation (kernel compiles, cuBLAS handles) stays out of the graph
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()
        self.pool = pool
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (1-%d) in %.1f s, %.2f GiB",
            len(self.sizes),
            self.sizes[-1],
            time.monotonic() - started,
            (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30),
        )

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The decode forward of ``len(input_ids)`` sequences: [batch, hidden] (a view into the graph's output).
        Recording LoRA, the rows' slots come from the step's BGMV mapping (none: every row the base model's)."""
        batch = input_ids.shape[0]
        padded = self.sizes[bisect.bisect_left(self.sizes, batch)]
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.block_tables[:batch, :width].copy_(meta.decode_block_tables)
        self.context_lens[:batch].copy_(meta.decode_context_lens)
        if self.lora is not None:
            self.lora.fill(batch, padded)
        if padded > batch:
            self.slot_mapping[batch:padded].fill_(-1)
            self.context_lens[batch:padded].fill_(1)
            self.block_tables[batch:padded, 0].fill_(0)
        self.graphs[padded].replay()
        self.replays += 1
        return self.outputs[padded][:batch]
