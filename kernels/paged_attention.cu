// paged_attention: decode attention (one query token per sequence) over a paged KV cache.
//
// Cache: [num_blocks, num_kv_heads, block_size, D] (one KV head's tokens of a block are
// contiguous: block_size * D elements); query/out: [num_seqs, num_heads, D];
// query head h reads KV head h / group (GQA/MQA; group = num_heads / num_kv_heads).
// One thread block per (kv head, sequence, partition) handles all `group` query heads of
// that KV head, so each K row is loaded once (16-byte loads, `LANES` threads per row)
// and each V row once per 4 query heads.
//   v1: grid (num_kv_heads, num_seqs, 1): one partition spans the context; writes out.
//   v2: grid (num_kv_heads, num_seqs, max_partitions): each partition writes its
//       normalised partial output, max logit and exp-sum; v2_reduce merges them.
// Dynamic shared memory (floats): q [group*D] + acc [group*D] + probs [group*partition]
// + max/sum [2*group]. Launch bounds: 128 threads, 4 blocks per SM (<= 128 registers).
//
// Kernels: paged_attention_{v1,v2,v2_reduce}_{f32,f16,bf16}_D over a cache of the model's dtype, and
// paged_attention_{v1,v2}_{f32,f16,bf16}_D_fp8 over an fp8 e4m3 cache (scale 1.0; the query and output in the
// model's dtype; v2's partials are merged by the same paged_attention_v2_reduce_*). The cache's element type is a
// template parameter: one 16-byte load holds 16 fp8 elements (16 / sizeof(T) otherwise; LANES and ROWS follow),
// expanded once after the load into eight exact fp16x2 words (fp8.cuh) that every query head of the group then
// reads as fp16 elements; V passes cover 2 query heads at a time instead of 4 (32 accumulators a thread).
#include "common.cuh"
#include "fp8.cuh"

// Tuning knobs (benchmarks/gpu_check.py times alternatives with -D on one instantiation):
// K/V rows each thread loads (raw 16-byte vectors, widened only when used) before using them,
// and the blocks per SM the register budget must allow.
#ifndef RP_ROWS_UNROLL
#define RP_ROWS_UNROLL 4
#endif
#ifndef RP_MIN_BLOCKS
#define RP_MIN_BLOCKS 4
#endif
constexpr int NUM_THREADS = 128;
constexpr int WARP_SIZE = 32;
constexpr int HEADS_PER_V_PASS = 4;
constexpr int ROWS_UNROLL = RP_ROWS_UNROLL;
constexpr float NEG_LARGE = -3.0e38f;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int m = WARP_SIZE / 2; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = WARP_SIZE / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// A 16-byte vector of K or V cache elements as a thread holds it from its load to its use. A cache of the model's
// dtype: the raw four words, each element widened to fp32 where it is used.
template <typename C> struct CacheVector {
  static constexpr int ELEMS = 16 / sizeof(C);
  unsigned w[4];
  static __device__ __forceinline__ CacheVector expand(uint4 raw) { return CacheVector{{raw.x, raw.y, raw.z, raw.w}}; }
  __device__ __forceinline__ float operator[](int i) const { return element<C>(w, i); }
};
// fp8: 16 elements, expanded once into fp16x2 words (exact); each is then widened as an fp16 element where it is
// used, so the expansion is paid once per load, not once per query head. w[2j] holds elements 4j and 4j + 2,
// w[2j + 1] elements 4j + 1 and 4j + 3 (fp8x4_to_f16x4's order).
template <> struct CacheVector<fp8_e4m3_t> {
  static constexpr int ELEMS = 16;
  unsigned w[8];
  static __device__ __forceinline__ CacheVector expand(uint4 raw) {
    CacheVector v;
    fp8x4_to_f16x4(raw.x, v.w[0], v.w[1]);
    fp8x4_to_f16x4(raw.y, v.w[2], v.w[3]);
    fp8x4_to_f16x4(raw.z, v.w[4], v.w[5]);
    fp8x4_to_f16x4(raw.w, v.w[6], v.w[7]);
    return v;
  }
  __device__ __forceinline__ float operator[](int i) const {
    return to_float(half_t{(unsigned short)(w[2 * (i >> 2) + (i & 1)] >> (((i >> 1) & 1) * 16))});
  }
};

// Element offset of token t's row (for KV head 0) in a cache through the block table.
__device__ __forceinline__ long long token_offset(const long long* __restrict__ table, int t, int block_size,
                                                  long long block_stride, int row_stride) {
  return table[t / block_size] * block_stride + (long long)(t % block_size) * row_stride;
}

// T: the query's and output's dtype; C: the cache's element type (T, or fp8_e4m3_t).
template <typename T, typename C, int D, bool PARTITIONED>
__device__ __forceinline__ void attention_partition(
    T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_max,
    float* __restrict__ partial_sum, const T* __restrict__ query, const C* __restrict__ key_cache,
    const C* __restrict__ value_cache, const long long* __restrict__ block_tables,
    const long long* __restrict__ context_lens, float scale, int num_kv_heads, int group, int block_size,
    int max_blocks, int partition_size) {
  constexpr int VEC = CacheVector<C>::ELEMS;  // cache elements per 16-byte load
  constexpr int ROW_VECS = D / VEC;  // 16-byte vectors per K/V row
  constexpr int LANES = ROW_VECS <= 4 ? 4 : (ROW_VECS <= 8 ? 8 : (ROW_VECS <= 16 ? 16 : 32));
  constexpr int ROWS = NUM_THREADS / LANES;  // tokens in flight per block
  // query heads per pass over V: a thread's accumulators stay at 32 floats at most
  constexpr int V_HEADS = VEC <= 8 ? HEADS_PER_V_PASS : HEADS_PER_V_PASS * 8 / VEC;
  const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int num_parts = gridDim.z;
  const int context_len = int(context_lens[seq]);
  const int start = part * partition_size;
  if (start >= context_len) return;
  const int n = min(partition_size, context_len - start);
  const int num_heads = num_kv_heads * group;
  const int head0 = kv_head * group;

  extern __shared__ float smem[];
  float* q_s = smem;                             // [group][D], pre-scaled
  float* acc_s = q_s + group * D;                // [group][D]
  float* prob_s = acc_s + group * D;             // [group][partition_size]
  float* max_s = prob_s + group * partition_size;  // [group]
  float* sum_s = max_s + group;                  // [group]

  const T* q = query + ((long long)seq * num_heads + head0) * D;
  for (int i = threadIdx.x; i < group * D; i += NUM_THREADS) {
    q_s[i] = to_float(q[i]) * scale;
    acc_s[i] = 0.0f;
  }
  __syncthreads();

  const int lane = threadIdx.x % LANES, row = threadIdx.x / LANES;
  const bool active = lane < ROW_VECS;
  const long long* table = block_tables + (long long)seq * max_blocks;
  const long long block_stride = (long long)num_kv_heads * block_size * D;
  const long long head_offset = (long long)kv_head * block_size * D + lane * VEC;

  // logits: each K row loaded once, dotted with every query head of the group;
  // ROWS_UNROLL rows per thread are loaded before any is reduced, to keep loads in flight
  for (int t0 = 0; t0 < n; t0 += ROWS * ROWS_UNROLL) {
    uint4 k[ROWS_UNROLL];
#pragma unroll
    for (int u = 0; u < ROWS_UNROLL; ++u) {
      const int t = t0 + u * ROWS + row;
      k[u] = make_uint4(0u, 0u, 0u, 0u);
      if (t < n && active) {
        k[u] = load_raw16(key_cache + token_offset(table, start + t, block_size, block_stride, D) + head_offset);
      }
    }
    CacheVector<C> kv[ROWS_UNROLL];  // expanded once, read by every query head
#pragma unroll
    for (int u = 0; u < ROWS_UNROLL; ++u) kv[u] = CacheVector<C>::expand(k[u]);
    for (int g = 0; g < group; ++g) {
#pragma unroll
      for (int u = 0; u < ROWS_UNROLL; ++u) {
        const int t = t0 + u * ROWS + row;
        float dot = 0.0f;
        if (active) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) dot += q_s[g * D + lane * VEC + v] * kv[u][v];
        }
#pragma unroll
        for (int m = LANES / 2; m > 0; m >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
        if (lane == 0 && t < n) prob_s[g * partition_size + t] = dot;
      }
    }
  }
  __syncthreads();

  // softmax numerators in place, one warp per query head
  const int warp = threadIdx.x / WARP_SIZE, warp_lane = threadIdx.x % WARP_SIZE;
  for (int g = warp; g < group; g += NUM_THREADS / WARP_SIZE) {
    float* p = prob_s + g * partition_size;
    float m = NEG_LARGE;
    for (int i = warp_lane; i < n; i += WARP_SIZE) m = fmaxf(m, p[i]);
    m = warp_max(m);
    float s = 0.0f;
    for (int i = warp_lane; i < n; i += WARP_SIZE) {
      const float e = expf(p[i] - m);
      p[i] = e;
      s += e;
    }
    s = warp_sum(s);
    if (warp_lane == 0) {
      max_s[g] = m;
      sum_s[g] = s;
    }
  }
  __syncthreads();

  // probs @ V: each V row loaded once per V_HEADS query heads
  for (int g0 = 0; g0 < group; g0 += V_HEADS) {
    float acc[V_HEADS][VEC];
#pragma unroll
    for (int h = 0; h < V_HEADS; ++h)
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[h][v] = 0.0f;
    for (int t0 = row; active && t0 < n; t0 += ROWS * ROWS_UNROLL) {
      uint4 val[ROWS_UNROLL];
#pragma unroll
      for (int u = 0; u < ROWS_UNROLL; ++u) {
        const int t = t0 + u * ROWS;
        val[u] = make_uint4(0u, 0u, 0u, 0u);
        if (t < n) {
          val[u] = load_raw16(value_cache + token_offset(table, start + t, block_size, block_stride, D) + head_offset);
        }
      }
#pragma unroll
      for (int u = 0; u < ROWS_UNROLL; ++u) {
        const int t = t0 + u * ROWS;
        const CacheVector<C> words = CacheVector<C>::expand(val[u]);
#pragma unroll
        for (int h = 0; h < V_HEADS; ++h) {
          if (t < n && g0 + h < group) {
            const float p = prob_s[(g0 + h) * partition_size + t];
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[h][v] += p * words[v];
          }
        }
      }
    }
    if (active) {
#pragma unroll
      for (int h = 0; h < V_HEADS; ++h) {
        if (g0 + h < group) {
#pragma unroll
          for (int v = 0; v < VEC; ++v) atomicAdd(&acc_s[(g0 + h) * D + lane * VEC + v], acc[h][v]);
        }
      }
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < group * D; i += NUM_THREADS) {
    const int g = i / D;
    const long long head_row = (long long)seq * num_heads + head0 + g;
    const float o = acc_s[i] / sum_s[g];
    if (PARTITIONED) {
      partial_out[(head_row * num_parts + part) * D + i % D] = o;
    } else {
      out[head_row * D + i % D] = from_float<T>(o);
    }
  }
  if (PARTITIONED && threadIdx.x < group) {
    const long long idx = ((long long)seq * num_heads + head0 + threadIdx.x) * num_parts + part;
    partial_max[idx] = max_s[threadIdx.x];
    partial_sum[idx] = sum_s[threadIdx.x];
  }
}

// grid (num_heads, num_seqs), NUM_THREADS threads, shared memory: max_partitions floats.
template <typename T, int D>
__device__ __forceinline__ void reduce_partitions(T* __restrict__ out, const float* __restrict__ partial_out,
                                                  const float* __restrict__ partial_max,
                                                  const float* __restrict__ partial_sum,
                                                  const long long* __restrict__ context_lens, int num_parts,
                                                  int partition_size) {
  const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
  const int n = int((context_lens[seq] + partition_size - 1) / partition_size);
  const long long base = ((long long)seq * num_heads + head) * num_parts;
  extern __shared__ float weight_s[];  // [num_parts]
  float m = NEG_LARGE;
  for (int p = 0; p < n; ++p) m = fmaxf(m, partial_max[base + p]);
  float total = 0.0f;
  for (int p = 0; p < n; ++p) total += partial_sum[base + p] * expf(partial_max[base + p] - m);
  for (int p = threadIdx.x; p < n; p += NUM_THREADS) {
    weight_s[p] = partial_sum[base + p] * expf(partial_max[base + p] - m) / total;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += NUM_THREADS) {
    float o = 0.0f;
    for (int p = 0; p < n; ++p) o += weight_s[p] * partial_out[(base + p) * D + d];
    out[((long long)seq * num_heads + head) * D + d] = from_float<T>(o);
  }
}

#define DECODE_ARGS(CACHE)                                                                                   \
  const T *__restrict__ query, const CACHE *__restrict__ key_cache, const CACHE *__restrict__ value_cache,  \
      const long long *__restrict__ block_tables, const long long *__restrict__ context_lens, float scale,  \
      int num_kv_heads, int group, int block_size, int max_blocks, int partition_size
#define DECODE_PASS \
  query, key_cache, value_cache, block_tables, context_lens, scale, num_kv_heads, group, block_size, max_blocks, \
      partition_size

// v1 and v2 of one query dtype, head size and cache element type (CACHE_SUFFIX: empty, or _fp8)
#define DEFINE_DECODE_CACHE(TYPE, NAME, D, CACHE, CACHE_SUFFIX)                                                 \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS, RP_MIN_BLOCKS)                                      \
      paged_attention_v1_##NAME##_##D##CACHE_SUFFIX(TYPE* __restrict__ out, DECODE_ARGS(CACHE)) {              \
    attention_partition<T, CACHE, D, false>(out, nullptr, nullptr, nullptr, DECODE_PASS);                      \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS, RP_MIN_BLOCKS)                                      \
      paged_attention_v2_##NAME##_##D##CACHE_SUFFIX(float* __restrict__ partial_out,                           \
                                                    float* __restrict__ partial_max,                           \
                                                    float* __restrict__ partial_sum, DECODE_ARGS(CACHE)) {     \
    attention_partition<T, CACHE, D, true>(nullptr, partial_out, partial_max, partial_sum, DECODE_PASS);       \
  }

#define DEFINE_DECODE(TYPE, NAME, D)                                                                            \
  DEFINE_DECODE_CACHE(TYPE, NAME, D, TYPE, )                                                                   \
  extern "C" __global__ void __launch_bounds__(NUM_THREADS, RP_MIN_BLOCKS) paged_attention_v2_reduce_##NAME##_##D( \
      TYPE* __restrict__ out, const float* __restrict__ partial_out, const float* __restrict__ partial_max,   \
      const float* __restrict__ partial_sum, const long long* __restrict__ context_lens, int num_parts,       \
      int partition_size) {                                                                                    \
    reduce_partitions<T, D>(out, partial_out, partial_max, partial_sum, context_lens, num_parts,               \
                            partition_size);                                                                   \
  }                                                                                                            \
  DEFINE_DECODE_CACHE(TYPE, NAME, D, fp8_e4m3_t, _fp8)

#define DEFINE_DECODE_ALL_HEADS(TYPE, NAME) \
  DEFINE_DECODE(TYPE, NAME, 64)             \
  DEFINE_DECODE(TYPE, NAME, 80)             \
  DEFINE_DECODE(TYPE, NAME, 96)             \
  DEFINE_DECODE(TYPE, NAME, 128)

#ifdef RP_TUNING_F16_128_ONLY  // one head size, for quick timing of the knobs above
#define T half_t
DEFINE_DECODE(half_t, f16, 128)
#undef T
#else
#define T float
DEFINE_DECODE_ALL_HEADS(float, f32)
#undef T
#define T half_t
DEFINE_DECODE_ALL_HEADS(half_t, f16)
#undef T
#define T bf16_t
DEFINE_DECODE_ALL_HEADS(bf16_t, bf16)
#undef T
#endif
