// copy_blocks: whole-block copies between two block pools, 16 bytes per load.
// Serves copy-on-write (src == dst pool), swap out/in (one pool in pinned host memory,
// read or written through its device-mapped pointer) and gather (dst = a dense buffer).
//
// A pool is [num_planes, num_blocks, block_bytes] (num_planes = layers * 2 for K and V).
// grid = (num_pairs, num_planes), block = 256 threads.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256) copy_blocks(
    uint4* __restrict__ dst,                  // [num_planes, dst_blocks, block_vecs]
    const uint4* __restrict__ src,            // [num_planes, src_blocks, block_vecs]
    const long long* __restrict__ mapping,    // [num_pairs, 2] (src block, dst block)
    long long src_plane_vecs, long long dst_plane_vecs, int block_vecs) {
  const long long src_block = mapping[2 * blockIdx.x];
  const long long dst_block = mapping[2 * blockIdx.x + 1];
  const uint4* from = src + blockIdx.y * src_plane_vecs + src_block * block_vecs;
  uint4* to = dst + blockIdx.y * dst_plane_vecs + dst_block * block_vecs;
  for (int i = threadIdx.x; i < block_vecs; i += blockDim.x) to[i] = from[i];
}
