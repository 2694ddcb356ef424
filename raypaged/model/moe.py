"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE, in place of a decoder layer's MLP, as
transformers' ``*SparseMoeBlock`` computes it::

    weights, experts = topk(softmax(x @ router^T, in fp32), top_k)    # renormalized to sum 1 where the spec says
    y = sum over the token's experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x))
    y += sigmoid(x @ shared_gate^T) * shared_expert(x)                 # Qwen2-MoE only

Each expert's gate | up weights are held stacked (``[num_experts, 2 * I, hidden]``, down ``[num_experts, hidden,
I]``), filled expert by expert from the checkpoint's per-expert tensors. A step sorts its (token, expert) pairs by
expert once, runs each chosen expert over its contiguous run of gathered rows, and adds the weighted rows back per
token in ascending expert order, the order of transformers' loop. Under tensor parallelism every rank holds its
share of every expert's intermediate features (and the shared expert's): the partial outputs are summed in one
all-reduce per layer, the router and the shared gate are whole on every rank.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.attention.backend import FusedOps
from raypaged.model.architecture import Architecture, MoeSpec
from raypaged.model.layers import silu_and_mul
from raypaged.model.parallel import RowParallelLinear, TensorParallel

# a checkpoint's per-expert tensor: "<layer>.mlp.experts.<index>.<projection>.<weight>" (Mixtral's block_sparse_moe
# and w1 / w3 / w2 renamed first: ``canonical_name``)
EXPERT_TENSOR = re.compile(r"\.experts\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<param>[^.]+)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def canonical_name(name: str) -> str:
    """A Mixtral checkpoint tensor's name as Qwen-MoE's spell it (``block_sparse_moe`` -> ``mlp``; an expert's
    ``w1``, ``w3``, ``w2`` -> ``gate_proj``, ``up_proj``, ``down_proj``); other names unchanged."""
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


class Experts(nn.Module):
    """Every expert's gated MLP, this rank's share of each one's intermediate features."""

    def __init__(self, spec: MoeSpec, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        self.first_row, self.intermediate_size = tp.chunk(spec.intermediate_size)
        self.fp32_weights = spec.fp32_weights
        size = self.intermediate_size
        self.gate_up = nn.Parameter(torch.empty(spec.num_experts, 2 * size, hidden_size), requires_grad=False)
        self.down = nn.Parameter(torch.empty(spec.num_experts, hidden_size, size), requires_grad=False)

    def load_expert(self, name: str, index: int, projection: str, param: str, tensor: torch.Tensor) -> None:
        """This rank's rows (gate, up) or columns (down) of expert ``index``'s checkpoint tensor ``name``."""
        if param != "weight" or not 0 <= index < self.num_experts:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        first, size = self.first_row, self.intermediate_size
        if projection == "down_proj":
            self.down.data[index].copy_(tensor[:, first : first + size])
        else:
            offset = 0 if projection == "gate_proj" else size
            self.gate_up.data[index, offset : offset + size].copy_(tensor[first : first + size])

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x: [T, hidden]``, each token's ``experts`` and ``weights`` ``[T, top_k]`` -> the weighted sum of its
        experts' outputs (this rank's share under tensor parallelism)."""
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # (token, expert) pairs by expert
        rows = order // self.top_k  # each pair's token
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        gathered, pair_weights = x[rows], weights.flatten()[order, None]
        out = torch.empty_like(gathered)
        start = 0
        for index, count in enumerate(counts):
            if count:
                end = start + count
                hidden = silu_and_mul(F.linear(gathered[start:end], self.gate_up[index]))
                y = F.linear(hidden, self.down[index])
                out[start:end] = y * pair_weights[start:end]  # in fp32 for Mixtral's fp32 weights, then rounded
                start = end
        return torch.zeros_like(x).index_add_(0, rows, out)


class SparseMoeBlock(nn.Module):
    """The router, the experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, config: PretrainedConfig, arch: Architecture, tp: TensorParallel, prefix: str) -> None:
        super().__init__()
        from raypaged.model.llama import LlamaMLP  # here: that module builds this one's blocks

        spec = arch.moe
        assert spec is not None, "an architecture with experts"
        self.tp, self.spec = tp, spec
        self.gate = nn.Linear(config.hidden_size, spec.num_experts, bias=False)  # the router, whole on every rank
        self.experts = Experts(spec, config.hidden_size, tp)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_intermediate_size:
            shared = LlamaMLP(config, arch, tp, f"{prefix}.shared_expert", None, spec.shared_intermediate_size)
            self.shared_expert, self.shared_expert_gate = shared, nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, fused: FusedOps | None = None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """The block's output for the normed ``x`` (``fused`` changes nothing here: the experts run in torch)."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, experts, weights if self.spec.fp32_weights else weights.to(x.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert
            down = shared.down_proj
            assert isinstance(down, RowParallelLinear), "unquantized (check_options refuses quantized experts)"
            partial = down.partial(shared.act_and_mul(shared.gate_up_proj(x)))  # the all-reduce below sums it
            out += torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * partial
        return self.tp.all_reduce(out)
