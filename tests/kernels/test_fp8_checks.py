"""The kernel wrappers with an fp8 e4m3 KV cache (``torch.float8_e4m3fn``), on CPU: what they accept and the exact
errors for what they do not, before cupy or a device is touched; and, with the device parts stubbed out, which
kernel each launches with which arguments (the kernels themselves run in tests/gpu/test_fp8_kv_kernels.py)."""

import functools

import numpy as np
import pytest
import torch

from raypaged.kernels import (
    copy_blocks,
    gather_blocks,
    loader,
    ops,
    paged_attention_decode,
    paged_attention_prefill,
    paged_prefill_attention,
    prefill_ops,
    reshape_and_cache,
)
from tests.kernels import wrapper_args
from tests.kernels.wrapper_args import BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, rows

FP8 = torch.float8_e4m3fn


def cache(dtype=FP8, **shape):
    return wrapper_args.cache(dtype, **shape)


reshape_args = functools.partial(wrapper_args.reshape_args, FP8)
decode_args = functools.partial(wrapper_args.decode_args, FP8)
prefill_args = functools.partial(wrapper_args.prefill_args, FP8)


CACHE_DTYPE_ERRORS = [
    (
        dict(key_cache=cache(torch.uint8), value_cache=cache(torch.uint8)),
        r"^key_cache has dtype torch.uint8: an fp8 e4m3 cache must have dtype torch.float8_e4m3fn \(view its bytes "
        r"with .view\(torch.float8_e4m3fn\)\)$",
    ),
    (
        dict(key_cache=cache(torch.float8_e5m2), value_cache=cache(torch.float8_e5m2)),
        r"^key_cache must have dtype torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn; "
        r"got torch.float8_e5m2$",
    ),
    (
        dict(value_cache=cache(torch.float16)),
        r"^key_cache, value_cache must share one dtype; got key_cache=torch.float8_e4m3fn, value_cache=torch.float16$",
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_wrapper_takes_an_fp8_cache_with_rows_of_any_float_dtype(dtype):
    """The checks pass; the device check (last) is what stops CPU tensors."""
    with pytest.raises(ValueError, match="^key must be on a CUDA device, got cpu$"):
        reshape_and_cache(**reshape_args(key=rows(dtype), value=rows(dtype)))
    with pytest.raises(ValueError, match="^query must be on a CUDA device, got cpu$"):
        paged_attention_decode(**decode_args(query=rows(dtype, 3, NUM_HEADS)))
    with pytest.raises(ValueError, match="^query must be on a CUDA device, got cpu$"):
        paged_prefill_attention(**prefill_args(query=rows(dtype, 7, NUM_HEADS)))
    with pytest.raises(ValueError, match="^query must be on a CUDA device, got cpu$"):
        paged_attention_prefill(rows(dtype, 4, NUM_HEADS), cache(), cache(), torch.arange(4), 50, 0.125)
    with pytest.raises(ValueError, match="^cache must be on a CUDA device, got cpu$"):
        gather_blocks(cache(), torch.zeros(2, 3, dtype=torch.long))
    pool = torch.zeros(2, 2, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE, dtype=FP8)
    with pytest.raises(ValueError, match="^src is a CPU tensor but not in pinned memory"):
        copy_blocks(pool, pool, torch.zeros(1, 2, dtype=torch.long))


@pytest.mark.parametrize("overrides, message", CACHE_DTYPE_ERRORS)
def test_cache_dtype_errors(overrides, message):
    with pytest.raises(TypeError, match=message):
        reshape_and_cache(**reshape_args(**overrides))
    with pytest.raises(TypeError, match=message):
        paged_attention_decode(**decode_args(**overrides))
    with pytest.raises(TypeError, match=message):
        paged_prefill_attention(**prefill_args(**overrides))
    kv = {"key_cache": cache(), "value_cache": cache(), **overrides}
    with pytest.raises(TypeError, match=message):
        paged_attention_prefill(
            rows(tokens=4, heads=NUM_HEADS), **kv, block_ids=torch.arange(4), context_len=50, scale=0.1
        )


def test_pool_and_gather_dtype_errors():
    pool = torch.zeros(2, 2, 4, 1, 16, 64, dtype=torch.float8_e5m2)
    with pytest.raises(TypeError, match=r"^src must have dtype .*torch.float8_e4m3fn; got torch.float8_e5m2$"):
        copy_blocks(pool, pool, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(
        TypeError, match=r"^src, dst must share one dtype; got src=torch.float8_e4m3fn, dst=torch.float16$"
    ):
        copy_blocks(pool.view(torch.float8_e4m3fn), torch.zeros(pool.shape, dtype=torch.float16), torch.zeros(1, 2))
    with pytest.raises(TypeError, match=r"^cache has dtype torch.uint8: an fp8 e4m3 cache must have dtype"):
        gather_blocks(cache(torch.uint8), torch.zeros(2, 3, dtype=torch.long))


def test_rows_into_an_fp8_cache_share_their_dtype_and_vector_size():
    with pytest.raises(
        TypeError, match=r"^key, value must share one dtype; got key=torch.float16, value=torch.float32$"
    ):
        reshape_and_cache(**reshape_args(value=rows(torch.float32)))
    with pytest.raises(TypeError, match=r"^key must have dtype torch.float16, torch.bfloat16, torch.float32; got"):
        reshape_and_cache(**reshape_args(key=rows(torch.float64), value=rows(torch.float64)))
    small = dict(key_cache=cache(head_size=4), value_cache=cache(head_size=4))
    with pytest.raises(ValueError, match="^key heads of 8 bytes are not a multiple of 16$"):
        reshape_and_cache(**reshape_args(key=rows(head_size=4), value=rows(head_size=4), **small))
    with pytest.raises(TypeError, match=r"^query must have dtype"):
        paged_attention_decode(**decode_args(query=rows(torch.float64, 3, NUM_HEADS)))


class Launches:
    """loader.function / loader.launch stand-ins: record what would run, touch no device."""

    def __init__(self, monkeypatch):
        self.calls = []
        cuda = torch.device("cuda", 0)
        monkeypatch.setattr(ops, "check_cuda", lambda names, tensors: cuda)
        monkeypatch.setattr(prefill_ops, "check_cuda", lambda names, tensors: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        monkeypatch.setattr(loader, "function", lambda file, name, device, defines=(): (file, name))
        monkeypatch.setattr(loader, "launch", self.launch)
        monkeypatch.setattr(torch, "empty", self.cpu(torch.empty))
        monkeypatch.setattr(torch, "empty_like", self.cpu(torch.empty_like))

    @staticmethod
    def cpu(make):
        return lambda *args, **kwargs: make(*args, **{**kwargs, "device": "cpu"})

    def launch(self, kernel, device, grid, block, args, shared_mem=0):
        self.calls.append((*kernel, grid, block, args, shared_mem))


@pytest.mark.parametrize(
    ("dtype", "suffix"), [(torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16")]
)
def test_an_fp8_cache_launches_the_fp8_kernels(monkeypatch, dtype, suffix):
    launches = Launches(monkeypatch)
    key = torch.zeros(5, 3 * NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)[:, :NUM_KV_HEADS]  # strided rows of a qkv
    reshape_and_cache(**reshape_args(key=key, value=rows(dtype)))
    file, name, grid, block, args, _ = launches.calls.pop()
    assert (file, name, grid, block) == ("reshape_and_cache.cu", f"reshape_and_cache_{suffix}_fp8", (5,), (32,))
    vecs = HEAD_SIZE * key.element_size() // 16
    assert args[5:] == (3 * NUM_KV_HEADS * vecs, NUM_KV_HEADS * vecs, NUM_KV_HEADS, vecs, BLOCK_SIZE)

    query = rows(dtype, 3, NUM_HEADS)
    for partition_size, variants in ((None, ["v1"]), (16, ["v2", "v2_reduce"])):
        paged_attention_decode(**decode_args(query=query), partition_size=partition_size or 64)
        names = [call[1] for call in launches.calls]
        launches.calls.clear()
        expected = {
            "v1": f"paged_attention_v1_{suffix}_{HEAD_SIZE}_fp8",
            "v2": f"paged_attention_v2_{suffix}_{HEAD_SIZE}_fp8",
            "v2_reduce": f"paged_attention_v2_reduce_{suffix}_{HEAD_SIZE}",  # the partials' merge: any cache
        }
        assert names == [expected[v] for v in variants]

    paged_prefill_attention(**prefill_args(query=rows(dtype, 7, NUM_HEADS)))
    variant = "simt" if dtype == torch.float32 else "mma"
    assert [call[1] for call in launches.calls] == [f"paged_prefill_{variant}_{suffix}_{HEAD_SIZE}_fp8"]
    launches.calls.clear()
    paged_prefill_attention(**prefill_args(query=rows(dtype, 7, NUM_HEADS)), tensor_cores=False)
    assert [call[1] for call in launches.calls] == [f"paged_prefill_simt_{suffix}_{HEAD_SIZE}_fp8"]


def test_a_model_dtype_cache_launches_the_kernels_it_did(monkeypatch):
    launches = Launches(monkeypatch)
    half = dict(key_cache=cache(torch.float16), value_cache=cache(torch.float16))
    reshape_and_cache(**reshape_args(**half))
    paged_attention_decode(**decode_args(**half), partition_size=64)
    paged_prefill_attention(**prefill_args(**half))
    names = [call[1] for call in launches.calls]
    assert names == ["reshape_and_cache", f"paged_attention_v1_f16_{HEAD_SIZE}", f"paged_prefill_mma_f16_{HEAD_SIZE}"]
    assert launches.calls[0][4][5:] == (NUM_KV_HEADS * 8, NUM_KV_HEADS * 8, NUM_KV_HEADS, 8, BLOCK_SIZE)
    assert all(isinstance(a, np.generic) for a in launches.calls[0][4][5:])
