"""Torch references of raypaged.kernels.fused_ops (built from raypaged.model.layers, the model's CPU
path) and a few model steps to run the plain and the fused model paths on, side by side."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers import LlamaConfig, Qwen3Config

from raypaged.attention import torch_ops
from raypaged.attention.backend import TORCH, AttentionBackend, FusedOps
from raypaged.attention.metadata import AttentionMetadata, PrefillSpan
from raypaged.model.layers import add_rms_norm, apply_rotary_, rms_norm, silu_and_mul
from raypaged.model.llama import LlamaForCausalLM

__all__ = [
    "BLOCK_SIZE",
    "REFERENCE_OPS",
    "counting",
    "fused_add_rms_norm",
    "fused_torch_backend",
    "random_model",
    "rms_norm",
    "rotary_and_cache",
    "run_steps",
    "silu_and_mul",
    "tiny_config",
]  # rms_norm, silu_and_mul: layers' own functions


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """``layers.add_rms_norm`` with its two results put where the kernel puts them."""
    normed, summed = add_rms_norm(x, residual, weight, eps)  # the sum is written into x
    residual.copy_(summed)
    x.copy_(normed)


def rotary_and_cache(positions, query, key, value, cos_sin, key_cache, value_cache, slot_mapping) -> None:
    """``RotaryEmbedding.rotate_(positions, query, key)`` then ``reshape_and_cache``."""
    table = cos_sin[positions]
    cos, sin = table[:, None, None, 0], table[:, None, None, 1]
    apply_rotary_(query, cos, sin)
    apply_rotary_(key, cos, sin)
    torch_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


REFERENCE_OPS = FusedOps(rms_norm, fused_add_rms_norm, silu_and_mul, rotary_and_cache)


def fused_torch_backend(ops: FusedOps = REFERENCE_OPS) -> AttentionBackend:
    """The torch attention bringing ``ops`` (by default the fused ops' torch references): the model
    takes its fused path."""
    return dataclasses.replace(TORCH, fused_ops=ops)


def counting(ops: FusedOps, calls: dict[str, int]) -> FusedOps:
    """``ops`` with each call counted in ``calls`` (by op name)."""

    def counted(name):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return getattr(ops, name)(*args, **kwargs)

        return call

    return FusedOps(*(counted(field.name) for field in dataclasses.fields(FusedOps)))


# --- a tiny model and four steps: two fresh prompts, a chunk over its cached context, decodes ----------

BLOCK_SIZE, NUM_BLOCKS = 8, 10
BLOCK_IDS = {"a": [5, 2], "b": [0, 7]}
PROMPT_LENGTHS = {"a": 12, "b": 9}
# per step: (sequence, first position, tokens), decodes first as the runner orders them
STEPS = [
    [("a", 0, 9), ("b", 0, 6)],
    [("b", 6, 1), ("a", 9, 3)],  # a's chunk attends over its 9 cached tokens
    [("a", 12, 1), ("b", 7, 1)],
    [("a", 13, 1), ("b", 8, 1)],  # b's first token of its second block
]


def tiny_config(architecture: str):
    """Head size 64 (the CUDA decode kernel's smallest), GQA 2:1 (Llama) and 4:1 (Qwen3), an
    intermediate size that is no power of two."""
    shape = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=352,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    if architecture == "qwen3":  # per-head q/k norms; head_dim 64 over a hidden size of 256 (q is 512 wide)
        return Qwen3Config(head_dim=64, num_attention_heads=8, num_key_value_heads=2, **shape)
    return LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **shape)


def random_model(config, dtype: torch.dtype, device: str, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, config.max_position_embeddings)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.08)
    return model.to(device=device, dtype=dtype).eval()


def _step_meta(step, device: str) -> tuple[torch.Tensor, AttentionMetadata]:
    positions, slots, decodes, prefills, start = [], [], [], [], 0
    for seq, first, count in step:
        blocks = BLOCK_IDS[seq]
        span = list(range(first, first + count))
        positions += span
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
        if count == 1:
            decodes.append((blocks, first + 1))
        else:
            prefills.append(PrefillSpan(start, count, first + count, torch.tensor(blocks, device=device)))
        start += count
    width = max((len(b) for b, _ in decodes), default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        num_decode_tokens=len(decodes),
        decode_block_tables=torch.tensor(
            [b + [0] * (width - len(b)) for b, _ in decodes], dtype=torch.long, device=device
        ).view(len(decodes), width),
        decode_context_lens=torch.tensor([n for _, n in decodes], dtype=torch.long, device=device),
        prefills=prefills,
    )
    return torch.tensor(positions, device=device), meta


def run_steps(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    device: str,
    plain: bool = False,
    before_step: Callable[[int], None] | None = None,
    cache_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], list]:
    """Each step's hidden states and the caches after the last, through ``backend``; ``plain``: on the
    plain path whatever fused ops the backend brings (its attention alone); ``before_step(i)`` is called
    before step ``i``; ``cache_dtype``: the caches' (the model's by default)."""
    model.set_attention_backend(dataclasses.replace(backend, fused_ops=None) if plain else backend)
    dtype = cache_dtype or model.model.norm.weight.dtype
    attn = model.model.layers[0].self_attn
    shape = (NUM_BLOCKS, attn.num_kv_heads, BLOCK_SIZE, attn.head_dim)
    caches = [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in model.model.layers
    ]
    generator = torch.Generator().manual_seed(1)
    hidden = []
    with torch.inference_mode():
        for index, step in enumerate(STEPS):
            if before_step is not None:
                before_step(index)
            positions, meta = _step_meta(step, device)
            ids = torch.randint(0, model.config.vocab_size, positions.shape, generator=generator).to(device)
            hidden.append(model(ids, positions, caches, meta).clone())
    return hidden, caches


def assert_same_steps(got: tuple[list[torch.Tensor], list], expected: tuple[list[torch.Tensor], list]) -> None:
    """Two ``run_steps`` results bit for bit: every step's hidden states, and the caches (written: not all zero)."""
    (hidden, caches), (expected_hidden, expected_caches) = got, expected
    for step, expected_step in zip(hidden, expected_hidden, strict=True):
        assert torch.equal(step, expected_step)
    for (k, v), (expected_k, expected_v) in zip(caches, expected_caches, strict=True):
        assert k.abs().sum() > 0 and torch.equal(k, expected_k) and torch.equal(v, expected_v)


def run_steps_layer_by_layer(monkeypatch, model: LlamaForCausalLM, backend: AttentionBackend, **options):
    """``run_steps`` with the one-call step (raypaged.model.cpu_step) turned off: the layers' own path"""
    from raypaged.model import cpu_step

    with monkeypatch.context() as m:
        m.setattr(cpu_step.CpuStep, "build", staticmethod(lambda model: None))
        return run_steps(model, backend, "cpu", **options)
