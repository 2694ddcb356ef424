"""GPU acceptance check for the CUDA kernels; needs torch, cupy and a CUDA device, not Ray.

    python benchmarks/gpu_check.py [--json results.json]

1. runs tests/gpu (every kernel against the torch reference);
2. times paged_attention_decode (v1 and v2) at batch 256 x context 2048 with Llama-2-7B
   attention shapes (32 heads, head 128, fp16, block 16) against the memory floor:
   bytes of K/V read / measured device-to-device copy bandwidth (target: >= 70%);
3. times the prefill path's block gather against its SDPA call (the gather's share);
4. W1 end to end against transformers: pending until the CUDA model runner exists.
Finishes in well under 8 minutes on one H200-class GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from raypaged import kernels
from raypaged.attention.torch_ops import prefill_attention

ROOT = Path(__file__).resolve().parents[1]
BATCH, CONTEXT, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 256, 2048, 32, 128, 16
FLOOR_TARGET = 0.70


def seconds_per_call(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def run_gpu_tests() -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu"]
    return subprocess.run(cmd, cwd=ROOT, timeout=360).returncode == 0


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device memory bandwidth in bytes/s as a large copy sees it (bytes read + written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / seconds_per_call(lambda: dst.copy_(src))


def decode_vs_floor(bandwidth: float) -> dict:
    num_blocks = BATCH * CONTEXT // BLOCK_SIZE
    shape = (num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    key_cache = torch.randn(shape, dtype=torch.float16, device="cuda")
    value_cache = torch.randn(shape, dtype=torch.float16, device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda").view(BATCH, CONTEXT // BLOCK_SIZE)
    context_lens = torch.full((BATCH,), CONTEXT, device="cuda")
    query = torch.randn(BATCH, NUM_HEADS, HEAD_SIZE, dtype=torch.float16, device="cuda")
    kv_bytes = 2 * key_cache.numel() * key_cache.element_size()
    floor_s = kv_bytes / bandwidth

    def decode(partition_size: int | None) -> torch.Tensor:
        return kernels.paged_attention_decode(
            query, key_cache, value_cache, block_tables, context_lens, HEAD_SIZE**-0.5, partition_size
        )

    rows = {}
    for name, partition_size in (("v1 (default)", None), ("v2 (512-token partitions)", 512)):
        seconds = seconds_per_call(functools.partial(decode, partition_size))
        rows[name] = dict(ms=seconds * 1e3, floor_ms=floor_s * 1e3, of_floor=floor_s / seconds)
    return dict(kv_bytes=kv_bytes, copy_bandwidth_gbs=bandwidth / 1e9, kernels=rows)


def prefill_gather_share(query_len: int = 512) -> dict:
    num_blocks = CONTEXT // BLOCK_SIZE
    shape = (4 * num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    key_cache = torch.randn(shape, dtype=torch.float16, device="cuda")
    value_cache = torch.randn(shape, dtype=torch.float16, device="cuda")
    block_ids = torch.randperm(4 * num_blocks, device="cuda")[:num_blocks]
    query = torch.randn(query_len, NUM_HEADS, HEAD_SIZE, dtype=torch.float16, device="cuda")
    keys = kernels.gather_blocks(key_cache, block_ids[None])[0]
    values = kernels.gather_blocks(value_cache, block_ids[None])[0]
    gather_s = seconds_per_call(lambda: (kernels.gather_blocks(key_cache, block_ids[None]),
                                         kernels.gather_blocks(value_cache, block_ids[None])))
    sdpa_s = seconds_per_call(lambda: prefill_attention(query, keys, values, HEAD_SIZE**-0.5))
    return dict(query_len=query_len, context_len=CONTEXT, gather_ms=gather_s * 1e3, sdpa_ms=sdpa_s * 1e3,
                gather_share=gather_s / (gather_s + sdpa_s))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 1
    started = time.monotonic()
    print(f"device: {torch.cuda.get_device_name()}")
    tests_passed = run_gpu_tests()
    print(f"tests/gpu: {'PASS' if tests_passed else 'FAIL'}")

    decode = decode_vs_floor(copy_bandwidth())
    print(f"\ndecode, batch {BATCH} x context {CONTEXT}, {NUM_HEADS} heads x {HEAD_SIZE}, fp16, block {BLOCK_SIZE}: "
          f"K/V {decode['kv_bytes'] / 1e9:.2f} GB, copy bandwidth {decode['copy_bandwidth_gbs']:.0f} GB/s")
    print("| kernel | ms | memory floor ms | of floor |\n|---|---|---|---|")
    for name, row in decode["kernels"].items():
        print(f"| {name} | {row['ms']:.3f} | {row['floor_ms']:.3f} | {row['of_floor']:.0%} |")
    decode_ok = decode["kernels"]["v1 (default)"]["of_floor"] >= FLOOR_TARGET
    print(f"decode at >= {FLOOR_TARGET:.0%} of the floor: {'PASS' if decode_ok else 'FAIL'}")

    prefill = prefill_gather_share()
    print(f"\nprefill {prefill['query_len']} tokens over {prefill['context_len']}: "
          f"gather {prefill['gather_ms']:.3f} ms, "
          f"SDPA {prefill['sdpa_ms']:.3f} ms, gather share {prefill['gather_share']:.0%}")
    print("\nW1 end to end vs transformers: PENDING - the CUDA model runner is not integrated yet "
          "(kernels/README.md, 'Not done yet')")
    print(f"\ngpu_check finished in {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(dict(tests_passed=tests_passed, decode=decode, prefill=prefill,
                                             end_to_end="pending"), indent=2))
    return 0 if tests_passed and decode_ok else 1


if __name__ == "__main__":
    sys.exit(main())
