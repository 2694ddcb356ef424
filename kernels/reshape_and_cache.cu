// reshape_and_cache: write each token's K and V rows into their cache slots.
// key/value rows: [num_kv_heads, head_dim] contiguous, at token stride *_row_stride_vecs (16-byte vectors);
// cache: [num_blocks, num_kv_heads, block_size, head_dim], so each head's piece of a row
// goes to its own place: ((block * num_kv_heads + head) * block_size + offset) * head_dim,
// with block = slot / block_size and offset = slot % block_size. A negative slot (padding)
// is skipped.
//   reshape_and_cache: a cache of the rows' dtype; dtype-agnostic, rows are moved as 16-byte vectors.
//   reshape_and_cache_{f32,f16,bf16}_fp8: an fp8 e4m3 cache (scale 1.0): each element of a 16-byte vector of the
//     rows is narrowed as torch's .to(torch.float8_e4m3fn) (fp8.cuh) and the 16 / sizeof(T) bytes stored at once.
// grid = (num_tokens), block = min(256, num_kv_heads * head_vecs rounded up to a warp); head_vecs counts the
// rows' 16-byte vectors per head.
#include "common.cuh"
#include "fp8.cuh"

// Bytes of `n` narrowed elements stored as one vector.
template <int N> struct Fp8Vector;
template <> struct Fp8Vector<4> { using type = unsigned; };
template <> struct Fp8Vector<8> { using type = uint2; };

template <typename T>
__device__ __forceinline__ typename Fp8Vector<16 / sizeof(T)>::type narrow_vector(uint4 raw) {
  constexpr int VEC = 16 / sizeof(T);
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
  unsigned out[VEC / 4];
#pragma unroll
  for (int j = 0; j < VEC / 4; ++j) {
    unsigned packed = 0u;
#pragma unroll
    for (int b = 0; b < 4; ++b) packed |= (unsigned)f32_to_fp8_e4m3(element<T>(words, 4 * j + b)) << (8 * b);
    out[j] = packed;
  }
  if constexpr (VEC == 4) {
    return out[0];
  } else {
    return make_uint2(out[0], out[1]);
  }
}

// CacheT: T (a cache of the rows' dtype: vectors copied as they are) or fp8_e4m3_t (narrowed).
template <typename T, typename CacheT>
__device__ __forceinline__ void write_rows(const uint4* __restrict__ key, const uint4* __restrict__ value,
                                           CacheT* __restrict__ key_cache, CacheT* __restrict__ value_cache,
                                           const long long* __restrict__ slot_mapping, long long key_row_stride_vecs,
                                           long long value_row_stride_vecs, int num_kv_heads, int head_vecs,
                                           int block_size) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const long long block = slot / block_size;
  const int offset = int(slot % block_size);
  const uint4* key_row = key + blockIdx.x * key_row_stride_vecs;
  const uint4* value_row = value + blockIdx.x * value_row_stride_vecs;
  const int row_vecs = num_kv_heads * head_vecs;
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    const int head = i / head_vecs;
    const long long dst = ((block * num_kv_heads + head) * block_size + offset) * head_vecs + i % head_vecs;
    if constexpr (sizeof(CacheT) == sizeof(T)) {
      reinterpret_cast<uint4*>(key_cache)[dst] = key_row[i];
      reinterpret_cast<uint4*>(value_cache)[dst] = value_row[i];
    } else {  // the vector's elements as bytes: dst counts vectors of 16 / sizeof(T) of them
      using Out = typename Fp8Vector<16 / sizeof(T)>::type;
      reinterpret_cast<Out*>(key_cache)[dst] = narrow_vector<T>(key_row[i]);
      reinterpret_cast<Out*>(value_cache)[dst] = narrow_vector<T>(value_row[i]);
    }
  }
}

#define RESHAPE_ARGS(CACHE)                                                                                      \
  const uint4 *__restrict__ key, const uint4 *__restrict__ value, CACHE *__restrict__ key_cache,                \
      CACHE *__restrict__ value_cache, const long long *__restrict__ slot_mapping, long long key_row_stride_vecs, \
      long long value_row_stride_vecs, int num_kv_heads, int head_vecs, int block_size
#define RESHAPE_PASS \
  key, value, key_cache, value_cache, slot_mapping, key_row_stride_vecs, value_row_stride_vecs, num_kv_heads, \
      head_vecs, block_size

extern "C" __global__ void __launch_bounds__(256) reshape_and_cache(RESHAPE_ARGS(uint4)) {
  write_rows<uint4, uint4>(RESHAPE_PASS);
}

#define DEFINE_RESHAPE_FP8(TYPE, NAME)                                                                 \
  extern "C" __global__ void __launch_bounds__(256) reshape_and_cache_##NAME##_fp8(RESHAPE_ARGS(fp8_e4m3_t)) { \
    write_rows<TYPE, fp8_e4m3_t>(RESHAPE_PASS);                                                         \
  }
DEFINE_RESHAPE_FP8(float, f32)
DEFINE_RESHAPE_FP8(half_t, f16)
DEFINE_RESHAPE_FP8(bf16_t, bf16)
