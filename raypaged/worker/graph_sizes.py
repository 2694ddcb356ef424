"""Which step sizes get CUDA graphs (no torch here: the config checks its flags with it).

Decode graphs record a whole decode-only step per batch size; piecewise graphs record the pieces
between attention calls of any step per token count (``cuda_graphs.py``, ``piecewise_graphs.py``).
A step larger than the largest size runs eagerly; a smaller one pads up to the next size."""

from __future__ import annotations

# piecewise token counts: powers of two and the halves between them, so padding is under a third past 8
BUCKET_LADDER = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to and including ``max_num_seqs`` (also when it is not a multiple of 8)."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def token_buckets(max_num_batched_tokens: int, cap: int = BUCKET_LADDER[-1]) -> list[int]:
    """The ladder's sizes below ``min(max_num_batched_tokens, cap)``, then that limit itself."""
    limit = min(max_num_batched_tokens, cap)
    return [n for n in BUCKET_LADDER if n < limit] + [limit]


def capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, sizes: list[int] | None, max_size: int | None
) -> tuple[list[int], list[int]]:
    """The decode graphs' batch sizes and the piecewise graphs' token counts.

    By default the ladders above, up to ``max_num_seqs`` and ``min(max_num_batched_tokens, 512)``.
    vLLM's ``--cudagraph-capture-sizes`` gives the sizes themselves (decode takes those up to
    ``max_num_seqs``, piecewise those up to ``max_num_batched_tokens``); its ``--max-cudagraph-capture-size``
    cuts both ladders at that size instead (piecewise may then go past 512). Bad values raise ``ValueError``
    naming the flags."""
    if sizes is not None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--cudagraph-capture-sizes takes sizes of at least 1, got {sizes}")
        if max_size is not None and max_size != max(sizes):
            raise ValueError(
                f"--max-cudagraph-capture-size {max_size} is not the largest of --cudagraph-capture-sizes "
                f"({max(sizes)}): give one of the two, or both in agreement"
            )
        chosen = sorted(set(sizes))
        decode = [n for n in chosen if n <= max_num_seqs]
        if not decode:
            raise ValueError(
                f"--cudagraph-capture-sizes {' '.join(map(str, sizes))}: none is at most --max-num-seqs "
                f"{max_num_seqs}, so no decode step could replay a graph"
            )
        return decode, [n for n in chosen if n <= max_num_batched_tokens]
    if max_size is None:
        return batch_size_ladder(max_num_seqs), token_buckets(max_num_batched_tokens)
    if max_size < 1:
        raise ValueError(f"--max-cudagraph-capture-size must be at least 1, got {max_size}")
    return batch_size_ladder(min(max_num_seqs, max_size)), token_buckets(max_num_batched_tokens, max_size)
