"""Tensor and pipeline parallelism: the shard group of one worker and the layers that talk across it.

Column-parallel linears are plain ``nn.Linear`` with their output rows sharded at
load (quantized linears, in ``raypaged/quantization/linear.py``, split the same way);
the layers here are the ones that communicate: row-parallel linears (one
all-reduce), the vocab-parallel embedding (one all-reduce) and the vocab-parallel
LM head (one all-gather of logits).

With pipeline parallelism (``PipelineStage``) the layers are split into contiguous stages, each run by its own
shard group; a stage hands its residual stream to the same tensor-parallel rank of the next stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raypaged.model.layers import linear, pack_weight
from raypaged.model.stages import stage_layers


@dataclass(slots=True)
class Communicator:
    """How a shard group sums in place: torch.distributed's ``all_reduce`` unless ``all_reduce`` is set, as the
    worker sets it for CUDA graphs under tensor parallelism (``raypaged.worker.nccl``: NCCL called directly, which
    a graph can record; torch.distributed's collectives keep host-side state per call that a replay skips)."""

    all_reduce: Callable[[torch.Tensor], None] | None = None


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """Which pipeline stage a shard group runs (``index`` of ``size``); every stage has ``tp_size`` ranks, so global
    rank ``index * tp_size + r`` is tensor-parallel rank ``r`` of stage ``index``."""

    index: int = 0
    size: int = 1
    tp_size: int = 1

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.size - 1

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.size)[self.index]

    def global_rank(self, tp_rank: int, stage: int | None = None) -> int:
        return (self.index if stage is None else stage) * self.tp_size + tp_rank


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This worker's place in its shard group (the default torch.distributed group when ``size > 1``; with pipeline
    parallelism, ``group``: its stage's ranks) and its pipeline stage (``pp``)."""

    rank: int = 0
    size: int = 1
    comm: Communicator = field(default_factory=Communicator, compare=False, repr=False)
    # --enable-expert-parallel: a mixture of experts' layer gives each rank whole experts, not a share of each
    expert_parallel: bool = False
    pp: PipelineStage = field(default_factory=PipelineStage)
    group: Any = field(default=None, compare=False, repr=False)  # a torch.distributed group; None: the default

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if self.comm.all_reduce is not None:
                self.comm.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:  # [n, d] -> [n, size * d]
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        """The residual stream to this rank's peer in the next pipeline stage."""
        dist.send(x.contiguous(), dst=self.pp.global_rank(self.rank, self.pp.index + 1))

    def receive_from_previous_stage(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream from this rank's peer in the stage before, into ``x`` (its shape and dtype)."""
        dist.recv(x, src=self.pp.global_rank(self.rank, self.pp.index - 1))
        return x

    def chunk(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's even share of ``total`` (which the size divides)."""
        length = total // self.size
        return self.rank * length, length


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of this rank's vocabulary rows; the vocabulary is padded to a multiple of the size."""
    length = -(-vocab_size // tp.size)
    return tp.rank * length, length


def shard_rows(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows ``start:start+length`` of a checkpoint tensor, zero-padded past its end."""
    rows = tensor[start : start + length]
    if rows.shape[0] == length:
        return rows
    pad = torch.zeros((length - rows.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([rows, pad])


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_shard @ W_shard^T) + b``: input features sharded, the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features / size]
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``y``, before the all-reduce (a LoRA term may be added to it first)."""
        return linear(x, self.weight)

    def pack(self, bf16: bool = False) -> None:
        """The weight packed for :func:`linear` (:func:`pack_weight`); after loading, on a CPU in fp32."""
        self.weight = pack_weight(self.weight, bf16=bf16)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' shares summed, plus the bias once."""
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def load_shard(self, param_name: str, tensor: torch.Tensor) -> None:
        if param_name not in ("weight", "bias") or getattr(self, param_name) is None:
            raise ValueError(f"checkpoint tensor {param_name!r} has no place in an unquantized row-parallel layer")
        if param_name == "bias":
            assert self.bias is not None  # checked above
            self.bias.data.copy_(tensor)
            return
        start, length = self.tp.chunk(tensor.shape[1])
        self.weight.data.copy_(tensor[:, start : start + length])


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a slice of the vocabulary's rows; tokens outside it embed to zero before the all-reduce.
    ``multiplier``: the embeddings are multiplied by it (Granite's embedding_multiplier, Gemma's sqrt(hidden_size);
    not the LM head's); ``multiplier_in_dtype``: rounded to fp32 and then to the embeddings' dtype first (Gemma's)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TensorParallel,
        multiplier: float = 1.0,
        multiplier_in_dtype: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.multiplier = multiplier
        self.multiplier_in_dtype = multiplier_in_dtype
        self.vocab_size = vocab_size
        self.vocab_start, num_rows = vocab_shard(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(num_rows, hidden_size))
        self.head_weight: torch.Tensor | None = None  # the LM head's own packed copy of a tied weight (pack_head)
        self.widen_rows = False  # rows kept in bf16 for a model computing in fp32 (keep_rows_in_bf16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp.size == 1:
            out = self._rows(input_ids)
        else:
            local = input_ids - self.vocab_start
            inside = (local >= 0) & (local < self.weight.shape[0])
            out = self._rows(local.masked_fill(~inside, 0))
            out.masked_fill_(~inside.unsqueeze(-1), 0)
            out = self.tp.all_reduce(out)
        if self.multiplier == 1.0:
            return out
        if self.multiplier_in_dtype:
            return out.mul_(torch.tensor(self.multiplier, dtype=torch.float32, device=out.device).to(out.dtype))
        return out.mul_(self.multiplier)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] of this rank's rows -> [num_tokens, hidden]
        rows = nn.functional.embedding(ids, self.weight)
        return rows.float() if self.widen_rows else rows

    def load_shard(self, tensor: torch.Tensor) -> None:
        self.weight.data.copy_(shard_rows(tensor, self.vocab_start, self.weight.shape[0]))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden] -> [num_seqs, vocab]
        """The LM head (tied, or one of its own sharded the same way): gathered from every rank."""
        weight = self.weight if self.head_weight is None else self.head_weight
        local = linear(hidden, weight)  # [num_seqs, vocab / size]
        return self.tp.all_gather_last_dim(local)[:, : self.vocab_size]

    def keep_rows_in_bf16(self) -> None:
        """A bf16 model on CPU (``layers.bf16_linears_on_cpu``), after loading and ``pack_head``: the rows stored in
        bf16, half fp32's memory (a Llama-3-8B's 128,256 x 4,096: 1 GiB less), each row looked up widened to fp32,
        exactly where the checkpoint's rows are bf16."""
        self.weight = nn.Parameter(self.weight.detach().to(torch.bfloat16), requires_grad=False)
        self.widen_rows = True

    def pack_head(self, tied: bool, bf16: bool = False) -> None:
        """The LM head's weight packed for :func:`linear` (:func:`pack_weight`), after loading, on a CPU in fp32;
        ``tied``: the embedding still looks its rows up, so the packed head is a copy beside them."""
        if tied:
            self.head_weight = pack_weight(self.weight, bf16=bf16)
        else:
            self.weight = pack_weight(self.weight, bf16=bf16)
