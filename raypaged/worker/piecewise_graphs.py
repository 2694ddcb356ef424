"""Piecewise CUDA graphs of mixed steps: prefill spans, with or without decodes.

A decode-only step replays one whole-forward graph (``cuda_graphs.DecodeGraphs``). A step
that carries a prefill cannot: its attention depends on the step's layout (how many spans,
where they start, how much each has cached), which a graph cannot vary. Everything else in
the forward only sees a number of token rows. So the forward is cut at each layer's
attention call into ``num_layers + 1`` pieces, each recorded once per bucket of token counts,
and the attention runs eagerly between them:

- piece 0: the embedding, then layer 0 up to its attention (``LlamaDecoderLayer.pre_attention``:
  input norm, QKV, q/k norms, rotary, this step's K/V written to the cache);
- piece i (1 .. num_layers - 1): layer i-1 after its attention (``post_attention``: o_proj,
  residual add and norm, MLP), then layer i up to its attention;
- piece num_layers: the last layer after its attention and the final norm.

Every piece reads and writes static buffers: the step's ``input_ids``, ``positions`` and
``slot_mapping``; q, k and v (written by a piece, read by the attention); the attention's
output (written between pieces, read by the next piece); the residual stream carried from one
piece to the next; and the final hidden states. A step copies its inputs in, pads them to the
next bucket and runs piece 0, attention of layer 0 on the real rows only (the step's own
metadata: block tables, spans, context lengths), piece 1, and so on. The pieces are the model's
own ``pre_attention`` / ``post_attention`` (plain or fused, as the model runs), so the
piecewise forward is the forward, op for op; without graphs (:meth:`PiecewiseGraphs.run`
before :meth:`PiecewiseGraphs.capture`, on any device) it runs the pieces eagerly, which is
how it is checked on the CPU.

Padding rows are token 0 at position 0 with slot -1: they write no K/V, the attention never
reads them (it runs on the real rows), and every other op is row-wise, so they change no real
row. Their outputs are ignored.

Buckets: 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512 (powers of two and the halves
between them, so padding is under a third of a bucket past 8), up to and including
``min(max_num_batched_tokens, 512)`` (``graph_sizes.py``; vLLM's ``--cudagraph-capture-sizes`` and
``--max-cudagraph-capture-size`` choose others). A larger step runs eagerly: for a 7B model its GEMMs
(about 2 x 7e9 x 512 FLOP, several ms) already outweigh its ~1,200 launches (an estimate, not a
measurement). The cap also bounds capture time (12 buckets x (layers + 1) graphs, about 400
for a 32-layer model) and memory. Memory: the static buffers are sized for the largest bucket
and shared by all (for a 7B-shaped fp16 model at 512 tokens, q/k/v, the attention output, the
residual and the hidden states: about 25 MB); a piece keeps no output of its own (it copies
its results into the static buffers), so what its intermediates took returns to the graphs'
private pool for the next capture, and the pool should hold about one large piece's
intermediates. The pool is the decode graphs' (captured first) when there are any.

Only for tp = 1 and the cuda attention backend (where the decode graphs are captured); gated by
``$RAYPAGED_PIECEWISE_GRAPHS`` (``raypaged.envs``). A step with LoRA adapters replays them only
where the pieces record the BGMV product (``$RAYPAGED_LORA_KERNELS``: each row's slot read from a
static buffer, ``-1`` for the base model and for padding, as the decode graphs do).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
from typing import TYPE_CHECKING, cast
from unittest import mock

import torch

from raypaged.attention.metadata import AttentionMetadata
from raypaged.lora.layers import LoRAStep, StaticSlots
from raypaged.worker.graph_sizes import token_buckets

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from raypaged.model.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger("raypaged")


class PiecewiseGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_batched_tokens: int,
        device: torch.device,
        lora_step: LoRAStep | None = None,
        buckets: list[int] | None = None,
    ) -> None:
        """``lora_step``: the LoRA model's step, when the pieces record its BGMV product; ``buckets``: the
        token counts to record (default: ``token_buckets(max_num_batched_tokens)``)."""
        self.model = model.model  # LlamaModel: embed_tokens, layers, final_norm
        # the model's decoder layers (nn.ModuleList types its items as plain Modules)
        self.layers = cast("list[LlamaDecoderLayer]", list(self.model.layers))
        self.kv_caches = kv_caches
        self.buckets = buckets if buckets is not None else token_buckets(max_num_batched_tokens)
        config = model.config
        n = self.buckets[-1]
        dtype = self.model.norm.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.lora = StaticSlots(lora_step, n, device) if lora_step is not None else None
        self.hidden = torch.zeros((n, config.hidden_size), dtype=dtype, device=device)  # the last piece's output
        self.residual = torch.zeros((n, config.hidden_size), dtype=dtype, device=device)  # the stream, piece to piece
        if self.layers:
            attn = self.layers[0].self_attn
            heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        else:
            heads = kv_heads = head_dim = 0
        self.q = torch.zeros((n, heads, head_dim), dtype=dtype, device=device)
        self.k = torch.zeros((n, kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros((n, kv_heads, head_dim), dtype=dtype, device=device)
        self.attn_out = torch.zeros((n, heads, head_dim), dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> a graph per piece
        self.pool: _POOL_HANDLE | None = None
        self.replays = 0  # steps run through the graphs

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.buckets[-1]

    @property
    def records_lora(self) -> bool:
        return self.lora is not None

    def _piece(self, tokens: int, index: int) -> None:
        """Piece ``index`` over the first ``tokens`` rows of the static buffers."""
        with self.lora.recording(tokens) if self.lora is not None else contextlib.nullcontext():
            self._piece_body(tokens, index)

    def _piece_body(self, tokens: int, index: int) -> None:
        model = self.model
        fused = model.fused_ops
        residual_buf = self.residual[:tokens]
        if index == 0:
            x, residual = model.embeddings(self.input_ids[:tokens]), None
        else:
            x, residual = self.layers[index - 1].post_attention(self.attn_out[:tokens], residual_buf, fused)
        if index == len(self.layers):
            self.hidden[:tokens].copy_(model.final_norm(x, residual))
            return
        q, k, v, residual = self.layers[index].pre_attention(
            self.positions[:tokens], x, residual, self.kv_caches[index], self.slot_mapping[:tokens], fused
        )
        self.q[:tokens].copy_(q)
        self.k[:tokens].copy_(k)
        self.v[:tokens].copy_(v)
        if residual.data_ptr() != residual_buf.data_ptr():  # the fused path adds into the buffer in place
            residual_buf.copy_(residual)

    @torch.inference_mode()
    def capture(self, pool: _POOL_HANDLE | None = None) -> None:
        """Record every (bucket, piece), largest bucket first, into ``pool`` (e.g. the decode graphs')."""
        started = time.monotonic()
        free_before = torch.cuda.mem_get_info()[0]
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)  # capture writes no K/V
        # torch.cuda.graph runs gc.collect before each capture (older torch always does): once is
        # enough for hundreds of pieces
        gc.collect()
        with mock.patch("gc.collect", lambda *args: 0):
            pool = self._capture_all(pool)
        torch.cuda.synchronize()
        self.pool = pool
        logger.info(
            "captured piecewise CUDA graphs for %d token buckets (%d-%d) x %d pieces in %.1f s, %.2f GiB",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
            self.num_pieces,
            time.monotonic() - started,
            (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30),
        )

    def _capture_all(self, pool: _POOL_HANDLE | None) -> _POOL_HANDLE | None:
        """Warm up and record each bucket's pieces; returns the pool they hold."""
        for bucket in reversed(self.buckets):
            # warm up on a side stream: lazy initialisation (kernel compiles, cuBLAS handles) stays out of the graphs
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    for index in range(self.num_pieces):
                        self._piece(bucket, index)
            torch.cuda.current_stream().wait_stream(stream)
            graphs: list[torch.cuda.CUDAGraph] = []
            for index in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(bucket, index)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[bucket] = graphs
        return pool

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's forward: [num_tokens, hidden], a view into the static output (valid until the
        next step). Replays the graphs once captured, else runs the pieces eagerly."""
        num_tokens = input_ids.shape[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(meta.slot_mapping)
        if bucket > num_tokens:
            self.input_ids[num_tokens:bucket].zero_()
            self.positions[num_tokens:bucket].zero_()
            self.slot_mapping[num_tokens:bucket].fill_(-1)
        if self.lora is not None:
            self.lora.fill(num_tokens, bucket)
        graphs = self.graphs.get(bucket)
        q, k, v = self.q[:num_tokens], self.k[:num_tokens], self.v[:num_tokens]
        for index in range(self.num_pieces):
            if graphs is None:
                self._piece(bucket, index)
            else:
                graphs[index].replay()
            if index < len(self.layers):
                attn = self.layers[index].self_attn
                self.attn_out[:num_tokens].copy_(attn.attend(q, k, v, self.kv_caches[index], meta))
        if graphs is not None:
            self.replays += 1
        return self.hidden[:num_tokens]
