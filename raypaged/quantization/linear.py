"""The quantized linear layer and the factory the decoder builds every projection with.

Column-parallel layers (qkv_proj, gate_up_proj) hold this rank's output rows, filled part by part
(q, k, v); row-parallel ones (o_proj, down_proj) hold this rank's input columns and all-reduce
their product, the bias added once. Every tensor splits by its :class:`TensorSpec`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch
from torch import nn

from raypaged.model.layers import Linear, Router
from raypaged.model.parallel import RowParallelLinear, TensorParallel, VocabParallelEmbedding
from raypaged.quantization.base import LinearMethod, LinearShape, QuantizationConfig, TensorSpec


class QuantLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` in the tensors of ``method``; ``row_parallel``: all-reduced over ``tp``."""

    def __init__(
        self, shape: LinearShape, bias: bool, method: LinearMethod, tp: TensorParallel, row_parallel: bool
    ) -> None:
        super().__init__()
        self.shape, self.method, self.tp, self.row_parallel = shape, method, tp, row_parallel
        self.specs = method.tensors(shape)
        for name, spec in self.specs.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=False))
        self.bias = nn.Parameter(torch.empty(shape.out_features)) if bias else None
        self._merged: set[str] = set()  # "same"/"max" tensors some part has filled

    @property
    def keeps_dtype(self) -> set[str]:
        """Parameters that stay in their own dtype when the model is cast (all but the bias)."""
        return set(self.specs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, in_features]
        return self.reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``y`` (all of it unless row-parallel), before any all-reduce."""
        return self.method.apply(self, x)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """Row-parallel: the ranks' shares summed; then the bias."""
        if self.row_parallel:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def silu_and_mul(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``act(self(x))`` for a gate | up projection, ``act`` being the step's silu_and_mul; one pass where
        the method packed the weight gated (:meth:`LinearMethod.pack_gated`)."""
        fused = None if self.row_parallel else self.method.silu_and_mul(self, x)
        return act(self(x)) if fused is None else fused

    def load_part(self, name: str, tensor: torch.Tensor, first_row: int, offset: int, num_rows: int) -> None:
        """Rows ``first_row:first_row+num_rows`` of checkpoint output features go to ``offset`` here."""
        if name == "bias":
            self._bias().data[offset : offset + num_rows].copy_(tensor[first_row : first_row + num_rows])
            return
        if self.method.checked(name, tensor, first_row + num_rows, self.shape):
            return
        spec, param = self._spec(name), getattr(self, name).data
        if spec.merge != "shard":
            self._merge(name, spec, param, tensor)
            return
        if spec.out_dim is None:
            raise ValueError(f"{name} of a fused layer must be per output feature")
        dim, pack = spec.out_dim, spec.out_pack
        if spec.out_block > 1:
            tensor = tensor.repeat_interleave(spec.out_block, dim)
        for value in (first_row, offset, num_rows):
            if value % pack:
                raise ValueError(
                    f"{name}: a part of {num_rows} output rows at {first_row} does not split into packs of {pack}"
                )
        target = param.narrow(dim, offset // pack, num_rows // pack)
        if spec.broadcast and tensor.numel() == 1:
            target.fill_(tensor.reshape(()).item())
        else:
            target.copy_(tensor.narrow(dim, first_row // pack, num_rows // pack))

    def load_shard(self, name: str, tensor: torch.Tensor) -> None:
        """A whole checkpoint tensor of a row-parallel layer: this rank's input columns of it."""
        if name == "bias":
            self._bias().data.copy_(tensor)
            return
        if self.method.checked(name, tensor, self.shape.out_features, self.shape):
            return
        spec, param = self._spec(name), getattr(self, name).data
        if spec.broadcast and tensor.numel() == 1:
            param.fill_(tensor.reshape(()).item())
            return
        if spec.in_dim is not None and self.shape.row_sharded:
            start, length = self.tp.chunk(self.shape.in_total)
            tensor = tensor.narrow(spec.in_dim, start // spec.in_pack, length // spec.in_pack)
        if spec.out_dim is not None and spec.out_block > 1:
            rows = param.shape[spec.out_dim]
            tensor = tensor.repeat_interleave(spec.out_block, spec.out_dim).narrow(spec.out_dim, 0, rows)
        param.copy_(tensor.reshape(param.shape))

    def finish(self) -> None:
        self.method.finish(self)

    def dequantize(self) -> torch.Tensor:  # [out_features, in_features] float32
        return self.method.dequantize(self)

    def _spec(self, name: str) -> TensorSpec:
        if name not in self.specs:
            self._no_place(name)
        return self.specs[name]

    def _bias(self) -> nn.Parameter:
        if self.bias is None:
            self._no_place("bias")
        return self.bias

    def _no_place(self, name: str) -> NoReturn:
        raise ValueError(
            f"checkpoint tensor {name!r} has no place in a {type(self.method).__name__} layer "
            f"(it holds {', '.join(self.specs)})"
        )

    def _merge(self, name: str, spec: TensorSpec, param: torch.Tensor, tensor: torch.Tensor) -> None:
        tensor = tensor.reshape(param.shape).to(param.dtype)
        if name not in self._merged:
            param.copy_(tensor)
            self._merged.add(name)
        elif spec.merge == "max":
            torch.maximum(param, tensor, out=param)
        elif not torch.equal(param, tensor):
            raise ValueError(f"the fused parts of this layer bring different {name} tensors; they must be equal")


def build_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    tp: TensorParallel,
    row_parallel: bool,
    quant_config: QuantizationConfig | None,
    part_names: tuple[str, ...],
) -> nn.Module:
    """The layer of one projection: ``out_features`` are this rank's for a column-parallel layer,
    ``in_features`` the whole layer's for a row-parallel one; ``part_names`` are the checkpoint
    modules it fuses (their scheme decides the method)."""
    method = None if quant_config is None else quant_config.linear_method(part_names)
    if method is None:
        if row_parallel:
            return RowParallelLinear(in_features, out_features, bias, tp)
        return Linear(in_features, out_features, bias=bias)
    local_in = in_features // tp.size if row_parallel else in_features
    return QuantLinear(LinearShape(local_in, out_features, in_features), bias, method, tp, row_parallel)


def finish_loading(model: nn.Module) -> None:
    """Let every quantized linear build its runtime tensors (after loading and casting)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.finish()


def cast_model(model: nn.Module, dtype: torch.dtype, keep_bf16_weights: bool = False) -> None:
    """``model.to(dtype)`` except the quantized tensors, which keep their own dtypes. ``keep_bf16_weights``: a bf16
    model computing in fp32 on a CPU (``layers.bf16_linears_on_cpu``) keeps its float linears' and embeddings'
    weights as loaded, for ``pack_weights`` to pack in bf16 (and, after it, their packed or bf16 rows)."""
    for module in model.modules():
        keep = module.keeps_dtype if isinstance(module, (QuantLinear, Router)) else set()
        if keep_bf16_weights and isinstance(module, (Linear, RowParallelLinear, VocabParallelEmbedding)):
            keep = {"weight", "head_weight"}
        for name, param in module.named_parameters(recurse=False):
            if name not in keep and param.is_floating_point():
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))
