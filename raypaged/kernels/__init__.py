"""CUDA kernels (``kernels/*.cu`` through cupy) with the same signatures as raypaged.attention.torch_ops,
the varlen prefill kernel that runs all of a step's prefill spans at once, and the model step's
fused elementwise kernels (``fused_ops``, references in raypaged.model.layers)."""

from raypaged.kernels.fused_ops import fused_add_rms_norm, rms_norm, rotary_and_cache, silu_and_mul
from raypaged.kernels.ops import (
    copy_blocks,
    gather_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)
from raypaged.kernels.prefill_ops import paged_prefill_attention

__all__ = [
    "copy_blocks",
    "fused_add_rms_norm",
    "gather_blocks",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_prefill_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "silu_and_mul",
]
