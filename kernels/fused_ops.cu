// fused_ops: the model step's elementwise work in one pass each, fp32 arithmetic for every
// storage dtype, rounded to the storage dtype exactly where raypaged/model/layers.py rounds.
//
//   rms_norm:            out = w * T(x * rsqrt(mean(x^2) + eps))         one row per block
//   fused_add_rms_norm:  residual = T(x + residual); x = rms_norm(residual)  in place, one row per block
//   silu_and_mul:        out = T(T(silu(gate)) * up), x = [gate | up]    grid (rows, ceil(units / 256))
//   rotary_and_cache:    rotate-half RoPE of q and k in place, and the rotated k and v written to
//                        their cache slots ([num_blocks, num_kv_heads, block_size, head_dim]; a
//                        negative slot is skipped) in the same pass   one token per block
//
// Products and sums go through __fmul_rn / __fadd_rn where torch rounds each one, so no FMA is
// contracted where torch has two roundings (rotary is then bit-for-bit in every dtype).
// 16-byte vectors where the wrapper found rows and pointers aligned (`vectorized`), one element
// per step otherwise (hidden sizes that are not a multiple of the vector width).
#include "common.cuh"

#define NORM_MAX_THREADS 1024
#define SILU_THREADS 256
#define ROTARY_THREADS 256

// Element i of a 16-byte vector set from fp32, rounded to T. Elements are set in increasing
// order (even before odd), so a half word's low half is written before its high half.
template <typename T> __device__ __forceinline__ void set_element(unsigned* words, int i, float x);
template <> __device__ __forceinline__ void set_element<float>(unsigned* words, int i, float x) {
  words[i] = __float_as_uint(x);
}
template <> __device__ __forceinline__ void set_element<half_t>(unsigned* words, int i, float x) {
  const unsigned bits = from_float<half_t>(x).bits;
  words[i >> 1] = (i & 1) ? (words[i >> 1] | (bits << 16)) : bits;
}
template <> __device__ __forceinline__ void set_element<bf16_t>(unsigned* words, int i, float x) {
  const unsigned bits = from_float<bf16_t>(x).bits;
  words[i >> 1] = (i & 1) ? (words[i >> 1] | (bits << 16)) : bits;
}

__device__ __forceinline__ void unpack(const uint4& v, unsigned* words) {
  words[0] = v.x; words[1] = v.y; words[2] = v.z; words[3] = v.w;
}
__device__ __forceinline__ uint4 pack(const unsigned* words) {
  uint4 v;
  v.x = words[0]; v.y = words[1]; v.z = words[2]; v.w = words[3];
  return v;
}

// fp32 -> T -> fp32: the value torch holds after an op whose result is stored in T
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// The sum of v over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[33];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < int(blockDim.x >> 5) ? partial[lane] : 0.f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) partial[32] = v;
  }
  __syncthreads();
  return partial[32];
}

// w * T(x * rstd), each product rounded to T as torch rounds it (for fp32 T: (x * rstd) * w)
template <typename T> __device__ __forceinline__ float normed(float x, float rstd, float w) {
  return __fmul_rn(w, round_to<T>(__fmul_rn(x, rstd)));
}

// out[row] = rms_norm(x[row]); row = token * heads + head, x's row at token * token_stride +
// head * head_stride elements (a [tokens, hidden] tensor or a [tokens, heads, head_dim] view)
template <typename T>
__device__ __forceinline__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight,
                                         int hidden, int heads, long long token_stride, long long head_stride,
                                         float eps, int vectorized) {
  const int row = blockIdx.x;
  const T* in = x + (row / heads) * token_stride + (row % heads) * head_stride;
  T* dst = out + (long long)row * hidden;
  constexpr int E = 16 / sizeof(T);
  float squares = 0.f;
  if (vectorized) {
    const int vecs = hidden / E;
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      unsigned a[4];
      unpack(load_raw16(in + i * E), a);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float v = element<T>(a, e);
        squares += v * v;
      }
    }
    const float rstd = rsqrtf(block_sum(squares) / float(hidden) + eps);
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      unsigned a[4], w[4], o[4];
      unpack(load_raw16(in + i * E), a);
      unpack(load_raw16(weight + i * E), w);
#pragma unroll
      for (int e = 0; e < E; ++e) set_element<T>(o, e, normed<T>(element<T>(a, e), rstd, element<T>(w, e)));
      *reinterpret_cast<uint4*>(dst + i * E) = pack(o);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float v = to_float(in[i]);
      squares += v * v;
    }
    const float rstd = rsqrtf(block_sum(squares) / float(hidden) + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      dst[i] = from_float<T>(normed<T>(to_float(in[i]), rstd, to_float(weight[i])));
    }
  }
}

// residual[row] = T(x[row] + residual[row]); x[row] = rms_norm(residual[row]). Each thread
// reads back only the residual elements it wrote itself.
template <typename T>
__device__ __forceinline__ void fused_add_rms_norm(T* __restrict__ x, T* __restrict__ residual,
                                                   const T* __restrict__ weight, int hidden, float eps,
                                                   int vectorized) {
  const long long offset = (long long)blockIdx.x * hidden;
  T* xr = x + offset;
  T* rr = residual + offset;
  constexpr int E = 16 / sizeof(T);
  float squares = 0.f;
  if (vectorized) {
    const int vecs = hidden / E;
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      unsigned a[4], b[4], s[4];
      unpack(load_raw16(xr + i * E), a);
      unpack(load_raw16(rr + i * E), b);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float v = round_to<T>(__fadd_rn(element<T>(a, e), element<T>(b, e)));
        set_element<T>(s, e, v);
        squares += v * v;
      }
      *reinterpret_cast<uint4*>(rr + i * E) = pack(s);
    }
    const float rstd = rsqrtf(block_sum(squares) / float(hidden) + eps);
    for (int i = threadIdx.x; i < vecs; i += blockDim.x) {
      unsigned s[4], w[4], o[4];
      unpack(load_raw16(rr + i * E), s);
      unpack(load_raw16(weight + i * E), w);
#pragma unroll
      for (int e = 0; e < E; ++e) set_element<T>(o, e, normed<T>(element<T>(s, e), rstd, element<T>(w, e)));
      *reinterpret_cast<uint4*>(xr + i * E) = pack(o);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const T sum = from_float<T>(__fadd_rn(to_float(xr[i]), to_float(rr[i])));
      rr[i] = sum;
      const float v = to_float(sum);
      squares += v * v;
    }
    const float rstd = rsqrtf(block_sum(squares) / float(hidden) + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      xr[i] = from_float<T>(normed<T>(to_float(rr[i]), rstd, to_float(weight[i])));
    }
  }
}

// T(T(gate / (1 + exp(-gate))) * up): F.silu rounds to T, then mul_ rounds again
template <typename T> __device__ __forceinline__ float silu_mul(float gate, float up) {
  return __fmul_rn(round_to<T>(gate / (1.f + expf(-gate))), up);
}

// out[row, :d] = silu(x[row, :d]) * x[row, d:]; one unit (a vector, or an element) per thread
template <typename T>
__device__ __forceinline__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ x, int d, int vectorized) {
  const long long row = blockIdx.x;
  const int u = blockIdx.y * SILU_THREADS + threadIdx.x;
  const T* gate = x + row * 2 * d;
  const T* up = gate + d;
  T* dst = out + row * d;
  constexpr int E = 16 / sizeof(T);
  if (vectorized) {
    if (u >= d / E) return;
    unsigned g[4], v[4], o[4];
    unpack(load_raw16(gate + u * E), g);
    unpack(load_raw16(up + u * E), v);
#pragma unroll
    for (int e = 0; e < E; ++e) set_element<T>(o, e, silu_mul<T>(element<T>(g, e), element<T>(v, e)));
    *reinterpret_cast<uint4*>(dst + u * E) = pack(o);
  } else {
    if (u >= d) return;
    dst[u] = from_float<T>(silu_mul<T>(to_float(gate[u]), to_float(up[u])));
  }
}

// One token per block. The halves x1 = x[:R/2], x2 = x[R/2:R] of a head's first R features (R =
// rotary_dim: D, or fewer for a partial rotation) become (as apply_rotary_, each product and sum
// rounded to T) x1' = T(T(x1 * cos) - T(x2 * sin)), x2' = T(T(x2 * cos) + T(x1 * sin)), with
// cos = cos_sin[pos, 0], sin = cos_sin[pos, 1] ([max_positions, 2, R/2]); x[R:] passes.
// Units 0 .. (heads + kv_heads) * P - 1 rotate one vector pair of q or k (P = R/2 / E); the
// k ones also store both vectors to the cache; v, and k's features past R, are copied to the cache after.
template <typename T>
__device__ __forceinline__ void rotary_and_cache(
    const long long* __restrict__ positions, T* __restrict__ query, T* __restrict__ key,
    const T* __restrict__ value, const T* __restrict__ cos_sin, T* __restrict__ key_cache,
    T* __restrict__ value_cache, const long long* __restrict__ slot_mapping, long long query_stride,
    long long key_stride, long long value_stride, int num_heads, int num_kv_heads, int head_dim, int rotary_dim,
    int block_size) {
  constexpr int E = 16 / sizeof(T);
  const int t = blockIdx.x;
  const int half = rotary_dim / 2, pairs = half / E;
  const T* cos_row = cos_sin + positions[t] * rotary_dim;
  const T* sin_row = cos_row + half;
  const long long slot = slot_mapping[t];
  const long long block = slot >= 0 ? slot / block_size : 0;
  const int offset = slot >= 0 ? int(slot % block_size) : 0;
  const int rotations = (num_heads + num_kv_heads) * pairs;
  for (int u = threadIdx.x; u < rotations; u += blockDim.x) {
    const int head = u / pairs, p = (u % pairs) * E;
    const bool is_key = head >= num_heads;
    const int kv_head = head - num_heads;
    T* row = is_key ? key + t * key_stride + kv_head * head_dim : query + t * query_stride + head * head_dim;
    unsigned a[4], b[4], c[4], s[4], oa[4], ob[4];
    unpack(load_raw16(row + p), a);
    unpack(load_raw16(row + half + p), b);
    unpack(load_raw16(cos_row + p), c);
    unpack(load_raw16(sin_row + p), s);
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float x1 = element<T>(a, e), x2 = element<T>(b, e), ce = element<T>(c, e), se = element<T>(s, e);
      set_element<T>(oa, e, __fsub_rn(round_to<T>(__fmul_rn(x1, ce)), round_to<T>(__fmul_rn(x2, se))));
      set_element<T>(ob, e, __fadd_rn(round_to<T>(__fmul_rn(x2, ce)), round_to<T>(__fmul_rn(x1, se))));
    }
    const uint4 va = pack(oa), vb = pack(ob);
    *reinterpret_cast<uint4*>(row + p) = va;
    *reinterpret_cast<uint4*>(row + half + p) = vb;
    if (is_key && slot >= 0) {
      T* dst = key_cache + ((block * num_kv_heads + kv_head) * block_size + offset) * head_dim;
      *reinterpret_cast<uint4*>(dst + p) = va;
      *reinterpret_cast<uint4*>(dst + half + p) = vb;
    }
  }
  if (slot < 0) return;
  const int head_vecs = head_dim / E;
  for (int u = threadIdx.x; u < num_kv_heads * head_vecs; u += blockDim.x) {
    const int kv_head = u / head_vecs, i = (u % head_vecs) * E;
    T* dst = value_cache + ((block * num_kv_heads + kv_head) * block_size + offset) * head_dim;
    *reinterpret_cast<uint4*>(dst + i) = load_raw16(value + t * value_stride + kv_head * head_dim + i);
  }
  const int pass_vecs = (head_dim - rotary_dim) / E;  // k's features the rotation leaves (no thread writes them)
  for (int u = threadIdx.x; u < num_kv_heads * pass_vecs; u += blockDim.x) {
    const int kv_head = u / pass_vecs, i = rotary_dim + (u % pass_vecs) * E;
    T* dst = key_cache + ((block * num_kv_heads + kv_head) * block_size + offset) * head_dim;
    *reinterpret_cast<uint4*>(dst + i) = load_raw16(key + t * key_stride + kv_head * head_dim + i);
  }
}

#define DEFINE_FUSED(SUFFIX, T)                                                                             \
  extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS) rms_norm_##SUFFIX(                        \
      T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, int hidden, int heads,   \
      long long token_stride, long long head_stride, float eps, int vectorized) {                          \
    rms_norm<T>(out, x, weight, hidden, heads, token_stride, head_stride, eps, vectorized);                \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(NORM_MAX_THREADS) fused_add_rms_norm_##SUFFIX(              \
      T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight, int hidden, float eps,    \
      int vectorized) {                                                                                     \
    fused_add_rms_norm<T>(x, residual, weight, hidden, eps, vectorized);                                    \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(SILU_THREADS) silu_and_mul_##SUFFIX(                        \
      T* __restrict__ out, const T* __restrict__ x, int d, int vectorized) {                                \
    silu_and_mul<T>(out, x, d, vectorized);                                                                 \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(ROTARY_THREADS) rotary_and_cache_##SUFFIX(                  \
      const long long* __restrict__ positions, T* __restrict__ query, T* __restrict__ key,                 \
      const T* __restrict__ value, const T* __restrict__ cos_sin, T* __restrict__ key_cache,               \
      T* __restrict__ value_cache, const long long* __restrict__ slot_mapping, long long query_stride,     \
      long long key_stride, long long value_stride, int num_heads, int num_kv_heads, int head_dim,         \
      int rotary_dim, int block_size) {                                                                     \
    rotary_and_cache<T>(positions, query, key, value, cos_sin, key_cache, value_cache, slot_mapping,       \
                        query_stride, key_stride, value_stride, num_heads, num_kv_heads, head_dim,          \
                        rotary_dim, block_size);                                                            \
  }

DEFINE_FUSED(f32, float)
DEFINE_FUSED(f16, half_t)
DEFINE_FUSED(bf16, bf16_t)
