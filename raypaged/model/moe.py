"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE, Qwen3-MoE and GLM-4.5, in place of a decoder layer's
MLP, as transformers' ``*SparseMoeBlock`` (``Glm4MoeMoE``) computes it::

    weights, experts = topk(softmax(x @ router^T, in fp32), top_k)    # renormalized to sum 1 where the spec says
    y = sum over the token's experts e of weight_e * down_e(silu(gate_e(x)) * up_e(x))
    y += sigmoid(x @ shared_gate^T) * shared_expert(x)                 # Qwen2-MoE only (GLM-4.5: ungated)

GLM-4.5 routes by sigmoid scores instead (``SparseMoeBlock.route``, DeepSeek-V3's router, in fp32).

Each expert is a gated MLP of the dense layers' kind (``LlamaMLP``: the checkpoint's per-expert tensors load as any
MLP's, float or quantized, and a CPU packs each one's weights for its GEMMs). A step sorts its (token, expert)
pairs by expert once, runs each chosen expert over its contiguous run of gathered rows, and adds the weighted rows
back per token in ascending expert order, the order of transformers' loop. Under tensor parallelism every rank
holds its share of every expert's intermediate features, or with expert parallelism (``TensorParallel.
expert_parallel``) ``num_experts / size`` whole experts; either way, with its share of the shared expert, a rank's
partial outputs are summed in one all-reduce per layer. The router and the shared gate are whole on every rank.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.attention.backend import FusedOps
from raypaged.model.architecture import Architecture
from raypaged.model.layers import Linear, PackedWeight, Router
from raypaged.model.parallel import RowParallelLinear, TensorParallel
from raypaged.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from raypaged.model.llama import LlamaMLP

_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def grouped_gemms_run(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the experts run as grouped GEMMs there (``SparseMoeBlock.stack_experts``): bf16 on CUDA devices of
    compute capability 9.0 and up (the H100 and H200), where ``torch._grouped_mm`` has its kernels. Elsewhere each
    chosen expert runs its own GEMMs (on a CPU, over its weights packed for ``cpu_gemm.c``)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)


def canonical_name(name: str) -> str:
    """A Mixtral checkpoint tensor's name as Qwen-MoE's spell it (``block_sparse_moe`` -> ``mlp``; an expert's
    ``w1``, ``w3``, ``w2`` -> ``gate_proj``, ``up_proj``, ``down_proj``), GLM-4.5's ``shared_experts`` as Qwen2-MoE's
    ``shared_expert``; other names unchanged."""
    if ".mlp.shared_experts." in name:
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    if ".block_sparse_moe." not in name:
        return name
    for old, new in _MIXTRAL_NAMES:
        name = name.replace(old, new)
    return name


class SparseMoeBlock(nn.Module):
    """The router, the experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        tp: TensorParallel,
        prefix: str,
        quant_config: QuantizationConfig | None,
    ) -> None:
        super().__init__()
        from raypaged.model.llama import LlamaMLP  # here: that module builds this one's blocks

        spec = arch.moe
        assert spec is not None, "an architecture with experts"
        self.tp, self.spec = tp, spec
        self.gate = Router(
            config.hidden_size,
            spec.num_experts,
            fp32=spec.fp32_router,
            score_bias=spec.score_correction_bias,
            bias=spec.router_bias,
        )
        # --enable-expert-parallel: this rank's num_experts / size experts, whole; else a share of every expert
        expert_parallel = tp.expert_parallel and tp.size > 1
        count = spec.num_experts // tp.size if expert_parallel else spec.num_experts
        self.first_expert = tp.rank * count if expert_parallel else 0
        expert_tp = TensorParallel() if expert_parallel else tp
        # gpt-oss's experts' down biases: added (weighted) by the rank whose share holds them, once per expert
        self.adds_down_bias = expert_parallel or tp.rank == 0
        self.experts = nn.ModuleList(
            LlamaMLP(
                config,
                arch,
                expert_tp,
                f"{prefix}.experts.{self.first_expert + i}",
                quant_config,
                spec.intermediate_size,
            )
            for i in range(count)
        )
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if spec.shared_intermediate_size:
            shared = LlamaMLP(config, arch, tp, f"{prefix}.shared_expert", quant_config, spec.shared_intermediate_size)
            self.shared_expert = shared
            if spec.shared_gated:
                self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # (gate | up [E, 2I, hidden], down [E, hidden, I]) where the experts run as two grouped GEMMs (stack_experts),
        # and gpt-oss's biases stacked the same way ([E, 2I], [E, hidden])
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None
        self.stacked_biases: tuple[torch.Tensor, torch.Tensor] | None = None

    def local_expert(self, index: int) -> int | None:
        """Where checkpoint expert ``index`` is in ``experts`` on this rank; None: another rank holds it."""
        local = index - self.first_expert
        return local if 0 <= local < len(self.experts) else None

    def stack_experts(self) -> bool:
        """Every expert's float gate | up and down weights into two stacked tensors (and their biases, gpt-oss's),
        each expert's becoming views of them (no copy kept), so that a step runs the experts as two grouped GEMMs
        with no host sync (``grouped``). False, and nothing changed, where an expert is quantized or its weights are
        packed."""
        if len(self.experts) != self.spec.num_experts:
            return False  # expert parallel: the grouped GEMMs would take every expert's rows
        experts = [cast("LlamaMLP", expert) for expert in self.experts]
        linears = [(e.gate_up_proj, e.down_proj) for e in experts]
        if not all(type(g) is Linear and type(d) is RowParallelLinear for g, d in linears):
            return False  # quantized
        plain = [(cast(Linear, g), cast(RowParallelLinear, d)) for g, d in linears]
        kinds = {(g.bias is not None, d.bias is not None) for g, d in plain}
        if kinds not in ({(False, False)}, {(True, True)}):
            return False  # biases on some experts' linears only
        weights = [(g.weight, d.weight) for g, d in plain]
        size, hidden = experts[0].intermediate_size, self.gate.in_features
        shapes = ((2 * size, hidden), (hidden, size))
        for pair in weights:
            for weight, shape in zip(pair, shapes):
                if isinstance(weight, PackedWeight) or weight.layout != torch.strided or tuple(weight.shape) != shape:
                    return False  # packed for the CPU GEMMs (cpu_gemm.c's or oneDNN's layout)
        with torch.no_grad():
            stacked = torch.stack([g for g, _ in weights]), torch.stack([d for _, d in weights])
        for index, (gate_up, down) in enumerate(weights):
            gate_up.data, down.data = stacked[0][index], stacked[1][index]
        self.stacked = stacked
        if kinds == {(True, True)}:
            biases = [(cast(torch.Tensor, g.bias), cast(torch.Tensor, d.bias)) for g, d in plain]
            with torch.no_grad():
                self.stacked_biases = torch.stack([g for g, _ in biases]), torch.stack([d for _, d in biases])
            for index, (gate_up_bias, down_bias) in enumerate(biases):
                gate_up_bias.data, down_bias.data = self.stacked_biases[0][index], self.stacked_biases[1][index]
        return True

    def forward(self, x: torch.Tensor, fused: FusedOps | None = None) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        """The block's output for the normed ``x`` (``fused``: its silu_and_mul in the experts)."""
        weights, experts = self.route(x)
        weights = weights if self.spec.fp32_weights else weights.to(x.dtype)
        out = self.routed(x, experts, weights, fused) if self.stacked is None else self.grouped(x, experts, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert.partial(x, fused)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
            out += shared
        return self.tp.all_reduce(out)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[T, top_k]`` and their weights (fp32), as the spec's router chooses them."""
        spec, weight = self.spec, self.gate.weight
        logits = F.linear(x.float(), weight.float()) if spec.fp32_router else F.linear(x, weight, self.gate.bias)
        if spec.scoring == "softmax" and spec.num_groups == 1 and not spec.fp32_router:  # Mixtral's, Qwen-MoE's
            weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), spec.top_k, dim=-1)
            if spec.renormalize:
                weights /= weights.sum(dim=-1, keepdim=True)
            return weights, experts
        sigmoid = spec.scoring == "sigmoid"
        scores = torch.sigmoid(logits) if sigmoid else torch.softmax(logits, dim=-1, dtype=torch.float32)
        bias = self.gate.e_score_correction_bias
        choice = scores if bias is None else scores + bias.float()
        if spec.num_groups > 1:  # only the experts of the best groups compete (V3: two best summed; V2: the best)
            groups = choice.unflatten(-1, (spec.num_groups, -1))
            group_scores = groups.topk(2, dim=-1)[0].sum(-1) if spec.group_score == "top2_sum" else groups.amax(-1)
            best = group_scores.topk(spec.topk_groups, dim=-1, sorted=False)[1]
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~kept[..., None], float("-inf") if sigmoid else 0.0).flatten(-2)
        experts = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if spec.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        return weights * spec.routed_scaling, experts

    def routed(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fused: FusedOps | None
    ) -> torch.Tensor:
        """Each token's ``experts`` ``[T, top_k]`` applied to it and summed with their ``weights``: this rank's share
        under tensor parallelism (with expert parallelism, the products of the experts it holds)."""
        top_k = experts.shape[1]
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # (token, expert) pairs by expert
        counts = torch.bincount(chosen, minlength=self.spec.num_experts).tolist()
        starts = list(itertools.accumulate(counts, initial=0))  # where each expert's run of pairs begins
        first, last = self.first_expert, self.first_expert + len(self.experts)  # this rank's experts
        out = torch.zeros_like(x)
        lo, hi = starts[first], starts[last]
        if lo == hi:
            return out
        pairs = order[lo:hi]
        rows = pairs // top_k  # each pair's token
        gathered, pair_weights = x[rows], weights.flatten()[pairs, None]
        scaled_outputs: torch.Tensor | None = pair_weights
        if self.spec.weight_inputs:  # Llama 4: each expert takes its token times its weight
            gathered, scaled_outputs = gathered * pair_weights, None
        products = torch.empty_like(gathered)
        for expert, start, end in zip(self.experts, starts[first:last], starts[first + 1 : last + 1]):
            if end > start:
                mlp = cast("LlamaMLP", expert)
                y = mlp.partial(gathered[start - lo : end - lo], fused)
                if (bias := getattr(mlp.down_proj, "bias", None)) is not None and self.adds_down_bias:  # gpt-oss's
                    y = y + bias
                # in fp32 for Mixtral's fp32 weights, then rounded
                weight = None if scaled_outputs is None else scaled_outputs[start - lo : end - lo]
                products[start - lo : end - lo] = y if weight is None else y * weight
        return out.index_add_(0, rows, products)

    def grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``routed`` as two grouped GEMMs over the stacked weights (``torch._grouped_mm``, each expert's run of rows
        by the offsets), with no host sync: the expert counts stay on the device."""
        assert self.stacked is not None
        gate_up, down = self.stacked
        top_k = experts.shape[1]
        chosen = experts.flatten()
        order = torch.argsort(chosen, stable=True)  # (token, expert) pairs by expert
        rows = order // top_k
        counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # where each expert's run ends
        pair_weights = weights.flatten()[order, None]
        inputs = x[rows] * pair_weights if self.spec.weight_inputs else x[rows]  # Llama 4: its inputs weighted
        gated = torch._grouped_mm(inputs.to(x.dtype), gate_up.transpose(1, 2), offs=offsets)
        expert_of = chosen[order]  # each sorted pair's expert
        if self.stacked_biases is not None:  # gpt-oss's: each row's expert's biases
            gated = gated + self.stacked_biases[0][expert_of]
        hidden = cast("LlamaMLP", self.experts[0]).act_and_mul(gated)  # SiLU, or gpt-oss's clamped SwiGLU
        out = torch._grouped_mm(hidden, down.transpose(1, 2), offs=offsets)
        if self.stacked_biases is not None and self.adds_down_bias:
            out = out + self.stacked_biases[1][expert_of]
        if not self.spec.weight_inputs:
            out = out * pair_weights
        return torch.zeros_like(x).index_add_(0, rows, out.to(x.dtype))
