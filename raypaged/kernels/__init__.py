"""CUDA kernels (``kernels/*.cu`` through cupy) with the same signatures as raypaged.attention.torch_ops."""

from raypaged.kernels.ops import (
    copy_blocks,
    gather_blocks,
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)

__all__ = ["copy_blocks", "gather_blocks", "paged_attention_decode", "paged_attention_prefill", "reshape_and_cache"]
