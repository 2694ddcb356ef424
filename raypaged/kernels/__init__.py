"""CUDA kernels (``kernels/*.cu`` through cupy) with the same signatures as raypaged.attention.torch_ops,
and the varlen prefill kernel that runs all of a step's prefill spans at once."""

from raypaged.kernels.ops import (
    copy_blocks,
    gather_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)
from raypaged.kernels.prefill_ops import paged_prefill_attention

__all__ = ["copy_blocks", "gather_blocks", "paged_attention_decode", "paged_attention_prefill",
           "paged_prefill_attention", "reshape_and_cache"]
