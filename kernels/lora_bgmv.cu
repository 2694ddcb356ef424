// lora_bgmv: the batched LoRA product, one adapter token per block (Punica's BGMV).
//   shrink: h[t] = x[token[t]] . A[slot[t]]            A: [num_slots, in, rank]  (rank contiguous)
//   expand: y[token[t]] += h[t] . B[slot[t]]           B: [num_slots, rank, out] (out contiguous)
// t runs over the listed tokens (token_ids, slot_of: [num_listed], each token at most once, so no
// two blocks write one row of y); h is fp32 [num_listed, rank]. A slot of -1 marks a token of no
// adapter: its h row is zero and its y row is not touched, so a CUDA graph can list every token
// of a batch whatever its adapters.
// The scale is folded into B by the caller. Accumulation is fp32 for every storage dtype.
//
// shrink: grid = (num_adapter_tokens), block = 256 threads (8 warps). Ranks are taken 32 at a
// time; within a warp, `cols` lanes (rank rounded up to a power of two, at most 32) read one row
// of A (coalesced) and 32 / cols such groups read consecutive rows, so small ranks keep every
// lane busy; partial sums meet by warp shuffles, then across warps in shared memory.
// expand: grid = (num_adapter_tokens, ceil(out / 256)), block = 256 threads, one output column
// each; the token's h sits in shared memory.
#include "common.cuh"

#define SHRINK_THREADS 256
#define SHRINK_WARPS (SHRINK_THREADS / 32)
#define EXPAND_THREADS 256
#define MAX_RANK 512

template <typename T>
__device__ __forceinline__ void lora_shrink(float* __restrict__ h, const T* __restrict__ x,
                                            const T* __restrict__ a, const long long* __restrict__ token_ids,
                                            const long long* __restrict__ slot_of, int in_features, int rank) {
  __shared__ float partial[SHRINK_WARPS][32];
  const int t = blockIdx.x;
  const long long slot = slot_of[t];
  if (slot < 0) {  // the whole block leaves together, before any barrier
    for (int r = threadIdx.x; r < rank; r += blockDim.x) h[(long long)t * rank + r] = 0.f;
    return;
  }
  const T* row = x + token_ids[t] * in_features;
  const T* weights = a + slot * (long long)in_features * rank;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r0 = 0; r0 < rank; r0 += 32) {
    const int width = min(rank - r0, 32);
    int cols = 1;
    while (cols < width) cols <<= 1;
    const int groups = 32 / cols;  // rows of A a warp reads at once
    const int c = lane & (cols - 1), g = lane / cols;
    const int r = r0 + c;
    float acc = 0.f;
    if (c < width) {
      for (int k = warp * groups + g; k < in_features; k += SHRINK_WARPS * groups) {
        acc += to_float(row[k]) * to_float(weights[(long long)k * rank + r]);
      }
    }
    for (int offset = cols; offset < 32; offset <<= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (g == 0) partial[warp][c] = acc;
    __syncthreads();
    if (warp == 0 && lane < width) {
      float sum = 0.f;
      for (int w = 0; w < SHRINK_WARPS; ++w) sum += partial[w][lane];
      h[(long long)t * rank + r0 + lane] = sum;
    }
    __syncthreads();
  }
}

template <typename T>
__device__ __forceinline__ void lora_expand(T* __restrict__ y, const float* __restrict__ h,
                                            const T* __restrict__ b, const long long* __restrict__ token_ids,
                                            const long long* __restrict__ slot_of, int rank, int out_features) {
  __shared__ float hs[MAX_RANK];
  const int t = blockIdx.x;
  if (slot_of[t] < 0) return;  // block-uniform, before the barrier
  for (int r = threadIdx.x; r < rank; r += blockDim.x) hs[r] = h[(long long)t * rank + r];
  __syncthreads();
  const int o = blockIdx.y * EXPAND_THREADS + threadIdx.x;
  if (o >= out_features) return;
  const T* weights = b + slot_of[t] * (long long)rank * out_features + o;
  float acc = 0.f;
  for (int r = 0; r < rank; ++r) acc += hs[r] * to_float(weights[(long long)r * out_features]);
  T* dst = y + token_ids[t] * out_features + o;
  *dst = from_float<T>(to_float(*dst) + acc);
}

#define DEFINE_LORA(SUFFIX, T)                                                                              \
  extern "C" __global__ void __launch_bounds__(SHRINK_THREADS) lora_shrink_##SUFFIX(                       \
      float* __restrict__ h, const T* __restrict__ x, const T* __restrict__ a,                              \
      const long long* __restrict__ token_ids, const long long* __restrict__ slot_of, int in_features,     \
      int rank) {                                                                                           \
    lora_shrink<T>(h, x, a, token_ids, slot_of, in_features, rank);                                         \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(EXPAND_THREADS) lora_expand_##SUFFIX(                       \
      T* __restrict__ y, const float* __restrict__ h, const T* __restrict__ b,                              \
      const long long* __restrict__ token_ids, const long long* __restrict__ slot_of, int rank,            \
      int out_features) {                                                                                   \
    lora_expand<T>(y, h, b, token_ids, slot_of, rank, out_features);                                        \
  }

DEFINE_LORA(f32, float)
DEFINE_LORA(f16, half_t)
DEFINE_LORA(bf16, bf16_t)
