// reshape_and_cache: write each token's K and V rows into their cache slots.
// key/value rows: [num_kv_heads * head_dim] elements at token stride *_row_stride_vecs;
// cache: [num_blocks * block_size (= slots), num_kv_heads * head_dim]. A negative slot
// (padding) is skipped. Dtype-agnostic: rows are moved as 16-byte vectors.
// grid = (num_tokens), block = min(256, row_vecs rounded up to a warp).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) reshape_and_cache(
    const uint4* __restrict__ key, const uint4* __restrict__ value,
    uint4* __restrict__ key_cache, uint4* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    long long key_row_stride_vecs, long long value_row_stride_vecs, int row_vecs) {
  const long long slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const uint4* key_row = key + blockIdx.x * key_row_stride_vecs;
  const uint4* value_row = value + blockIdx.x * value_row_stride_vecs;
  for (int i = threadIdx.x; i < row_vecs; i += blockDim.x) {
    key_cache[slot * row_vecs + i] = key_row[i];
    value_cache[slot * row_vecs + i] = value_row[i];
  }
}
