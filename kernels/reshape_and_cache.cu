// reshape_and_cache: write each token's K and V rows into their cache slots.
// key/value rows: [num_kv_heads, head_dim] contiguous, at token stride *_row_stride_vecs;
// cache: [num_blocks, num_kv_heads, block_size, head_dim], so each head's piece of a row
// goes to its own place: ((block * num_kv_heads + head) * block_size + offset) * head_dim,
// with block = slot / block_size and offset = slot % block_size. A negative slot (padding)
// is skipped. Dtype-agnostic: rows are moved as 16-byte vectors.
// grid = (num_tokens), block = min(256, num_kv_heads * head_vecs rounded up to a warp).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) reshape_and_cache(
    const uint4* __restrict__ key, const uint4* __restrict__ value,
    uint4* __restrict__ key_cache, uint4* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    long long key_row_stride_vecs, long long value_row_stride_vecs, int num_kv_heads, int head_vecs,
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
    key_cache[dst] = key_row[i];
    value_cache[dst] = value_row[i];
  }
}
