"""GPU acceptance check for the CUDA kernels; needs torch, cupy and a CUDA device, not Ray.

    python benchmarks/gpu_check.py [--json results.json]

1. runs tests/gpu (every kernel against the torch reference; the CUDA model runner
   against transformers on the same device);
2. times paged_attention_decode (v1 and v2) at batch 256 x context 2048 with Llama-2-7B
   attention shapes (32 heads, head 128, fp16, block 16) against the memory floor:
   bytes of K/V read / measured device-to-device copy bandwidth (target: >= 70%);
3. times the prefill path's block gather against its SDPA call (the gather's share), the varlen
   paged prefill kernel (kernels/paged_prefill.cu) against gather + SDPA, SDPA on contiguous K/V, and a
   step of 4 mixed spans against the per-span loop, the LoRA kernels against their torch path, and the
   fused kernels of the model step (norms, SiLU-mul, rotary + cache write) against their torch
   references and their memory floor (target: >= 80%), and the W4A16 kernels (kernels/w4a16.cu) at
   Llama-2-7B's projections: the GEMV at 1/4/8 rows against its memory floor, dequantize + matmul and
   the fp16 matmul;
4. W1 end to end on a Llama-2-7B-shaped model with random fp16 weights (no download):
   closed-loop clients at each concurrency, prompts of 50-200 tokens, exactly 100 generated
   tokens each, through the engine's own loop (no HTTP: the serving packages are not needed),
   against transformers ``generate`` with static batches of the same size on the same GPU; also eager, without
   async scheduling, and (at the top level) with the paths that are off by default (``SWITCHES``) off.
Finishes in well under 8 minutes on one H200-class GPU. Each part is reported on its own: one that fails
records its traceback and the others still run, and --json is rewritten after every part, so a run cut short
keeps what it measured.

``--parts`` runs a subset (tests, kernels, w1), so the tests and the measurements can be separate calls.
``--host`` checks this script without a GPU: the kernels built for the CPU (raypaged.kernels.host), every part
at small shapes, W1 on a tiny model on CPU (tests/gpu/test_gpu_check_script.py runs it). Its numbers mean
nothing.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's raypaged, also where it is not installed (the GPU machine)

from raypaged import kernels  # noqa: E402
from raypaged.attention import torch_ops  # noqa: E402
from raypaged.attention.torch_ops import prefill_attention  # noqa: E402

BATCH, CONTEXT, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 256, 2048, 32, 128, 16
FLOOR_TARGET = 0.70
FUSED_FLOOR_TARGET = 0.80
DEVICE = "cuda"  # "cpu" with --host


def seconds_per_call(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    if DEVICE == "cpu":  # --host: once is enough to run the code
        start_s = time.perf_counter()
        fn()
        return time.perf_counter() - start_s
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def run_gpu_tests() -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "--soak", "-m", "gpu", "tests/gpu"]  # every case of each matrix
    return subprocess.run(cmd, cwd=ROOT, timeout=480).returncode == 0


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    num_bytes = num_bytes if DEVICE == "cuda" else 1 << 24
    """Device memory bandwidth in bytes/s as a large copy sees it (bytes read + written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * num_bytes / seconds_per_call(lambda: dst.copy_(src))


def decode_vs_floor(bandwidth: float) -> dict:
    num_blocks = BATCH * CONTEXT // BLOCK_SIZE
    shape = (num_blocks, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)  # [blocks, kv heads, block size, head dim]
    key_cache = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    value_cache = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    block_tables = torch.randperm(num_blocks, device=DEVICE).view(BATCH, CONTEXT // BLOCK_SIZE)
    context_lens = torch.full((BATCH,), CONTEXT, device=DEVICE)
    query = torch.randn(BATCH, NUM_HEADS, HEAD_SIZE, dtype=torch.float16, device=DEVICE)
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
    # the kernel's compile-time knobs, on the one instantiation used here; each checked against torch
    few = slice(0, 16)
    reference = torch_ops.paged_attention_decode(
        query[few], key_cache, value_cache, block_tables[few], context_lens[few], HEAD_SIZE**-0.5
    ).float()
    tuning = {}
    for unroll in (4, 8, 16):
        for min_blocks in (2, 4):
            defines = ("RP_TUNING_F16_128_ONLY", f"RP_ROWS_UNROLL={unroll}", f"RP_MIN_BLOCKS={min_blocks}")
            name = f"rows_unroll={unroll}, min_blocks={min_blocks}"
            try:
                out = kernels.paged_attention_decode(
                    query[few],
                    key_cache,
                    value_cache,
                    block_tables[few],
                    context_lens[few],
                    HEAD_SIZE**-0.5,
                    None,
                    defines,
                )
                error = ((out.float() - reference).abs().max() / reference.abs().max()).item()
                seconds = seconds_per_call(
                    lambda defines=defines: kernels.paged_attention_decode(
                        query, key_cache, value_cache, block_tables, context_lens, HEAD_SIZE**-0.5, None, defines
                    )
                )
                tuning[name] = dict(ms=seconds * 1e3, of_floor=floor_s / seconds, rel_error=error)
            except Exception as err:  # a variant that fails to build or run is reported, not fatal
                tuning[name] = dict(error=f"{type(err).__name__}: {err}")
    return dict(kv_bytes=kv_bytes, copy_bandwidth_gbs=bandwidth / 1e9, kernels=rows, tuning=tuning)


def prefill_gather_share(query_len: int = 512) -> dict:
    num_blocks = CONTEXT // BLOCK_SIZE
    shape = (4 * num_blocks, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)
    key_cache = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    value_cache = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    block_ids = torch.randperm(4 * num_blocks, device=DEVICE)[:num_blocks]
    query = torch.randn(query_len, NUM_HEADS, HEAD_SIZE, dtype=torch.float16, device=DEVICE)
    keys = kernels.gather_blocks(key_cache, block_ids[None])[0]
    values = kernels.gather_blocks(value_cache, block_ids[None])[0]
    gather_s = seconds_per_call(
        lambda: (kernels.gather_blocks(key_cache, block_ids[None]), kernels.gather_blocks(value_cache, block_ids[None]))
    )
    sdpa_s = seconds_per_call(lambda: prefill_attention(query, keys, values, HEAD_SIZE**-0.5))
    return dict(
        query_len=query_len,
        context_len=CONTEXT,
        gather_ms=gather_s * 1e3,
        sdpa_ms=sdpa_s * 1e3,
        gather_share=gather_s / (gather_s + sdpa_s),
    )


def varlen_prefill(query_len: int = 512) -> dict:
    """kernels/paged_prefill.cu, Llama-2-7B attention (32 heads x 128, fp16, block 16): ``query_len`` tokens
    over CONTEXT against (a) today's gather + SDPA (``kernels.paged_attention_prefill``) and (b) SDPA on K/V
    already contiguous (the goal: no slower); (c) a step of 4 spans of mixed lengths through
    ``AttentionBackend.forward``, one varlen call against the per-span loop (both write the step's K/V first;
    the packed per-step inputs are built once, outside the timing, as for a step's layers)."""
    import dataclasses

    from raypaged.attention.backend import cuda_backend
    from raypaged.attention.metadata import AttentionMetadata, PrefillSpan

    scale = HEAD_SIZE**-0.5
    num_blocks = 4 * CONTEXT // BLOCK_SIZE
    shape = (num_blocks, NUM_HEADS, BLOCK_SIZE, HEAD_SIZE)  # [blocks, kv heads, block size, head dim]
    key_cache = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    value_cache = torch.randn(shape, dtype=torch.float16, device=DEVICE)
    ids = torch.randperm(num_blocks, device=DEVICE)
    block_ids = ids[: CONTEXT // BLOCK_SIZE]
    query = torch.randn(query_len, NUM_HEADS, HEAD_SIZE, dtype=torch.float16, device=DEVICE)
    keys = kernels.gather_blocks(key_cache, block_ids[None])[0]
    values = kernels.gather_blocks(value_cache, block_ids[None])[0]
    cu = torch.tensor([0, query_len], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([CONTEXT], dtype=torch.int32, device=DEVICE)

    def varlen(tensor_cores=None):
        return kernels.paged_prefill_attention(
            query, key_cache, value_cache, cu, lens, block_ids[None], scale, query_len, tensor_cores=tensor_cores
        )

    reference = prefill_attention(query.float(), keys.float(), values.float(), scale)
    errors = {
        name: ((out.float() - reference).abs().max() / reference.abs().max()).item()
        for name, out in (("varlen", varlen()), ("varlen_fma", varlen(False)))
    }
    single = dict(
        varlen_ms=seconds_per_call(varlen) * 1e3,
        varlen_fma_ms=seconds_per_call(lambda: varlen(False), iters=3, warmup=1) * 1e3,
        gather_sdpa_ms=seconds_per_call(
            lambda: kernels.paged_attention_prefill(query, key_cache, value_cache, block_ids, CONTEXT, scale)
        )
        * 1e3,
        contiguous_sdpa_ms=seconds_per_call(lambda: prefill_attention(query, keys, values, scale)) * 1e3,
        rel_error=errors,
    )

    # (c): (query_len, context_len) per span: a chunk over a long context, two whole prompts, a short chunk
    spans = [(512, 2048), (300, 300), (64, 1000), (128, 128)] if DEVICE == "cuda" else [(64, 200), (30, 30), (8, 50)]
    prefills, start, used = [], 0, 0
    for q, c in spans:
        n = -(-c // BLOCK_SIZE)
        prefills.append(PrefillSpan(start, q, c, ids[used : used + n]))
        start, used = start + q, used + n
    slots = torch.cat(
        [
            p.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            for p in prefills
            for pos in [torch.arange(p.context_len - p.query_len, p.context_len, device=DEVICE)]
        ]
    )
    meta = AttentionMetadata(
        slots,
        0,
        torch.zeros((0, 1), dtype=torch.long, device=DEVICE),
        torch.zeros(0, dtype=torch.long, device=DEVICE),
        prefills,
    )
    step_q = torch.randn(start, NUM_HEADS, HEAD_SIZE, dtype=torch.float16, device=DEVICE)
    step_k, step_v = torch.randn_like(step_q), torch.randn_like(step_q)
    one_call = cuda_backend()
    per_span = dataclasses.replace(one_call, varlen_prefill=None)
    outs = [
        backend.forward(step_q, step_k, step_v, key_cache, value_cache, meta, scale) for backend in (one_call, per_span)
    ]
    step = dict(
        spans=spans,
        varlen_ms=seconds_per_call(
            lambda: one_call.forward(step_q, step_k, step_v, key_cache, value_cache, meta, scale)
        )
        * 1e3,
        per_span_ms=seconds_per_call(
            lambda: per_span.forward(step_q, step_k, step_v, key_cache, value_cache, meta, scale)
        )
        * 1e3,
        rel_difference=((outs[0].float() - outs[1].float()).abs().max() / outs[1].float().abs().max()).item(),
    )
    return dict(query_len=query_len, context_len=CONTEXT, single_span=single, mixed_step=step)


def lora_kernels(num_tokens: int = 256, num_slots: int = 4, rank: int = 16, hidden: int = 4096) -> dict:
    """kernels/lora_bgmv.cu against the torch path of raypaged.lora.ops (gathered bmm or matmuls per
    slot) on one 4096 x 4096 projection, fp16, tokens spread evenly over the slots."""
    from raypaged.kernels.lora_ops import lora_bgmv_expand, lora_bgmv_shrink
    from raypaged.lora.ops import add_lora, build_lora_mapping

    token_slots = [i % num_slots for i in range(num_tokens)]
    x = torch.randn(num_tokens, hidden, dtype=torch.float16, device=DEVICE)
    lora_a = (torch.randn(num_slots, hidden, rank, device=DEVICE) / hidden**0.5).half()
    lora_b = torch.randn(num_slots, rank, hidden, dtype=torch.float16, device=DEVICE)
    y = torch.zeros(num_tokens, hidden, dtype=torch.float16, device=DEVICE)
    mapping = build_lora_mapping(token_slots, DEVICE)
    token_ids = torch.arange(num_tokens, device=DEVICE)
    slot_of = torch.tensor(token_slots, device=DEVICE)
    torch_s = seconds_per_call(lambda: add_lora(y, x, lora_a, lora_b, mapping), iters=50)
    kernel_s = seconds_per_call(
        lambda: lora_bgmv_expand(y, lora_bgmv_shrink(x, lora_a, token_ids, slot_of), lora_b, token_ids, slot_of),
        iters=50,
    )
    weight_bytes = 2 * num_tokens * rank * hidden * 2  # A and B rows read per token, fp16
    return dict(
        num_tokens=num_tokens,
        num_slots=num_slots,
        rank=rank,
        hidden=hidden,
        torch_ms=torch_s * 1e3,
        kernel_ms=kernel_s * 1e3,
        kernel_over_torch=torch_s / kernel_s,
        weight_bytes=weight_bytes,
    )


def fused_kernels_vs_floor(bandwidth: float, tokens: int = 8192) -> dict:
    """kernels/fused_ops.cu against the torch path it replaces (raypaged.model.layers, and for
    rotary its rotate_ plus the reshape_and_cache kernel) at Llama-2-7B shapes, fp16, a
    ``tokens``-token prefill: each one's time, its memory floor (bytes it must read and write /
    the measured copy bandwidth) and its largest deviation from the torch path (relative to
    the largest value). Each kernel runs ~0.1 ms; the whole function a second or two."""
    from transformers import LlamaConfig

    from raypaged.model import layers

    hidden, d, heads, head_dim, block_size, dtype = 4096, 11008, 32, 128, 16, torch.float16
    size = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn(tokens, hidden, dtype=dtype, device=DEVICE)
    weight = torch.rand(hidden, dtype=dtype, device=DEVICE) + 0.5
    gate_up = torch.randn(tokens, 2 * d, dtype=dtype, device=DEVICE)
    qkv = torch.randn(tokens, 3 * heads, head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, rope_theta=10000.0)
    rotary = layers.RotaryEmbedding(config, head_dim, 4096).to(device=DEVICE, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    cache_shape = (tokens // block_size, heads, block_size, head_dim)
    key_cache = torch.empty(cache_shape, dtype=dtype, device=DEVICE)
    value_cache = torch.empty_like(key_cache)
    slots = torch.randperm(tokens, device=DEVICE)

    def deviation(out, expected) -> float:
        return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()

    def add_norm(fn):  # on copies, so the checked result is one application's
        a, b = x.clone(), residual.clone()
        fn(a, b)
        return a, b

    def torch_add_norm(a, b):
        normed, summed = layers.add_rms_norm(a, b, weight, 1e-6)
        b.copy_(summed)
        a.copy_(normed)

    def rotate_and_cache(fn):
        buffer, caches = qkv.clone(), (torch.zeros_like(key_cache), torch.zeros_like(value_cache))
        fn(buffer[:, :heads], buffer[:, heads : 2 * heads], buffer[:, 2 * heads :], *caches)
        return buffer, caches[0]

    def torch_rotary(q_, k_, v_, kc, vc):
        rotary.rotate_(positions, q_, k_)
        kernels.reshape_and_cache(k_, v_, kc, vc, slots)

    def fused_rotary(q_, k_, v_, kc, vc):
        kernels.rotary_and_cache(positions, q_, k_, v_, rotary.cos_sin, kc, vc, slots)

    rotary_bytes = tokens * ((2 * heads + 5 * heads) * head_dim + head_dim) * size  # q, k rw; v r; k, v cached; cos/sin
    cases = {
        "rms_norm": (
            lambda: kernels.rms_norm(x, weight, 1e-6),
            lambda: layers.rms_norm(x, weight, 1e-6),
            2 * tokens * hidden * size,
            lambda: deviation(kernels.rms_norm(x, weight, 1e-6), layers.rms_norm(x, weight, 1e-6)),
        ),
        "fused_add_rms_norm": (
            lambda: kernels.fused_add_rms_norm(x, residual, weight, 1e-6),
            lambda: layers.add_rms_norm(x, residual, weight, 1e-6),
            4 * tokens * hidden * size,
            lambda: max(
                deviation(f, t)
                for f, t in zip(
                    add_norm(lambda a, b: kernels.fused_add_rms_norm(a, b, weight, 1e-6)), add_norm(torch_add_norm)
                )
            ),
        ),
        "silu_and_mul": (
            lambda: kernels.silu_and_mul(gate_up),
            lambda: layers.silu_and_mul(gate_up),
            3 * tokens * d * size,
            lambda: deviation(kernels.silu_and_mul(gate_up), layers.silu_and_mul(gate_up)),
        ),
        "rotary_and_cache": (
            lambda: fused_rotary(q, k, v, key_cache, value_cache),
            lambda: torch_rotary(q, k, v, key_cache, value_cache),
            rotary_bytes,
            lambda: max(
                deviation(f, t) for f, t in zip(rotate_and_cache(fused_rotary), rotate_and_cache(torch_rotary))
            ),
        ),
    }
    rows = {}
    for name, (kernel, reference, num_bytes, check) in cases.items():
        try:
            error = check()
            kernel_s = seconds_per_call(kernel, iters=20)
            torch_s = seconds_per_call(reference, iters=20)
            floor_s = num_bytes / bandwidth
            rows[name] = dict(
                bytes=num_bytes,
                ms=kernel_s * 1e3,
                torch_ms=torch_s * 1e3,
                floor_ms=floor_s * 1e3,
                of_floor=floor_s / kernel_s,
                over_torch=torch_s / kernel_s,
                rel_error=error,
                meets_target=floor_s / kernel_s >= FUSED_FLOOR_TARGET,
            )
        except Exception as err:  # one failing kernel is reported, not fatal
            rows[name] = dict(error=f"{type(err).__name__}: {err}")
    print(
        f"\nfused kernels, {tokens} tokens, Llama-2-7B shapes, fp16 (floor: bytes / copy bandwidth; "
        f"target >= {FUSED_FLOOR_TARGET:.0%}):\n"
        "| kernel | ms | torch ms | floor ms | of floor | vs torch | rel. error |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | {row['error']} | | | | | |")
        else:
            print(
                f"| {name} | {row['ms']:.3f} | {row['torch_ms']:.3f} | {row['floor_ms']:.3f} | {row['of_floor']:.0%} "
                f"| {row['over_torch']:.2f}x | {row['rel_error']:.1e} |"
            )
    return dict(tokens=tokens, hidden=hidden, intermediate=d, heads=heads, head_dim=head_dim, kernels=rows)


W4A16_SHAPES = {  # Llama-2-7B's projections: (in, out)
    "qkv 4096->12288": (4096, 12288),
    "o 4096->4096": (4096, 4096),
    "gate|up 4096->22016": (4096, 22016),
    "down 11008->4096": (11008, 4096),
}
W4A16_ROWS = (1, 4, 8, 512)


def w4a16_vs_floor(bandwidth: float, group_size: int = 128) -> dict:
    """kernels/w4a16.cu (raypaged.kernels.quant_ops) at Llama-2-7B's projections, fp16, groups of 128, random
    4-bit weights with fp16 scales (as GPTQ stores them): the GEMV at 1, 4 and 8 rows against its memory floor
    (packed weight + scales + zeros bytes / the measured copy bandwidth), against dequantize + torch.matmul (what
    more than 8 rows run) and torch.matmul with the fp16 weight; at 512 rows dequantize + matmul against the fp16
    matmul. Errors are relative to the largest value of x @ W^T in fp32 with the exact weight. About a second."""
    layers = {}
    for name, (k, n) in W4A16_SHAPES.items():
        try:
            layers[name] = w4a16_layer(k, n, group_size, bandwidth)
        except Exception as err:  # one failing shape is reported, not fatal
            layers[name] = dict(error=f"{type(err).__name__}: {err}")
    print(
        f"\nW4A16, Llama-2-7B projections, fp16, groups of {group_size} (floor: packed bytes / copy bandwidth):\n"
        "| layer | rows | GEMV us | floor us | of floor | dequant+matmul us | fp16 matmul us | rel. error |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for name, row in layers.items():
        if "error" in row:
            print(f"| {name} | {row['error']} | | | | | | |")
            continue
        for rows in W4A16_ROWS:
            e = row[f"m{rows}"]
            gemv = f"{e['gemv_us']:.1f} | {row['floor_us']:.1f} | {e['of_floor']:.0%}" if "gemv_us" in e else "| |"
            print(
                f"| {name} | {rows} | {gemv} | {e['dequant_matmul_us']:.1f} | {e['fp16_matmul_us']:.1f} "
                f"| {e['rel_error']:.1e} |"
            )
    return dict(group_size=group_size, dtype="float16", layers=layers)


def w4a16_layer(k: int, n: int, group_size: int, bandwidth: float) -> dict:
    """One projection of :func:`w4a16_vs_floor`: its packed bytes, floor and, per row count, the timings."""
    from raypaged.kernels.quant_ops import GEMV_MAX_ROWS, build_w4a16, w4a16_dequantize, w4a16_gemv, w4a16_linear

    gen = torch.Generator(device=DEVICE).manual_seed(k + n)
    groups = k // group_size
    weight = build_w4a16(
        torch.randint(0, 16, (k, n), dtype=torch.uint8, device=DEVICE, generator=gen),
        torch.randint(0, 16, (groups, n), device=DEVICE, generator=gen),
        (torch.rand(groups, n, device=DEVICE, generator=gen) * 0.02 + 0.002).half().float(),
        torch.arange(k, device=DEVICE) // group_size,
    )
    exact = w4a16_dequantize(weight, torch.float32)  # [K, N]
    dense = exact.half()
    packed_bytes = sum(t.numel() * t.element_size() for t in (weight.qweight, weight.scales, weight.zeros))
    floor_s = packed_bytes / bandwidth
    row: dict = dict(packed_bytes=packed_bytes, floor_us=floor_s * 1e6)

    def dequantize_and_multiply(x: torch.Tensor) -> torch.Tensor:  # what more than GEMV_MAX_ROWS rows run
        return torch.matmul(x, w4a16_dequantize(weight, x.dtype))

    for rows in W4A16_ROWS:
        x = torch.randn(rows, k, device=DEVICE).half()
        reference = x.float() @ exact
        dequant_matmul_s = seconds_per_call(functools.partial(dequantize_and_multiply, x), iters=20)
        fp16_s = seconds_per_call(functools.partial(torch.matmul, x, dense), iters=20)
        error = (w4a16_linear(x, weight).float() - reference).abs().max() / reference.abs().max()
        entry = dict(dequant_matmul_us=dequant_matmul_s * 1e6, fp16_matmul_us=fp16_s * 1e6, rel_error=error.item())
        if rows <= GEMV_MAX_ROWS:
            gemv_s = seconds_per_call(functools.partial(w4a16_gemv, x, weight), iters=50)
            entry.update(
                gemv_us=gemv_s * 1e6,
                of_floor=floor_s / gemv_s,
                over_dequant_matmul=dequant_matmul_s / gemv_s,
                over_fp16_matmul=fp16_s / gemv_s,
            )
        row[f"m{rows}"] = entry
    return row


def w1_workload(num_requests: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(50, 200))] for _ in range(num_requests)]


def raypaged_w1(
    model_dir: Path,
    concurrencies: list[int],
    requests_per_level,
    enforce_eager: bool,
    device: str = "cuda",
    async_scheduling: bool | None = None,
) -> dict:
    """Generated tokens/s of the engine, closed loop: a finished request is replaced at once.
    ``async_scheduling`` None: the engine's default (on on CUDA)."""
    from raypaged import LLM, SamplingParams

    started = time.monotonic()
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        dtype="float16" if device == "cuda" else "float32",
        device=device,
        gpu_memory_utilization=0.5,
        max_model_len=4096,
        enforce_eager=enforce_eager,
        kv_cache_space=None if device == "cuda" else 0.5,
        async_scheduling=async_scheduling,
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    engine = llm.llm_engine
    stats = engine.stats()
    result: dict = dict(
        startup_s=time.monotonic() - started,
        kv_blocks=stats["num_gpu_blocks_total"],
        levels={},
        async_scheduling=engine.config.resolved_async_scheduling,
    )
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    vocab = engine.config.hf_config.vocab_size
    warm = w1_workload(8, vocab, seed=99)
    for ids in warm:
        engine.add_request(None, params, prompt_token_ids=ids)
    engine.step()  # the prefill; then profile a few decode steps of the 8 requests
    result["decode_step_profile"] = profile_decode_steps(engine, 20, device)
    while engine.has_unfinished_requests():
        engine.step()
    worker = getattr(engine.executor, "worker", None)  # the in-process worker (tp = 1)
    pieces = worker.runner.piecewise if worker is not None else None  # None: $RAYPAGED_PIECEWISE_GRAPHS off
    for concurrency in concurrencies:
        replays_before = pieces.replays if pieces is not None else 0
        prompts = w1_workload(requests_per_level(concurrency), vocab, seed=concurrency)
        pending = list(prompts)
        in_flight: dict[str, float] = {}
        latencies: list[float] = []
        generated = 0
        sync()
        t0 = time.perf_counter()
        steps = 0
        while pending or in_flight:
            while pending and len(in_flight) < concurrency:
                request_id = engine.add_request(None, params, prompt_token_ids=pending.pop())
                in_flight[request_id] = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    latencies.append(time.perf_counter() - in_flight.pop(out.request_id))
                    generated += len(out.outputs[0].token_ids)
            steps += 1
        elapsed = time.perf_counter() - t0
        latencies.sort()
        result["levels"][concurrency] = dict(
            requests=len(prompts),
            generated_tokens=generated,
            seconds=elapsed,
            tokens_per_s=generated / elapsed,
            steps=steps,
            ms_per_step=1e3 * elapsed / steps,
            p50_latency_s=latencies[len(latencies) // 2],
            p99_latency_s=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            piecewise_steps=pieces.replays - replays_before if pieces is not None else None,
        )
        mode = f"{'eager' if enforce_eager else 'CUDA graphs'}, async scheduling {result['async_scheduling']}"
        piecewise = f", {pieces.replays - replays_before} mixed steps on piecewise graphs" if pieces is not None else ""
        print(
            f"  raypaged ({mode}) concurrency {concurrency}: "
            f"{generated / elapsed:,.0f} tok/s, {1e3 * elapsed / steps:.1f} ms/step over {steps} steps{piecewise}",
            flush=True,
        )
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / (1 << 30) if device == "cuda" else None
    result["preemptions"] = engine.stats()["num_preemptions"]
    del llm, engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def profile_decode_steps(engine, steps: int, device: str) -> str:
    """Where the time of a decode step goes, host and device: torch profiler, top ops by host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    wall_ms = 1e3 * (time.perf_counter() - start) / steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60)
    print(f"  decode step at batch 8, profiled: {wall_ms:.1f} ms/step (profiler on)\n{table}", flush=True)
    return table


def transformers_w1(model_dir: Path, concurrencies: list[int], requests_per_level, device: str = "cuda") -> dict:
    """transformers ``generate`` on static batches of ``concurrency`` requests (left padding)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16 if device == "cuda" else None).eval()
    result: dict = {}
    for concurrency in concurrencies:
        prompts = w1_workload(requests_per_level(concurrency), config.vocab_size, seed=concurrency)
        generated = 0
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for start in range(0, len(prompts), concurrency):
            batch = prompts[start : start + concurrency]
            width = max(map(len, batch))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=100,
                    min_new_tokens=100,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            generated += (out.shape[1] - width) * len(batch)
        elapsed = time.perf_counter() - t0
        result[concurrency] = dict(generated_tokens=generated, seconds=elapsed, tokens_per_s=generated / elapsed)
        print(f"  transformers static batches of {concurrency}: {generated / elapsed:,.0f} tok/s", flush=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


HOST_MODEL = dict(  # --host: a tiny Llama for W1 on CPU
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def end_to_end(concurrencies: list[int]) -> dict:
    from raypaged.model.synthetic import write_synthetic_model

    def requests_per_level(concurrency: int) -> int:
        return 4 * concurrency  # so steady state dominates, not the first wave

    with tempfile.TemporaryDirectory() as tmp:
        shape = HOST_MODEL if DEVICE == "cpu" else {}
        model_dir = write_synthetic_model(Path(tmp) / "llama2-7b-shape", **shape)
        out = dict(
            model="Llama-2-7B shape, random fp16 weights" if DEVICE == "cuda" else "a tiny Llama on CPU (--host)",
            concurrencies=concurrencies,
            requests_per_level="4 x concurrency",
        )
        for key, fn in (
            ("raypaged", lambda: raypaged_w1(model_dir, concurrencies, requests_per_level, False, DEVICE)),
            ("raypaged_eager", lambda: raypaged_w1(model_dir, concurrencies[-1:], requests_per_level, True, DEVICE)),
            (
                "raypaged_no_async",
                lambda: raypaged_w1(model_dir, concurrencies, requests_per_level, False, DEVICE, False),
            ),
            (  # the paths still off by default, off: what turning them on by default would gain
                "raypaged_switches_off",
                lambda: switches_off(raypaged_w1, model_dir, concurrencies[-1:], requests_per_level, False, DEVICE),
            ),
            ("transformers", lambda: transformers_w1(model_dir, concurrencies, requests_per_level, DEVICE)),
        ):
            try:
                out[key] = fn()
            except Exception:  # one failing system must not hide the others' numbers
                out[key] = dict(error=traceback.format_exc())
                print(out[key]["error"], flush=True)
                gc.collect()
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    return out


PARTS = ("tests", "kernels", "w1")  # tests/gpu; the kernels' timings; W1 end to end
SWITCHES = (  # off by default until verified here
    "RAYPAGED_FUSED_KERNELS",
    "RAYPAGED_VARLEN_PREFILL",
    "RAYPAGED_PIECEWISE_GRAPHS",
    "RAYPAGED_LORA_KERNELS",
    "RAYPAGED_W4A16_KERNELS",
    "RAYPAGED_FP8_KV_KERNELS",
    "RAYPAGED_BLOCK_FP8_SCALED_MM",
    "RAYPAGED_TP_CUDA_GRAPHS",  # its test needs two GPUs: skipped on one
)


def switches_off(fn, *args):
    """``fn(*args)`` with every ``SWITCHES`` path off (as by default), then back as they were."""
    before = {name: os.environ.get(name) for name in SWITCHES}
    os.environ.update({name: "0" for name in SWITCHES})
    try:
        return fn(*args)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def use_host() -> None:
    """--host: the kernels built for the CPU and small shapes everywhere (a check of this script)."""
    global DEVICE, BATCH, CONTEXT, NUM_HEADS, W4A16_SHAPES, W4A16_ROWS
    from raypaged.kernels import host

    host.set_enabled(True)
    DEVICE = "cpu"
    BATCH, CONTEXT, NUM_HEADS = 2, 256, 2
    W4A16_SHAPES = {"o 256->256": (256, 256)}
    W4A16_ROWS = (1, 9)


def report_decode(decode: dict) -> dict:
    print(
        f"\ndecode, batch {BATCH} x context {CONTEXT}, {NUM_HEADS} heads x {HEAD_SIZE}, fp16, block {BLOCK_SIZE}: "
        f"K/V {decode['kv_bytes'] / 1e9:.2f} GB, copy bandwidth {decode['copy_bandwidth_gbs']:.0f} GB/s"
    )
    print("| kernel | ms | memory floor ms | of floor |\n|---|---|---|---|")
    for name, row in decode["kernels"].items():
        print(f"| {name} | {row['ms']:.3f} | {row['floor_ms']:.3f} | {row['of_floor']:.0%} |")
    print(
        "\ncompile-time knobs (f16, head 128, v1 as chosen for this batch):\n| knobs | ms | of floor | rel. error |\n"
        "|---|---|---|---|"
    )
    for name, row in decode["tuning"].items():
        if "error" in row:
            print(f"| {name} | {row['error']} | | |")
        else:
            print(f"| {name} | {row['ms']:.3f} | {row['of_floor']:.0%} | {row['rel_error']:.1e} |")
    decode["meets_target"] = decode["kernels"]["v1 (default)"]["of_floor"] >= FLOOR_TARGET
    print(f"decode at >= {FLOOR_TARGET:.0%} of the floor: {'PASS' if decode['meets_target'] else 'FAIL'}")
    return decode


def report_prefill(prefill: dict) -> dict:
    print(
        f"\nprefill {prefill['query_len']} tokens over {prefill['context_len']}: "
        f"gather {prefill['gather_ms']:.3f} ms, "
        f"SDPA {prefill['sdpa_ms']:.3f} ms, gather share {prefill['gather_share']:.0%}"
    )
    return prefill


def report_varlen(varlen: dict) -> dict:
    one, mixed = varlen["single_span"], varlen["mixed_step"]
    print(
        f"varlen prefill kernel, same shape: {one['varlen_ms']:.3f} ms (fp32-FMA kernel {one['varlen_fma_ms']:.3f}) "
        f"against gather + SDPA {one['gather_sdpa_ms']:.3f} ms and SDPA on contiguous K/V "
        f"{one['contiguous_sdpa_ms']:.3f} ms; rel. error {one['rel_error']}\n"
        f"  a step of spans {mixed['spans']}: one call {mixed['varlen_ms']:.3f} ms, per-span loop "
        f"{mixed['per_span_ms']:.3f} ms (rel. difference {mixed['rel_difference']:.1e})"
    )
    return varlen


def report_lora(lora: dict) -> dict:
    print(
        f"\nLoRA product, {lora['num_tokens']} tokens over {lora['num_slots']} slots, rank {lora['rank']}, "
        f"{lora['hidden']} x {lora['hidden']} fp16: torch path {lora['torch_ms']:.3f} ms, lora_bgmv "
        f"{lora['kernel_ms']:.3f} ms ({lora['kernel_over_torch']:.2f}x)"
    )
    return lora


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--concurrency", default="10,30,50,80", help="W1 concurrency levels")
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu first (--parts kernels,w1)")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"what to run, in this order, a comma-separated subset of {', '.join(PARTS)} (a device's minutes are few: "
        "run the measurements and the tests as separate calls if one would not fit)",
    )
    parser.add_argument("--host", action="store_true", help="check this script without a GPU (small shapes, CPU)")
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("raypaged").setLevel(logging.INFO)  # KV sizing and CUDA graph capture lines
    if args.host:
        use_host()
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (--host checks this script on the CPU)")
        return 1
    started = time.monotonic()
    print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'the host CPU (--host)'}")
    for name in SWITCHES:
        os.environ.setdefault(name, "1")
        print(f"{name}={os.environ[name]}")
    results: dict = {}

    def part(name: str, fn):
        """Run one part; a failure is recorded with its traceback, and the JSON rewritten either way."""
        try:
            results[name] = fn()
        except Exception:
            results[name] = dict(error=traceback.format_exc())
            print(f"\n{name}: FAILED\n{results[name]['error']}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
        return results[name]

    parts = [p for p in args.parts.split(",") if p and not (args.skip_tests and p == "tests")]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(unknown))} (choose from {', '.join(PARTS)})")
    tests_passed = part("tests_passed", run_gpu_tests) if "tests" in parts else None
    print(f"tests/gpu: {'not run' if tests_passed is None else 'PASS' if tests_passed is True else 'FAIL'}", flush=True)
    if "kernels" in parts or "w1" in parts:
        measure(part, [p for p in parts if p != "tests"], [int(c) for c in args.concurrency.split(",")])
    print(f"\ngpu_check finished in {time.monotonic() - started:.0f} s")
    failed = [name for name, value in results.items() if isinstance(value, dict) and "error" in value]
    e2e = results.get("end_to_end", {})
    failed += [f"end_to_end.{key}" for key, value in e2e.items() if isinstance(value, dict) and "error" in value]
    if failed:
        print(f"failed: {', '.join(failed)}")
    decode_ok = "decode" not in results or results["decode"].get("meets_target", False) or DEVICE == "cpu"
    return 0 if tests_passed is not False and decode_ok and not failed else 1


def measure(part, parts: list[str], concurrencies: list[int]) -> None:
    """The kernels' timings against their floors and references, and W1 end to end at ``concurrencies``
    (``parts``)."""
    bandwidth = part("copy_bandwidth", copy_bandwidth)
    small = DEVICE == "cpu"  # --host: small shapes
    if "kernels" in parts and not isinstance(bandwidth, dict):  # a dict: failed, so there are no floors
        part("decode", lambda: report_decode(decode_vs_floor(bandwidth)))
        part("prefill", lambda: report_prefill(prefill_gather_share(64 if small else 512)))
        part("varlen_prefill", lambda: report_varlen(varlen_prefill(64 if small else 512)))
        part("lora", lambda: report_lora(lora_kernels(hidden=256) if small else lora_kernels()))
        part("fused", lambda: fused_kernels_vs_floor(bandwidth, tokens=64 if small else 8192))
        part("w4a16", lambda: w4a16_vs_floor(bandwidth))
    if "w1" in parts:
        print(f"\nW1 end to end, {'a tiny Llama on CPU' if small else 'Llama-2-7B shape, random fp16 weights'}:")
        e2e = part("end_to_end", lambda: end_to_end(concurrencies))
        try:  # the numbers are in the JSON already
            print_w1_table(e2e)
        except Exception:
            traceback.print_exc()


def print_w1_table(e2e: dict) -> None:
    ours, theirs = e2e.get("raypaged", {}), e2e.get("transformers", {})
    if "levels" not in ours or "error" in theirs:
        print("W1: a system failed (see above)")
        return
    print("| concurrency | raypaged tok/s | ms/step | p50 / p99 latency s | transformers static tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for concurrency, row in ours["levels"].items():
        peer = theirs[concurrency]["tokens_per_s"]
        print(
            f"| {concurrency} | {row['tokens_per_s']:,.0f} | {row['ms_per_step']:.1f} | "
            f"{row['p50_latency_s']:.2f} / {row['p99_latency_s']:.2f} | {peer:,.0f} | "
            f"{row['tokens_per_s'] / peer:.2f}x |"
        )
    peak = ours["peak_memory_gib"]  # None on CPU
    print(
        f"startup {ours['startup_s']:.0f} s, {ours['kv_blocks']} KV blocks, "
        f"peak {'-' if peak is None else f'{peak:.1f}'} GiB, preemptions {ours['preemptions']}"
    )
    for label, key in (
        ("the switches on / off (the default)", "raypaged_switches_off"),
        ("async scheduling on / off", "raypaged_no_async"),
    ):
        other = e2e.get(key, {}).get("levels")
        if other:  # ours over the other run, at the levels both ran
            rate = {c: ours["levels"][c]["tokens_per_s"] / row["tokens_per_s"] for c, row in other.items()}
            print(f"{label}: " + ", ".join(f"{c}: {r:.2f}x" for c, r in rate.items()))


if __name__ == "__main__":
    sys.exit(main())
