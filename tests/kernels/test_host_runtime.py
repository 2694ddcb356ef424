"""raypaged/kernels/host_runtime.h: CUDA's execution model on the CPU (the kernels' tests in tests/gpu run on it
where there is no GPU). Small kernels check each part against what CUDA and the PTX ISA define: barriers,
shuffles, shared memory, the mma.m16n8k16 and ldmatrix .trans fragments, and the errors a GPU would not report."""

import numpy as np
import pytest
import torch

from raypaged.kernels import host, loader

pytestmark = pytest.mark.skipif(host.compiler() is None, reason="needs a C++ compiler")

SOURCE = r"""
#include "common.cuh"

// each block: out[block] = the sum of x over its threads, through a warp shuffle tree and shared memory
extern "C" __global__ void block_sum(float* out, const float* x, int n) {
  __shared__ float warps[32];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = i < n ? x[i] : 0.f;
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < blockDim.x / 32 ? warps[threadIdx.x] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (threadIdx.x == 0) out[blockIdx.x] = v;
  }
}

// dynamic shared memory, reversed through a barrier; grid and block in two dimensions
extern "C" __global__ void reverse(int* out, const int* x) {
  extern __shared__ int buffer[];
  const int t = threadIdx.y * blockDim.x + threadIdx.x, n = blockDim.x * blockDim.y;
  const int base = (blockIdx.y * gridDim.x + blockIdx.x) * n;
  buffer[t] = x[base + t];
  __syncthreads();
  out[base + t] = buffer[n - 1 - t];
}

// c[16x8] = a[16x16] @ b[16x8] (fp16, fp32 out): each lane loads its fragments as the PTX ISA lays them out
extern "C" __global__ void mma_tile(float* c, const half_t* a, const half_t* b) {
  const int lane = threadIdx.x, g = lane / 4, q = lane % 4;
  auto pair = [](const half_t* p, int stride) {
    return (unsigned)p[0].bits | ((unsigned)p[stride].bits << 16);
  };
  const unsigned fa[4] = {pair(a + g * 16 + 2 * q, 1), pair(a + (g + 8) * 16 + 2 * q, 1),
                          pair(a + g * 16 + 2 * q + 8, 1), pair(a + (g + 8) * 16 + 2 * q + 8, 1)};
  const unsigned b0 = pair(b + (2 * q) * 8 + g, 8), b1 = pair(b + (2 * q + 8) * 8 + g, 8);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  rp_host::mma_16816<false>(acc, fa, b0, b1);
  for (int i = 0; i < 4; ++i) c[(g + 8 * (i >= 2)) * 8 + 2 * q + (i & 1)] = acc[i];
}

// four 8x8 b16 matrices from shared memory, transposed: regs[lane][i] is lane's register i
extern "C" __global__ void ldmatrix_trans(unsigned* regs, const unsigned short* m) {
  __shared__ unsigned short tile[4 * 64];
  for (int i = threadIdx.x; i < 4 * 64; i += 32) tile[i] = m[i];
  __syncthreads();
  unsigned r[4];
  rp_host::ldmatrix_x4_trans(r[0], r[1], r[2], r[3], tile + threadIdx.x * 8);  // lane l: row l % 8 of matrix l / 8
  for (int i = 0; i < 4; ++i) regs[threadIdx.x * 4 + i] = r[i];
}

extern "C" __global__ void divergent_barrier(int* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

extern "C" __global__ void barrier_after_return(int* out) {
  if (threadIdx.x >= 40) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

extern "C" __global__ void shuffle_after_return(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.f, 1);
}

// thread t reads what thread t + 1 wrote, with no barrier between
extern "C" __global__ void racy_shift(int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = threadIdx.x;
  out[blockIdx.x * 64 + threadIdx.x] = s[(threadIdx.x + 1) % 64];
}

extern "C" __global__ void __launch_bounds__(256) scale(float* out, float s, long long n) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] *= s;
}
"""


def kernel(name: str) -> host.HostKernel:
    text = SOURCE.replace('#include "common.cuh"', (loader.KERNEL_DIR / "common.cuh").read_text())
    return host.function(text, name)


def pointer(tensor: torch.Tensor) -> np.uint64:
    return loader.device_pointer(tensor)


def test_warp_shuffles_and_shared_memory_reduce_each_block():
    x = torch.randn(1000)
    out = torch.zeros(4)
    kernel("block_sum")((4,), (256,), (pointer(out), pointer(x), np.int32(1000)))
    expected = torch.stack([x[i * 256 : (i + 1) * 256].sum() for i in range(4)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_dynamic_shared_memory_and_two_dimensional_grids():
    x = torch.arange(2 * 3 * 24, dtype=torch.int32)
    out = torch.empty_like(x)
    kernel("reverse")((2, 3), (8, 3), (pointer(out), pointer(x)), shared_mem=24 * 4)
    assert torch.equal(out, x.view(6, 24).flip(1).flatten())


def test_mma_m16n8k16_fragments_multiply_as_the_ptx_isa_lays_them_out():
    torch.manual_seed(0)
    a, b = torch.randn(16, 16).half(), torch.randn(16, 8).half()
    c = torch.empty(16, 8)
    kernel("mma_tile")((1,), (32,), (pointer(c), pointer(a), pointer(b)))
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


def test_ldmatrix_trans_gives_each_lane_the_transposed_elements():
    m = torch.arange(4 * 64, dtype=torch.int16)  # element (i, r, c) of matrix i holds 64 i + 8 r + c
    regs = torch.empty(32, 4, dtype=torch.int32)
    kernel("ldmatrix_trans")((1,), (32,), (pointer(regs), pointer(m)))
    got = regs.view(torch.int16).view(32, 4, 2).tolist()  # (lane, register, low/high half)
    # register i of lane t: matrix i's elements (2 (t % 4) + j, t // 4), j = 0 in the low half
    expected = [[[64 * i + 8 * (2 * (t % 4) + j) + t // 4 for j in (0, 1)] for i in range(4)] for t in range(32)]
    assert got == expected


def test_a_race_on_shared_memory_changes_the_result():
    """The threads of a block take turns forwards and backwards, and shared memory starts each block as 0xff
    bytes: a read of another thread's write with no barrier between sees it in some blocks and not in others."""
    out = torch.zeros(4, 64, dtype=torch.int32)
    for _ in range(2):  # the second launch's blocks start from a poisoned shared memory again
        kernel("racy_shift")((4,), (64,), (pointer(out),))
        assert out[0].tolist() == [-1] * 63 + [0]  # forwards: t + 1 has not written yet (but 0 has, for 63)
        assert out[1].tolist() == list(range(1, 64)) + [-1]  # backwards: it has (but 0 has not, for 63)


def test_a_barrier_some_threads_never_reach_is_reported():
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"divergent_barrier: block \(0, 0, 0\): 32 threads wait at barriers"):
        kernel("divergent_barrier")((1,), (32,), (pointer(out),))
    with pytest.raises(RuntimeError, match=r"block \(0, 0, 0\): a thread returned while others wait at __syncthreads"):
        kernel("barrier_after_return")((1,), (64,), (pointer(out),))


def test_a_shuffle_over_lanes_that_returned_is_reported():
    out = torch.zeros(32)
    with pytest.raises(RuntimeError, match="mask names lanes that have returned"):
        kernel("shuffle_after_return")((1,), (32,), (pointer(out),))


def test_arguments_are_checked_against_the_kernels_parameters_as_cupy_passes_them():
    out = torch.ones(300)
    scale = kernel("scale")
    scale((3,), (128,), (pointer(out), np.float32(2.0), 300))  # a Python int is 8 bytes: a long long here
    assert torch.equal(out, torch.full((300,), 2.0))
    with pytest.raises(TypeError, match=r"scale: argument 1 is a 8-byte float, the kernel's parameter a 4-byte float"):
        scale((3,), (128,), (pointer(out), 2.0, 300))  # a Python float is a double
    with pytest.raises(TypeError, match=r"scale: argument 2 is a 4-byte integer, the kernel's parameter a 8-byte"):
        scale((3,), (128,), (pointer(out), np.float32(2.0), np.int32(300)))
    with pytest.raises(TypeError, match="scale: argument 1 is a 4-byte integer, the kernel's parameter a 4-byte float"):
        scale((3,), (128,), (pointer(out), np.int32(2), 300))
    with pytest.raises(TypeError, match="scale takes 3 arguments, got 2"):
        scale((3,), (128,), (pointer(out), np.float32(2.0)))
    with pytest.raises(ValueError, match=r"scale: a grid of \(1, 1, 1\) blocks of 2048 threads \(CUDA allows 1 to"):
        scale((1,), (2048,), (pointer(out), np.float32(2.0), 300))
    with pytest.raises(ValueError, match=r"scale: a grid of \(0, 1, 1\) blocks of 128 threads"):
        scale((0,), (128,), (pointer(out), np.float32(2.0), 300))
    with pytest.raises(ValueError, match=r"scale: a block of 512 threads, more than its __launch_bounds__ \(256\)"):
        scale((1,), (512,), (pointer(out), np.float32(2.0), 300))
    with pytest.raises(ValueError, match=r"scale: 49153 bytes of dynamic shared memory, more than the 49152"):
        scale((3,), (128,), (pointer(out), np.float32(2.0), 300), shared_mem=48 * 1024 + 1)


def test_the_wrappers_take_cpu_tensors_only_on_the_host():
    from raypaged import kernels

    x, weight = torch.randn(3, 64), torch.ones(64)
    with pytest.raises(ValueError, match="x must be on a CUDA device, got cpu"):
        kernels.rms_norm(x, weight, 1e-6)
    with host.on_host():
        torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, True) + 1e-6))
        with pytest.raises(ValueError, match=r"x must be on the CPU \(RAYPAGED_KERNELS_ON_HOST=1\), got meta"):
            kernels.rms_norm(x.to("meta"), weight.to("meta"), 1e-6)
