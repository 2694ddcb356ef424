"""Building blocks of Llama-family decoders."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from raypaged.attention import cpu_ops

if TYPE_CHECKING:
    from raypaged.model.parallel import TensorParallel

logger = logging.getLogger("raypaged")

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")

# oneDNN's fp32 GEMM against F.linear's (MKL sgemm) on a 2-core AVX-512 AMD EPYC, SmolLM2's projections
# and LM head: about 2x faster from 32 rows, 1.1-3.7x from 8; at 1-2 rows within 10 us either way
_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACK_ROWS_HINT = 32  # oneDNN's expected row count when packing; any hint but 1 measured the same from 2 rows up


class PackedWeight(nn.Parameter):
    """An fp32 CPU weight ``[out_features, in_features]`` packed into the column panels of ``cpu_gemm.c``:
    ``[ceil(out / panel), in, panel]``, the last panel padded with zeros. :func:`linear` runs it through
    ``raypaged_linear_f32``; :meth:`unpack` gives the weight back.

    ``gated``: an MLP's ``gate | up`` weight (``[2 * h, in]``) in the gated layout, each panel holding
    ``panel / 2`` gate rows and the same up rows (``h`` padded to whole panels with zeros), so that
    :func:`silu_and_mul_linear` computes ``silu(gate) * up`` without writing the ``[rows, 2 * h]``
    activations; :func:`linear` on it gives the plain layout's bits.

    ``bf16`` (its dtype is bf16): the weight's values rounded to bf16 (exact for a bf16 checkpoint's) and packed
    as ``cpu_gemm.c`` says for ``raypaged_linear_bf16``: half the bytes; inputs and outputs stay fp32. Where the CPU
    has AVX512-BF16 the panels hold pairs of input features (``[panels, ceil(in / 2), panel, 2]``) and the inputs
    are rounded to bf16 too; elsewhere they are ``[panels, in, panel]``, widened to fp32 before the fp32 tiles run,
    which gives the bits of the fp32 weight of the same values."""

    out_features: int
    in_features: int
    gated: bool

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    @staticmethod
    def pack(weight: torch.Tensor, gated: bool = False, bf16: bool = False) -> PackedWeight:
        """Needs the CPU kernels (``cpu_ops.builds()``). A bf16 weight packs only ``bf16``, widened one weight at a
        time (a bf16 model is loaded in bf16: no fp32 copy of it is ever held whole)."""
        lib = cpu_ops.library()
        if bf16 and weight.dtype == torch.bfloat16:
            weight = weight.float()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or weight.stride(1) != 1:
            raise ValueError(
                f"only a 2-D float32 CPU weight with contiguous rows packs, got {weight.dtype} "
                f"{tuple(weight.shape)} on {weight.device}"
            )
        out_features, in_features = weight.shape
        width = lib.raypaged_gemm_panel_width()
        if gated:
            weight = gated_rows(weight, width)
        panels = -(-weight.shape[0] // width)
        if not bf16:
            data, pack = torch.empty(panels, in_features, width), lib.raypaged_pack_weight_f32
        else:
            pairs = lib.raypaged_gemm_bf16_pairs()
            shape = (panels, -(-in_features // 2), width, 2) if pairs else (panels, in_features, width)
            data, pack = torch.empty(shape, dtype=torch.bfloat16), lib.raypaged_pack_weight_bf16
        threads = torch.get_num_threads()
        pack(weight.data_ptr(), weight.shape[0], in_features, weight.stride(0), data.data_ptr(), threads)
        packed = PackedWeight(data, requires_grad=False)
        packed.out_features, packed.in_features, packed.gated = out_features, in_features, gated
        return packed

    def unpack(self) -> torch.Tensor:  # -> [out_features, in_features], fp32
        panels = self.detach().float()
        if panels.dim() == 4:  # bf16 pairs: [panels, in / 2, panel, 2] -> [panels, panel, in]
            panels = panels.permute(0, 2, 1, 3).reshape(panels.shape[0], panels.shape[2], -1)[:, :, : self.in_features]
        else:
            panels = panels.transpose(1, 2)
        rows = panels.reshape(-1, self.in_features)
        if self.gated:
            return ungated_rows(rows, panels.shape[1], self.out_features)
        return rows[: self.out_features].clone()


def gated_rows(weight: torch.Tensor, width: int) -> torch.Tensor:
    """An MLP's ``[gate | up]`` weight (``[2 * h, in]``) in the row order of the gated layout for panels of
    ``width`` columns: panel by panel, ``width / 2`` gate rows then the same up rows, ``h`` padded with zero
    rows to whole panels."""
    rows, in_features = weight.shape
    if rows % 2:
        raise ValueError(f"a gated (gate | up) weight has an even number of rows, got {rows}")
    panels = -(-rows // width)
    halves = weight.new_zeros(2, panels * width // 2, in_features)
    halves[:, : rows // 2] = weight.view(2, rows // 2, in_features)
    return halves.view(2, panels, width // 2, in_features).transpose(0, 1).reshape(-1, in_features)


def ungated_rows(rows: torch.Tensor, width: int, out_features: int) -> torch.Tensor:
    """:func:`gated_rows` undone: the ``[gate | up]`` weight's ``out_features`` rows back in their order."""
    halves = rows.reshape(-1, 2, width // 2, rows.shape[1]).transpose(0, 1).reshape(2, -1, rows.shape[1])
    return halves[:, : out_features // 2].reshape(-1, rows.shape[1])


def _packed_linear(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None, silu: bool = False
) -> torch.Tensor:
    lib = cpu_ops.library()
    out_features, in_features = weight.out_features, weight.in_features
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != in_features:
        raise ValueError(
            f"a packed [{out_features} x {in_features}] {'bf16' if weight.bf16 else 'float32'} CPU weight takes "
            f"float32 CPU inputs of {in_features} features, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    rows = x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    outputs = out_features // 2 if silu else out_features
    y = torch.empty(rows.shape[0], outputs)
    args = (
        *(rows.data_ptr(), rows.shape[0], in_features, rows.stride(0), weight.data_ptr(), out_features),
        *(None if bias is None else bias.data_ptr(), y.data_ptr(), outputs, 2 if silu else int(weight.gated)),
    )
    if not weight.bf16:
        lib.raypaged_linear_f32(*args, torch.get_num_threads())
    elif lib.raypaged_linear_bf16(*args, torch.get_num_threads()):
        raise MemoryError(f"no memory for the scratch of a bf16 linear of {rows.shape[0]} x {in_features} inputs")
    return y.view(*x.shape[:-1], outputs)


def silu_and_mul_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu_and_mul(linear(x, weight, bias))`` in one pass, for a gated :class:`PackedWeight`: the same
    bits as ``cpu_fused.silu_and_mul`` after :func:`linear`."""
    if not weight.gated:
        raise ValueError("silu_and_mul_linear takes a weight packed gated (PackedWeight.pack(weight, gated=True))")
    return _packed_linear(x, weight, bias, silu=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``. A :class:`PackedWeight` runs through ``cpu_gemm.c``; other fp32 weights on the CPU
    through oneDNN (same result within fp32 rounding), whose weight may be the blocked one of
    :func:`pack_weight_onednn`."""
    if isinstance(weight, PackedWeight):
        return _packed_linear(x, weight, bias)
    if _ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def packs_weights(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` takes its linears' weights packed (:func:`pack_weight`):
    fp32 on the CPU, where the C kernels build or oneDNN is present."""
    return dtype == torch.float32 and device.type == "cpu" and (_ONEDNN_LINEAR or cpu_ops.builds())


def bf16_linears_on_cpu(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of ``dtype`` on ``device`` computes in fp32 with its float linears' weights packed in bf16
    (:class:`PackedWeight`'s ``bf16``): a bf16 model on a CPU where the C kernels build. torch's own bf16 path ran
    SmolLM2's W6 at 0.4x fp32 on 2 Zen 5 cores (AVX512-BF16), and slower still without BF16 instructions."""
    return dtype == torch.bfloat16 and device.type == "cpu" and cpu_ops.builds()


def pack_weight(weight: torch.Tensor, gated: bool = False, bf16: bool = False) -> nn.Parameter:
    """An fp32 CPU weight ``[out, in]`` packed once at load for :func:`linear`: a :class:`PackedWeight`
    for ``cpu_gemm.c`` where the C kernels build (``gated``: an MLP's gate | up weight, packed for
    :func:`silu_and_mul_linear` as well; ``bf16``: its values in bf16, :func:`bf16_linears_on_cpu`), else
    oneDNN's blocked layout (which has no gated form).

    ``cpu_gemm.c`` against oneDNN's packed weight, SmolLM2's decode step at 32 rows on 2 Zen 5 cores: 26 ->
    19.6 ms (46 -> 35 ms with both on AVX2); as fast or faster at each projection from 1 to 512 rows.
    """
    if cpu_ops.builds():
        return PackedWeight.pack(weight.detach(), gated, bf16)
    if bf16:
        raise ValueError("bf16 weights pack only for the CPU kernels, which do not build here")
    return pack_weight_onednn(weight)


def pack_linears(module: nn.Module, bf16: bool = False) -> None:
    """Every plain ``nn.Linear`` inside ``module`` (an image encoder's) made a :class:`Linear` with its weight packed
    (:func:`pack_weight`, in bf16 with ``bf16``): for fp32 on the CPU (:func:`packs_weights`), after loading."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = Linear(child.in_features, child.out_features, child.bias is not None, device="meta")
                packed.weight, packed.bias = child.weight, child.bias
                packed.pack(bf16=bf16)
                setattr(parent, name, packed)


def pack_weight_onednn(weight: torch.Tensor) -> nn.Parameter:
    """An fp32 CPU weight ``[out, in]`` in oneDNN's blocked layout, for :func:`linear` (where the C kernels
    cannot be built).

    Packed once at load instead of reordered inside every call: on 2 AVX-512 cores SmolLM2's
    projections run 1.3-1.8x faster at 32 rows and 2-2.7x at 8 (no faster at 1). The products are
    bit-identical to the plain weight's from 2 rows up. ``weight.to_dense()`` gives the weight back.
    """
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
    return nn.Parameter(packed, requires_grad=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # x: [..., hidden]
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)``, in fp32 for half inputs (as transformers)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one call, bit-identical to the expression on CPU
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the sum is written into ``x``, which the caller gives up."""
    summed = x.add_(residual)
    return rms_norm(summed, weight, eps), summed


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed x + residual, x + residual), the sum written into ``x``, through this norm's ``forward`` (Gemma's
        and OLMo 2's have their own)."""
        summed = x.add_(residual)
        return self(summed), summed


class Olmo2RMSNorm(RMSNorm):
    """OLMo 2's: ``(weight * (x32 * rsqrt(mean(x32^2) + eps))).to(x.dtype)``, the weight applied in fp32 (Llama's
    applies it after rounding to the dtype). Its q and k norms span a whole projection, every head of it: under
    tensor parallelism a rank holds its heads' share of the weight and the mean of squares is summed over the
    ranks (``tp``)."""

    def __init__(self, hidden_size: int, eps: float, tp: TensorParallel | None = None, start: int = 0) -> None:
        super().__init__(hidden_size, eps)
        self.tp, self.start = tp, start  # this rank's first feature of the whole norm (q and k norms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, ...] normed over all but the first dim
        x32 = x.reshape(x.shape[0], -1).to(torch.float32)
        if self.tp is None or self.tp.size == 1:
            variance = x32.pow(2).mean(-1, keepdim=True)
        else:  # a replicated KV head counts once per rank holding it, as the width does
            variance = self.tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / (x32.shape[1] * self.tp.size)
        out = self.weight.to(torch.float32) * (x32 * torch.rsqrt(variance + self.eps))
        return out.to(x.dtype).view(x.shape)

    def load_shard(self, tensor: torch.Tensor) -> None:
        """This rank's features of the checkpoint's weight (all of it for a norm over the hidden state)."""
        self.weight.data.copy_(tensor[self.start : self.start + self.weight.shape[0]])


class GemmaRMSNorm(RMSNorm):
    """Gemma's: ``(x32 * rsqrt(mean(x32^2) + eps) * (1 + weight32)).to(x.dtype)``, its checkpoint's weight centred on
    0 (as transformers computes it, in fp32 throughout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The config's rope parameters (``layer_type``: those of that type of layer, where they are per layer type, as
    Gemma 3's; each type is checked without one); ``ValueError`` naming a rope type, or a partial rotation outside
    Phi-3 and GLM (whose transformers models alone rotate part of each head), that is not supported."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    elif set(params) <= {"sliding_attention", "full_attention"} and params:
        for each in params:
            rope_parameters(config, each)
        return params
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0 and config.model_type not in _PARTIAL_ROTARY_TYPES:
        raise ValueError(
            f"partial_rotary_factor {partial} is supported for {', '.join(_PARTIAL_ROTARY_TYPES.values())} only "
            f"(transformers rotates whole heads in {config.model_type})"
        )
    return params


# the model types whose transformers models rotate only the first partial_rotary_factor of each head
_PARTIAL_ROTARY_TYPES = {
    "phi3": "Phi3ForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE over the first ``rotary_dim`` features of each head (all of them but where Phi-3's
    ``partial_rotary_factor`` is below 1), cos/sin of ``rotary_dim / 2`` precomputed for every position.

    ``longrope`` (Phi-3's short and long factors): transformers takes the short factors while a sequence is
    within ``original_max_position_embeddings`` and the long ones past it, recomputing the whole cache when it
    crosses; a paged cache cannot, so, as vLLM, a model of ``max_positions`` past that length takes the long
    factors for every sequence, and one within it the short ones (transformers' values either way, for a
    sequence on that side of the boundary).

    Qwen2-VL's multimodal rotary (M-RoPE, ``mrope_section`` in the rope parameters): a token has three positions
    (temporal, height, width; all three its one position for text) and the frequencies are cut into sections,
    the ``i``-th taking its angle from position ``i % 3``; Qwen3-VL's (``mrope_interleaved``) takes frequency ``j``'s
    from axis ``j % 3`` instead (height and width only as far as their sections' counts go, the rest temporal).
    Steps whose tokens all have equal positions use ``cos_sin`` as any rotary; a step with image tokens sets
    ``step_table`` to its rows (``mrope_rows``) and indexes it by token.
    """

    cos_sin: torch.Tensor  # buffer [max_positions, 2, rotary_dim / 2]
    step_table: torch.Tensor | None  # M-RoPE: this step's rows [num_tokens, 2, rotary_dim / 2], or None

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        max_positions: int,
        layer_type: str | None = None,
        interleaved: bool = False,
    ) -> None:
        super().__init__()
        # ERNIE 4.5: feature pairs (2i, 2i + 1) rotate together, not the halves (i, i + R/2); the fused rotary ops and
        # kernels rotate halves only
        self.interleaved = interleaved
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":  # transformers' default: the rotated features' own frequencies
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            scaling = 1.0
        elif rope_type == "longrope":
            original = params["original_max_position_embeddings"]
            long = max_positions > original
            if long:
                logger.warning(
                    "longrope: max_model_len %d exceeds original_max_position_embeddings %d, so every sequence "
                    "takes the long factors (transformers takes the short ones for a sequence within %d tokens); "
                    "--max-model-len %d keeps the short ones",
                    max_positions,
                    original,
                    original,
                    original,
                )
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](
                config, torch.device("cpu"), seq_len=original + 1 if long else None
            )
        elif layer_type is not None:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.rotary_dim = 2 * inv_freq.shape[0]  # as transformers' apply_rotary_pos_emb: cos's width
        if not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"the rotary embedding spans {self.rotary_dim} features of heads of {head_dim}")
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim / 2]
        cos_sin = torch.stack((freqs.cos() * scaling, freqs.sin() * scaling), dim=1)
        self.register_buffer("cos_sin", cos_sin, persistent=False)  # [max_positions, 2, rotary_dim / 2]
        section = params.get("mrope_section")
        # M-RoPE: each frequency's position axis (0 temporal, 1 height, 2 width)
        self.mrope_axes = None if section is None else _mrope_axes(section, self.rotary_dim // 2, params)
        self.step_table = None

    @property
    def table(self) -> torch.Tensor:
        """The rows positions index: ``cos_sin``, or this step's M-RoPE rows (indexed by token)."""
        return self.cos_sin if self.step_table is None else self.step_table

    def mrope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """M-RoPE's cos/sin rows ``[num_tokens, 2, rotary_dim / 2]`` of tokens at ``positions: [3, num_tokens]``:
        each section of frequencies at its own axis's position."""
        axes = self.mrope_axes
        assert axes is not None, "M-RoPE positions for a rotary without mrope_section"
        rows = self.cos_sin[positions]  # [3, T, 2, R/2]
        return rows.gather(0, axes.to(rows.device).expand(1, *rows.shape[1:])).squeeze(0)

    def rotate_(self, positions: torch.Tensor, *xs: torch.Tensor) -> None:
        """Rotate each ``x: [num_tokens, heads, head_dim]`` (strided views too) in place by its tokens' positions."""
        cos_sin = self.table[positions]  # [T, 2, R/2]
        cos, sin = cos_sin[:, None, None, 0], cos_sin[:, None, None, 1]  # [T, 1, 1, R/2]
        for x in xs:
            (apply_interleaved_rotary_ if self.interleaved else apply_rotary_)(x, cos, sin)


def _mrope_axes(section: list[int], num_frequencies: int, params: dict) -> torch.Tensor:
    """M-RoPE's position axis of each of a head's ``num_frequencies`` frequencies: by consecutive sections, or
    interleaved (``mrope_interleaved``: frequency ``j`` of axis ``j % 3`` while that axis's section lasts)."""
    if sum(section) != num_frequencies:
        raise ValueError(
            f"mrope_section {list(section)} sums to {sum(section)}, not the {num_frequencies} rotary frequencies of a "
            "head"
        )
    if not params.get("mrope_interleaved"):
        return torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
    axes = torch.zeros(num_frequencies, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``x = x * cos + rotate_half(x) * sin`` in place, bit for bit, without building ``rotate_half(x)``, over
    the first ``R`` features of each head (the rest pass, as transformers' partial rotation leaves them).

    x: [T, H, D]; cos, sin: [T, 1, 1, R/2] (the two halves of the rotated features share them), R <= D.
    """
    halves = x[..., : 2 * cos.shape[-1]].unflatten(-1, (2, -1))  # [T, H, 2, R/2]: x1, x2
    x_sin = halves * sin
    halves.mul_(cos)
    halves[..., 0, :].sub_(x_sin[..., 1, :])  # x1 * cos - x2 * sin
    halves[..., 1, :].add_(x_sin[..., 0, :])  # x2 * cos + x1 * sin


def apply_interleaved_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """``x = x * cos + rotate_interleaved(x) * sin`` in place over the first ``R`` features of each head, each pair
    (2i, 2i + 1) by frequency i, in fp32 (as transformers' ERNIE 4.5 rotates, then rounds to x's dtype).

    x: [T, H, D]; cos, sin: [T, 1, 1, R/2].
    """
    pairs = x[..., : 2 * cos.shape[-1]].unflatten(-1, (-1, 2))  # [T, H, R/2, 2]
    x0, x1 = pairs[..., 0].float(), pairs[..., 1].float()
    cos, sin = cos.squeeze(2), sin.squeeze(2)  # [T, 1, R/2], as x0 and x1's [T, H, R/2]
    pairs.copy_(torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x: [T, 2 * I] (gate | up) -> [T, I]
    """``silu(gate) * up`` with one output buffer."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def clamped_swiglu(alpha: float, limit: float, x: torch.Tensor) -> torch.Tensor:  # [T, 2 * I] (gate | up) -> [T, I]
    """gpt-oss's experts' activation: ``(up + 1) * gate * sigmoid(alpha * gate)``, gate clamped to at most ``limit``
    and up to ``[-limit, limit]``, as transformers' ``GptOssExperts``."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # x: [T, 2 * I] (gate | up) -> [T, I]
    """``gelu_pytorch_tanh(gate) * up`` (Gemma's GeGLU) with one output buffer."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


class Router(nn.Linear):
    """A mixture of experts' router (``[num_experts, hidden]``, whole on every rank; ``bias``: gpt-oss's logits have
    one). ``fp32``: its weight,
    and ``e_score_correction_bias`` (a per-expert bias added to the scores that choose the experts, GLM-4.5's) where
    ``score_bias``, stay fp32 in any model dtype (``keeps_dtype``), as transformers keeps them."""

    def __init__(
        self, hidden_size: int, num_experts: int, fp32: bool = False, score_bias: bool = False, bias: bool = False
    ) -> None:
        super().__init__(hidden_size, num_experts, bias=bias, dtype=torch.float32 if fp32 else None)
        self.e_score_correction_bias: nn.Parameter | None = None
        if score_bias:
            dtype = torch.float32 if fp32 else None
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype), requires_grad=False)
        self.keeps_dtype = {"weight", "e_score_correction_bias"} if fp32 else set()


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`linear`."""

    def reset_parameters(self) -> None:
        """Zeros, not ``nn.Linear``'s random draw: the checkpoint (or ``fill_dummy``) writes every weight after the
        model is built, and the draw took 0.3 s of SmolLM2's 2 s start."""
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def pack(self, gated: bool = False, bf16: bool = False) -> None:
        """The weight packed for :func:`linear` (:func:`pack_weight`); after loading, on a CPU in fp32."""
        self.weight = pack_weight(self.weight, gated, bf16)

    def silu_and_mul(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act(self(x))`` for a gate | up projection, ``act`` being the step's silu_and_mul; where the
        weight is packed gated, one pass (:func:`silu_and_mul_linear`) with the C silu_and_mul's bits."""
        if isinstance(self.weight, PackedWeight) and self.weight.gated:
            return silu_and_mul_linear(x, self.weight, self.bias)
        return act(self(x))

    def load_part(self, name: str, tensor: torch.Tensor, first_row: int, offset: int, num_rows: int) -> None:
        """Checkpoint rows ``first_row:first_row+num_rows`` of ``name`` (weight or bias) go to rows ``offset:``."""
        if name not in ("weight", "bias") or getattr(self, name) is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in an unquantized linear layer")
        getattr(self, name).data[offset : offset + num_rows].copy_(tensor[first_row : first_row + num_rows])
