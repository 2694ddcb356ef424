// w4a16: 4-bit weights (GPTQ, AWQ, compressed-tensors pack-quantized, all repacked once at load into
// the one layout below by raypaged/kernels/quant_ops.py) times fp32/fp16/bf16 activations, fp32 math.
//
// Layout (K' >= K: the layer's input features in the layout's order, padded; N4: N rounded up to 4):
//   qweight  int32 [K' / 8, N4]  word (r, n): features 8r .. 8r+7 of output column n, feature 8r+i in
//                                bits 4i .. 4i+3, unsigned 0..15 (padding columns 0)
//   scales   S     [G, N4]       fp16 where every scale is one, else fp32; G = K' / group_size
//   zeros    u8    [G, N4]       0..16; layout feature j is in group j / group_size
//   perm     int32 [K'] or null  layout feature j is input feature perm[j]; perm[j] == K marks padding
//                                (its x reads as 0, the dequantized matrix has no row for it); null: the
//                                identity, K' == K
//   w[j][n] = float(q - zero) * scale: one fp32 rounding, bit for bit every format's dequantize().
// A nibble becomes a float without a conversion instruction: byte-permuting it under the exponent
// of 2^23 gives the float 2^23 + q, and subtracting 2^23 + zero leaves q - zero exactly.
//
// w4a16_gemv_<x>_s<scale>_r<ROWS>: y[m] = x[m] . W^T for m < M <= ROWS (ROWS 1, 2, 4, 8).
//   grid (ceil(N4 / 128), splits), 256 threads (8 warps). A block takes 128 output columns (32 lanes x 4:
//   each thread reads one 16-byte vector of 4 consecutive words per word row, so a warp reads 512
//   contiguous bytes per row) and `split_words` word rows of K' (its split). The split's x rows are
//   gathered through perm into shared memory as fp32 ([M][8 * split_words]); the split's word rows are
//   divided among the 8 warps in contiguous runs, each run walked group by group (the group's 4 scales
//   and zeros in registers), 8 (ROWS <= 2) or 4 word rows' loads issued before any is used (a warp's
//   first ones prefetched into L2 before the x gather, so their latency overlaps it). ROWS <= 4
//   sums x . (q - zero) over a group and scales the sum once; ROWS 8 scales each weight (half the
//   accumulator registers). The 8 warps' sums meet in shared memory, added in warp order (no atomics:
//   the same bits every run). One split writes y in x's dtype; several write fp32 partial sums
//   [splits, M, N] that w4a16_reduce_<x> adds in split order (grid (ceil(N / 256), M), 256 threads).
// w4a16_dequant_<out>_s<scale>: the weight as a dense [K, N] matrix of `out` in the input features'
//   own order (rows scattered through perm, padding dropped), for a cuBLAS matmul.
//   grid (ceil(N4 / 256), ceil(K' / 32)), block (64, 4): one 16-byte vector (4 columns x 8 features)
//   per thread, written as 8 rows of 4 columns.
#include "common.cuh"

#define W4A16_THREADS 256
#define W4A16_WARPS (W4A16_THREADS / 32)
#define W4A16_COLS 128  // output columns per GEMV block: 32 lanes x 4
#define W4A16_REDUCE_THREADS 256
#define W4A16_MAGIC 0x4B000000u  // the float 2^23: OR-ing in q < 2^23 gives the float 2^23 + q

// The 4 scales at p (4-aligned) as fp32.
__device__ __forceinline__ void load_scales(const float* __restrict__ p, float s[4]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  s[0] = __uint_as_float(v.x);
  s[1] = __uint_as_float(v.y);
  s[2] = __uint_as_float(v.z);
  s[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void load_scales(const half_t* __restrict__ p, float s[4]) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  s[0] = to_float(half_t{(unsigned short)(v.x & 0xFFFFu)});
  s[1] = to_float(half_t{(unsigned short)(v.x >> 16)});
  s[2] = to_float(half_t{(unsigned short)(v.y & 0xFFFFu)});
  s[3] = to_float(half_t{(unsigned short)(v.y >> 16)});
}

// 2^23 + zero for the 4 columns whose zeros are the 4 bytes at p.
__device__ __forceinline__ void load_zeros(const unsigned char* __restrict__ p, float zm[4]) {
  const unsigned z = *reinterpret_cast<const unsigned*>(p);
#pragma unroll
  for (int c = 0; c < 4; ++c) zm[c] = __uint_as_float(W4A16_MAGIC | ((z >> (8 * c)) & 0xFFu));
}

// The 8 weights of one word as float(q - zero), feature order: feature 2j is byte j of the low
// nibbles, feature 2j + 1 byte j of the high ones.
__device__ __forceinline__ void dequant8(unsigned word, float zm, float v[8]) {
  const unsigned lo = word & 0x0F0F0F0Fu, hi = (word >> 4) & 0x0F0F0F0Fu;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    // bytes (q, 0, 0, 0x4B): the float 2^23 + q
    v[2 * j] = __uint_as_float(__byte_perm(lo, W4A16_MAGIC, 0x7440 | j)) - zm;
    v[2 * j + 1] = __uint_as_float(__byte_perm(hi, W4A16_MAGIC, 0x7440 | j)) - zm;
  }
}

__device__ __forceinline__ void dequant32(const uint4& raw, const float zm[4], float v[4][8]) {
  dequant8(raw.x, zm[0], v[0]);
  dequant8(raw.y, zm[1], v[1]);
  dequant8(raw.z, zm[2], v[2]);
  dequant8(raw.w, zm[3], v[3]);
}

// acc[m][c] += x[m][0..8) . v[c] for one word row; x rows `span` floats apart in shared memory.
template <int ROWS>
__device__ __forceinline__ void dot_rows(const float* __restrict__ xs, int span, int m_rows, const float v[4][8],
                                         float acc[ROWS][4]) {
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    if (m < m_rows) {
      const float4 a = *reinterpret_cast<const float4*>(xs + m * span);
      const float4 b = *reinterpret_cast<const float4*>(xs + m * span + 4);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float sum = acc[m][c];
        sum = fmaf(a.x, v[c][0], sum);
        sum = fmaf(a.y, v[c][1], sum);
        sum = fmaf(a.z, v[c][2], sum);
        sum = fmaf(a.w, v[c][3], sum);
        sum = fmaf(b.x, v[c][4], sum);
        sum = fmaf(b.y, v[c][5], sum);
        sum = fmaf(b.z, v[c][6], sum);
        sum = fmaf(b.w, v[c][7], sum);
        acc[m][c] = sum;
      }
    }
  }
}

// One word row's 4 words (raw) into the sums: per group (GROUP_SUMS, scaled when the group ends) or scaled here.
template <int ROWS, bool GROUP_SUMS>
__device__ __forceinline__ void accumulate(const uint4& raw, const float* __restrict__ xs, int span, int m_rows,
                                           const float s[4], const float zm[4], float acc[ROWS][4]) {
  float v[4][8];
  dequant32(raw, zm, v);
  if (!GROUP_SUMS) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
#pragma unroll
      for (int f = 0; f < 8; ++f) v[c][f] *= s[c];
    }
  }
  dot_rows<ROWS>(xs, span, m_rows, v, acc);
}

// Word rows [start, end) of one group into sums, UNROLL rows' loads issued before any is used;
// xs: x at word row `start`.
template <int ROWS, bool GROUP_SUMS, int UNROLL>
__device__ __forceinline__ void rows_of_group(const uint4* __restrict__ qweight, int row_vectors, int quad, int start,
                                              int end, const float* __restrict__ xs, int span, int m_rows,
                                              const float s[4], const float zm[4], float sums[ROWS][4]) {
  int r = start;
  for (; r + UNROLL <= end; r += UNROLL) {
    uint4 raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) raw[u] = qweight[(long long)(r + u) * row_vectors + quad];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) accumulate<ROWS, GROUP_SUMS>(raw[u], xs + 8 * (r + u - start), span, m_rows, s, zm, sums);
  }
  for (; r < end; ++r) {
    accumulate<ROWS, GROUP_SUMS>(qweight[(long long)r * row_vectors + quad], xs + 8 * (r - start), span, m_rows, s, zm,
                                 sums);
  }
}

template <typename T, typename S, int ROWS>
__device__ __forceinline__ void w4a16_gemv(T* __restrict__ y, float* __restrict__ partial, const T* __restrict__ x,
                                           const uint4* __restrict__ qweight, const S* __restrict__ scales,
                                           const unsigned char* __restrict__ zeros, const int* __restrict__ perm,
                                           int m_rows, int k_in, int k_words, int n_out, int n4, int group_words,
                                           int split_words) {
  constexpr bool GROUP_SUMS = ROWS <= 4;
  constexpr int UNROLL = ROWS <= 2 ? 8 : 4;
  extern __shared__ float4 shared_vectors[];  // x rows of the split, then the warps' sums
  float* smem = reinterpret_cast<float*>(shared_vectors);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int r0 = blockIdx.y * split_words, r1 = min(k_words, r0 + split_words);
  const int span = 8 * split_words, features = 8 * (r1 - r0);
  const int quad = blockIdx.x * 32 + lane;  // this thread's columns: 4 * quad .. 4 * quad + 3
  const int row_vectors = n4 >> 2;
  const int per_warp = (r1 - r0 + W4A16_WARPS - 1) / W4A16_WARPS;
  const int first = r0 + warp * per_warp, last = min(r1, first + per_warp);
  if (quad < row_vectors) {  // the first loads' memory latency under the x gather's
    for (int r = first; r < min(last, first + UNROLL); ++r) {
#ifndef RP_HOST_EMULATION
      asm volatile("prefetch.global.L2 [%0];" ::"l"(qweight + (long long)r * row_vectors + quad));
#endif
    }
  }
  for (int i = threadIdx.x; i < m_rows * features; i += W4A16_THREADS) {
    const int m = i / features, j = i - m * features;
    const int k = perm ? perm[8 * r0 + j] : 8 * r0 + j;
    smem[m * span + j] = k < k_in ? to_float(x[(long long)m * k_in + k]) : 0.f;
  }
  __syncthreads();

  float acc[ROWS][4];
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.f;
  }
  if (quad < row_vectors) {
    for (int start = first; start < last;) {
      const int g = start / group_words;
      const int end = min(last, (g + 1) * group_words);
      float s[4], zm[4];
      load_scales(scales + (long long)g * n4 + 4 * quad, s);
      load_zeros(zeros + (long long)g * n4 + 4 * quad, zm);
      if (GROUP_SUMS) {
        float group_acc[ROWS][4];
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
#pragma unroll
          for (int c = 0; c < 4; ++c) group_acc[m][c] = 0.f;
        }
        rows_of_group<ROWS, true, UNROLL>(qweight, row_vectors, quad, start, end, smem + 8 * (start - r0), span,
                                         m_rows, s, zm, group_acc);
#pragma unroll
        for (int m = 0; m < ROWS; ++m) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[m][c] = fmaf(group_acc[m][c], s[c], acc[m][c]);
        }
      } else {
        rows_of_group<ROWS, false, UNROLL>(qweight, row_vectors, quad, start, end, smem + 8 * (start - r0), span,
                                          m_rows, s, zm, acc);
      }
      start = end;
    }
  }

  __syncthreads();  // every warp is done with x: the space takes the warps' sums [warp][m][128]
#pragma unroll
  for (int m = 0; m < ROWS; ++m) {
    if (m < m_rows) {
      float4 v;
      v.x = acc[m][0];
      v.y = acc[m][1];
      v.z = acc[m][2];
      v.w = acc[m][3];
      *reinterpret_cast<float4*>(smem + (warp * m_rows + m) * W4A16_COLS + 4 * lane) = v;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < m_rows * W4A16_COLS; i += W4A16_THREADS) {
    const int m = i / W4A16_COLS, col = i - m * W4A16_COLS;
    const int n = blockIdx.x * W4A16_COLS + col;
    if (n >= n_out) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < W4A16_WARPS; ++w) sum += smem[(w * m_rows + m) * W4A16_COLS + col];
    if (gridDim.y == 1) {
      y[(long long)m * n_out + n] = from_float<T>(sum);
    } else {
      partial[((long long)blockIdx.y * m_rows + m) * n_out + n] = sum;
    }
  }
}

template <typename T>
__device__ __forceinline__ void w4a16_reduce(T* __restrict__ y, const float* __restrict__ partial, int splits,
                                             int m_rows, int n_out) {
  const int n = blockIdx.x * W4A16_REDUCE_THREADS + threadIdx.x, m = blockIdx.y;
  if (n >= n_out) return;
  float sum = 0.f;
  for (int s = 0; s < splits; ++s) sum += partial[((long long)s * m_rows + m) * n_out + n];
  y[(long long)m * n_out + n] = from_float<T>(sum);
}

// Four consecutive elements of a row from fp32, one vector store (p 4-element aligned).
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
  uint4 v;
  v.x = __float_as_uint(a);
  v.y = __float_as_uint(b);
  v.z = __float_as_uint(c);
  v.w = __float_as_uint(d);
  *reinterpret_cast<uint4*>(p) = v;
}
template <typename T> __device__ __forceinline__ void store4(T* p, float a, float b, float c, float d) {
  uint2 v;
  v.x = (unsigned)from_float<T>(a).bits | ((unsigned)from_float<T>(b).bits << 16);
  v.y = (unsigned)from_float<T>(c).bits | ((unsigned)from_float<T>(d).bits << 16);
  *reinterpret_cast<uint2*>(p) = v;
}

template <typename T, typename S>
__device__ __forceinline__ void w4a16_dequant(T* __restrict__ out, const uint4* __restrict__ qweight,
                                              const S* __restrict__ scales, const unsigned char* __restrict__ zeros,
                                              const int* __restrict__ perm, int k_in, int k_words, int n_out, int n4,
                                              int group_words) {
  const int quad = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
  const int row_vectors = n4 >> 2;
  if (quad >= row_vectors || r >= k_words) return;
  const int g = r / group_words;
  float s[4], zm[4];
  load_scales(scales + (long long)g * n4 + 4 * quad, s);
  load_zeros(zeros + (long long)g * n4 + 4 * quad, zm);
  float v[4][8];
  dequant32(qweight[(long long)r * row_vectors + quad], zm, v);
  const int n = 4 * quad;
  const bool whole = n + 4 <= n_out && (n_out & 3) == 0;  // 4 columns in one aligned store
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const int k = perm ? perm[8 * r + f] : 8 * r + f;
    if (k >= k_in) continue;  // padding
    T* row = out + (long long)k * n_out + n;
    if (whole) {
      store4(row, v[0][f] * s[0], v[1][f] * s[1], v[2][f] * s[2], v[3][f] * s[3]);
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (n + c < n_out) row[c] = from_float<T>(v[c][f] * s[c]);
      }
    }
  }
}

#define W4A16_GEMV_ARGS                                                                                         \
  T *__restrict__ y, float *__restrict__ partial, const T *__restrict__ x, const uint4 *__restrict__ qweight,  \
      const S *__restrict__ scales, const unsigned char *__restrict__ zeros, const int *__restrict__ perm,     \
      int m_rows, int k_in, int k_words, int n_out, int n4, int group_words, int split_words

#define DEFINE_GEMV(XS, SS, ROWS)                                                                               \
  extern "C" __global__ void __launch_bounds__(W4A16_THREADS, 2) w4a16_gemv_##XS##_s##SS##_r##ROWS(            \
      W4A16_GEMV_ARGS) {                                                                                        \
    w4a16_gemv<T, S, ROWS>(y, partial, x, qweight, scales, zeros, perm, m_rows, k_in, k_words, n_out, n4,       \
                           group_words, split_words);                                                           \
  }

#define DEFINE_DEQUANT(XS, SS)                                                                                  \
  extern "C" __global__ void __launch_bounds__(W4A16_THREADS) w4a16_dequant_##XS##_s##SS(                       \
      T* __restrict__ out, const uint4* __restrict__ qweight, const S* __restrict__ scales,                    \
      const unsigned char* __restrict__ zeros, const int* __restrict__ perm, int k_in, int k_words, int n_out, \
      int n4, int group_words) {                                                                                \
    w4a16_dequant<T, S>(out, qweight, scales, zeros, perm, k_in, k_words, n_out, n4, group_words);              \
  }

#define DEFINE_SCALE(XS, SS)                                                                                    \
  DEFINE_GEMV(XS, SS, 1)                                                                                        \
  DEFINE_GEMV(XS, SS, 2)                                                                                        \
  DEFINE_GEMV(XS, SS, 4)                                                                                        \
  DEFINE_GEMV(XS, SS, 8)                                                                                        \
  DEFINE_DEQUANT(XS, SS)

#define DEFINE_W4A16(XS)                                                                                        \
  extern "C" __global__ void __launch_bounds__(W4A16_REDUCE_THREADS) w4a16_reduce_##XS(                        \
      T* __restrict__ y, const float* __restrict__ partial, int splits, int m_rows, int n_out) {              \
    w4a16_reduce<T>(y, partial, splits, m_rows, n_out);                                                         \
  }                                                                                                             \
  namespace scale_f16_##XS {                                                                                    \
  typedef half_t S;                                                                                             \
  DEFINE_SCALE(XS, f16)                                                                                         \
  }                                                                                                             \
  namespace scale_f32_##XS {                                                                                    \
  typedef float S;                                                                                              \
  DEFINE_SCALE(XS, f32)                                                                                         \
  }

namespace x_f32 {
typedef float T;
DEFINE_W4A16(f32)
}
namespace x_f16 {
typedef half_t T;
DEFINE_W4A16(f16)
}
namespace x_bf16 {
typedef bf16_t T;
DEFINE_W4A16(bf16)
}
