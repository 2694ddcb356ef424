// paged_prefill: causal attention of a step's prefill spans (packed back to back) over a paged KV
// cache, FlashAttention-style: K/V tiles are read through each span's block table (no gather),
// softmax is online in fp32.
//
// query: [total_q_tokens, num_heads, D] (rows at a token stride of q_stride elements), out:
// [total_q_tokens, num_heads, D] contiguous; cache: [num_blocks, num_kv_heads, block_size, D].
// Span s has query rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1 and context_lens[s] tokens in
// the cache (its own this step included): its query token i sits at position
// context_lens[s] - query_len + i and sees cache positions <= that.
//
// A thread block serves one query tile of one span for `heads_per_block` query heads of one KV
// head (GQA: all `group` heads when they fit, so each K/V tile is loaded once for all of them;
// else one head). Row r of a tile is token r / heads_per_block, head r % heads_per_block.
// grid (max query tiles per span, num_spans, num_heads / heads_per_block), 128 threads; blocks
// past their span's last token return at once.
//
//   paged_prefill_mma_{f16,bf16}_D: tensor cores (mma.sync m16n8k16, fp32 accumulate, sm_80+).
//     64 rows per block, 16 per warp; K/V tiles of 64 keys (32 at D = 80, 128) in shared memory,
//     rows padded by 16 bytes (conflict-free fragment loads); Q, K and V tiles land with cp.async,
//     the V tile's copy overlapping Q K^T and the next K tile's copy overlapping P V. S stays in
//     registers, becomes P's A fragments in place; V's B fragments come from ldmatrix.trans.
//     Static shared memory 2 * (64 + 2 * BLOCK_N) * (D + 8) bytes (<= 48 KiB).
//   paged_prefill_simt_{f32,f16,bf16}_D: fp32 FMAs (any arch; fp32 inputs, and a reference path
//     for the others). 16 rows per block, 4 per warp; K/V tiles of 32 keys, one per lane for
//     Q K^T, one output element per lane per 32 columns for P V.
//   ..._fp8 (paged_prefill_mma_{f16,bf16}_D_fp8, paged_prefill_simt_{f32,f16,bf16}_D_fp8): the same over an fp8
//     e4m3 cache (scale 1.0; query and output in the model's dtype). The cache's element type is a template
//     parameter. mma: each K/V tile's fp8 bytes land by cp.async in a staging area of BLOCK_N * D bytes of static
//     shared memory (the copies overlap the same work as above), and each thread then widens the 16-byte chunks it
//     copied itself (no barrier between) into the fp16/bf16 tile, exactly (fp8.cuh; every e4m3 value is an fp16
//     and a bf16 one). simt: each element widened to fp32 as it is loaded.
// Invariants (the wrapper cannot check them without a device sync): cu_seqlens_q ascending,
// 1 <= query_len <= context_lens[s] <= max_blocks * block_size, block ids valid.
#include "common.cuh"
#include "fp8.cuh"

constexpr int PF_THREADS = 128;
constexpr int PF_WARP = 32;
constexpr int MMA_BLOCK_M = 64;
constexpr int SIMT_BLOCK_M = 16;
constexpr int SIMT_BLOCK_N = 32;
constexpr float PF_LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float pf_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ long long table_entry(const void* __restrict__ tables, int table_is_64, long long i) {
  return table_is_64 ? static_cast<const long long*>(tables)[i] : (long long)static_cast<const int*>(tables)[i];
}

// What a thread block works on; every field is uniform across the block.
struct PrefillTile {
  int q_start;    // the span's first query row
  int q_len;
  int tok0;       // the tile's first token in the span
  int n_tok;      // its tokens
  int valid_rows; // n_tok * heads_per_block
  int first_pos;  // position of the span's first query token
  int kv_end;     // keys [0, kv_end) are seen by some row
  int full_end;   // keys [0, full_end) are seen by every row
  int kv_head;
  int head0;      // the tile's first query head
  long long table_row;  // offset of the span's row in block_tables
};

__device__ __forceinline__ bool prefill_tile(PrefillTile& t, const int* __restrict__ cu_seqlens_q,
                                             const int* __restrict__ context_lens, int block_m, int num_heads,
                                             int num_kv_heads, int heads_per_block, int max_blocks) {
  const int span = blockIdx.y;
  t.q_start = cu_seqlens_q[span];
  t.q_len = cu_seqlens_q[span + 1] - t.q_start;
  const int tokens_per_tile = block_m / heads_per_block;
  t.tok0 = blockIdx.x * tokens_per_tile;
  if (t.tok0 >= t.q_len) return false;
  t.n_tok = min(tokens_per_tile, t.q_len - t.tok0);
  t.valid_rows = t.n_tok * heads_per_block;
  t.first_pos = context_lens[span] - t.q_len;
  t.kv_end = t.first_pos + t.tok0 + t.n_tok;
  t.full_end = t.first_pos + t.tok0 + 1;
  const int group = num_heads / num_kv_heads;
  const int splits = group / heads_per_block;
  t.kv_head = blockIdx.z / splits;
  t.head0 = t.kv_head * group + (blockIdx.z % splits) * heads_per_block;
  t.table_row = (long long)span * max_blocks;
  return true;
}

#define PREFILL_ARGS(CACHE)                                                                               \
  T *__restrict__ out, const T *__restrict__ query, const CACHE *__restrict__ key_cache,                  \
      const CACHE *__restrict__ value_cache, const int *__restrict__ cu_seqlens_q,                        \
      const int *__restrict__ context_lens, const void *__restrict__ block_tables, int table_is_64,       \
      float scale, long long q_stride, int num_heads, int num_kv_heads, int heads_per_block, int block_size, \
      int max_blocks
#define PREFILL_PASS                                                                                       \
  out, query, key_cache, value_cache, cu_seqlens_q, context_lens, block_tables, table_is_64, scale, q_stride, \
      num_heads, num_kv_heads, heads_per_block, block_size, max_blocks

// ---- tensor-core path (sm_80+) -------------------------------------------------------------------

#ifndef RP_HOST_EMULATION
__device__ __forceinline__ unsigned smem_address(const void* p) {
  unsigned address;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
  return address;
}
#endif

// 16 bytes global -> shared, asynchronously; src_bytes 0 fills the 16 bytes with zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(RP_HOST_EMULATION)  // at once
  if (valid) {
    __builtin_memcpy(dst, src, 16);
  } else {
    __builtin_memset(dst, 0, 16);
  }
#elif __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  asm volatile("trap;");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800 && !defined(RP_HOST_EMULATION)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if __CUDA_ARCH__ >= 800 && !defined(RP_HOST_EMULATION)
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}

// Four 8x8 b16 matrices, transposed: lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  const void* row) {
#if defined(RP_HOST_EMULATION)
  rp_host::ldmatrix_x4_trans(r0, r1, r2, r3, row);
#elif __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_address(row))
               : "memory");
#else
  r0 = r1 = r2 = r3 = 0u;
  asm volatile("trap;");
#endif
}

// c[16x8] += a[16x16] (row) * b[16x8] (col), fp32 accumulate.
template <typename T> __device__ __forceinline__ void mma_16816(float* c, const unsigned* a, unsigned b0, unsigned b1);
template <> __device__ __forceinline__ void mma_16816<half_t>(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if defined(RP_HOST_EMULATION)
  rp_host::mma_16816<false>(c, a, b0, b1);
#elif __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("trap;");
#endif
}
template <> __device__ __forceinline__ void mma_16816<bf16_t>(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if defined(RP_HOST_EMULATION)
  rp_host::mma_16816<true>(c, a, b0, b1);
#elif __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile("trap;");
#endif
}

// Two fp32 values as one b16x2 word, `lo` at the lower address.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
  return (unsigned)from_float<T>(lo).bits | ((unsigned)from_float<T>(hi).bits << 16);
}

__device__ __forceinline__ unsigned load_b32(const void* p) { return *static_cast<const unsigned*>(p); }

// fp8 tiles: the staging area of one K or V tile's raw bytes (one per kernel instantiation that calls it).
template <int BYTES> __device__ __forceinline__ uint4* fp8_stage() {
  __shared__ uint4 stage[BYTES / 16];
  return stage;
}

// Four e4m3 elements (element i in byte i of w) as four T (fp16 or bf16) elements in order, exactly: .x holds
// elements 0 (low half) and 1, .y elements 2 and 3.
template <typename T> __device__ __forceinline__ uint2 widen_fp8_word(unsigned w);
template <> __device__ __forceinline__ uint2 widen_fp8_word<half_t>(unsigned w) {
  unsigned even, odd;  // elements (0, 2) and (1, 3)
  fp8x4_to_f16x4(w, even, odd);
  return make_uint2((even & 0xffffu) | (odd << 16), (even >> 16) | (odd & 0xffff0000u));
}
template <> __device__ __forceinline__ uint2 widen_fp8_word<bf16_t>(unsigned w) {
  const uint2 h = widen_fp8_word<half_t>(w);
  const unsigned words[2] = {h.x, h.y};
  unsigned out[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // fp16 -> fp32 -> its upper half: exact (3 mantissa bits fit bfloat16's 7)
    const unsigned lo = __float_as_uint(to_float(half_t{(unsigned short)(words[j] & 0xffffu)}));
    const unsigned hi = __float_as_uint(to_float(half_t{(unsigned short)(words[j] >> 16)}));
    out[j] = (lo >> 16) | (hi & 0xffff0000u);
  }
  return make_uint2(out[0], out[1]);
}

// Fragment layouts (PTX ISA, mma.m16n8k16 with 16-bit inputs; g = lane / 4, c = lane % 4):
//   A 16x16: a0 (row g, cols 2c..2c+1), a1 (row g + 8, same), a2 (row g, cols 2c+8..), a3 (row g + 8, cols 2c+8..)
//   B 16x8:  b0 (rows 2c..2c+1, col g), b1 (rows 2c+8.., col g)
//   C 16x8:  c0,c1 (row g, cols 2c, 2c+1), c2,c3 (row g + 8, same cols)
// T: the query's, output's and shared tiles' dtype; C: the cache's element type (T, or fp8_e4m3_t).
template <typename T, typename C, int D, int BLOCK_N>
__device__ __forceinline__ void prefill_mma(PREFILL_ARGS(C)) {
  constexpr bool FP8 = sizeof(C) == 1;
  constexpr int BLOCK_M = MMA_BLOCK_M;
  constexpr int STRIDE = D + 8;  // shared row stride in elements: 16 bytes of padding
  constexpr int ROW_CHUNKS = D / 8;  // 16-byte chunks per row
  constexpr int S_TILES = BLOCK_N / 8;
  constexpr int O_TILES = D / 8;
  constexpr int K_STEPS = D / 16;
  static_assert(D % 16 == 0 && BLOCK_N % 16 == 0 && O_TILES % 2 == 0, "tile shapes");
  __shared__ uint4 q_raw[BLOCK_M * STRIDE / 8];
  __shared__ uint4 k_raw[BLOCK_N * STRIDE / 8];
  __shared__ uint4 v_raw[BLOCK_N * STRIDE / 8];
  T* q_s = reinterpret_cast<T*>(q_raw);
  T* k_s = reinterpret_cast<T*>(k_raw);
  T* v_s = reinterpret_cast<T*>(v_raw);

  PrefillTile tile;
  if (!prefill_tile(tile, cu_seqlens_q, context_lens, BLOCK_M, num_heads, num_kv_heads, heads_per_block,
                    max_blocks)) {
    return;
  }
  const int tid = threadIdx.x;
  const long long block_stride = (long long)num_kv_heads * block_size * D;
  const long long head_offset = (long long)tile.kv_head * block_size * D;

  for (int c = tid; c < BLOCK_M * ROW_CHUNKS; c += PF_THREADS) {
    const int r = c / ROW_CHUNKS, col = (c % ROW_CHUNKS) * 8;
    const bool valid = r < tile.valid_rows;
    const T* src = query;
    if (valid) {
      const int token = tile.q_start + tile.tok0 + r / heads_per_block;
      src = query + token * q_stride + (long long)(tile.head0 + r % heads_per_block) * D + col;
    }
    cp_async16(q_s + r * STRIDE + col, src, valid);
  }
  // one K or V tile of keys kv0..kv0+BLOCK_N-1 through the block table; keys past kv_end are zeros
  auto load_tile = [&](T* dst, const T* __restrict__ cache, int kv0) {
    for (int c = tid; c < BLOCK_N * ROW_CHUNKS; c += PF_THREADS) {
      const int r = c / ROW_CHUNKS, col = (c % ROW_CHUNKS) * 8;
      const int pos = kv0 + r;
      const bool valid = pos < tile.kv_end;
      const T* src = cache;
      if (valid) {
        const long long block = table_entry(block_tables, table_is_64, tile.table_row + pos / block_size);
        src = cache + block * block_stride + head_offset + (long long)(pos % block_size) * D + col;
      }
      cp_async16(dst + r * STRIDE + col, src, valid);
    }
  };
  // fp8: a tile's bytes in 16-byte chunks (16 elements each), chunk c at stage[c]; stage_tile copies them like
  // load_tile, widen_tile widens the chunks this thread copied (after its own cp.async wait) into dst
  constexpr int FP8_ROW_CHUNKS = D / 16;
  constexpr int FP8_CHUNKS = BLOCK_N * FP8_ROW_CHUNKS;
  auto stage_tile = [&](const C* __restrict__ cache, int kv0) {
    uint4* stage = fp8_stage<FP8_CHUNKS * 16>();
    for (int c = tid; c < FP8_CHUNKS; c += PF_THREADS) {
      const int r = c / FP8_ROW_CHUNKS, col = (c % FP8_ROW_CHUNKS) * 16;
      const int pos = kv0 + r;
      const bool valid = pos < tile.kv_end;
      const C* src = cache;
      if (valid) {
        const long long block = table_entry(block_tables, table_is_64, tile.table_row + pos / block_size);
        src = cache + block * block_stride + head_offset + (long long)(pos % block_size) * D + col;
      }
      cp_async16(stage + c, src, valid);
    }
  };
  auto widen_tile = [&](T* dst) {  // a word (4 elements) at a time: few registers beside the accumulators
    const unsigned* stage = reinterpret_cast<const unsigned*>(fp8_stage<FP8_CHUNKS * 16>());
    for (int c = tid; c < FP8_CHUNKS; c += PF_THREADS) {
      const int r = c / FP8_ROW_CHUNKS, col = (c % FP8_ROW_CHUNKS) * 16;
      uint2* row = reinterpret_cast<uint2*>(dst + r * STRIDE + col);
#pragma unroll
      for (int i = 0; i < 4; ++i) row[i] = widen_fp8_word<T>(stage[4 * c + i]);
    }
  };
  if constexpr (FP8) {
    stage_tile(key_cache, 0);
    cp_async_commit();
    cp_async_wait_all();
    widen_tile(k_s);  // seen by every warp after the loop's first barrier
  } else {
    load_tile(k_s, key_cache, 0);
    cp_async_commit();
  }

  const int warp = tid / PF_WARP, lane = tid % PF_WARP, g = lane >> 2, c2 = (lane & 3) * 2;
  int qpos[2];  // each of the thread's two rows: its query position (-1: a padding row, sees nothing)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp * 16 + g + 8 * i;
    qpos[i] = r < tile.valid_rows ? tile.first_pos + tile.tok0 + r / heads_per_block : -1;
  }
  float o[O_TILES][4];
#pragma unroll
  for (int n = 0; n < O_TILES; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float row_max[2] = {pf_neg_inf(), pf_neg_inf()};  // in log2 units
  float row_sum[2] = {0.0f, 0.0f};  // this thread's share; summed over the quad at the end
  const float scale_log2 = scale * PF_LOG2E;
  const T* q_warp = q_s + (warp * 16 + g) * STRIDE + c2;
  const int num_tiles = (tile.kv_end + BLOCK_N - 1) / BLOCK_N;

  for (int j = 0; j < num_tiles; ++j) {
    const int kv0 = j * BLOCK_N;
    cp_async_wait_all();
    __syncthreads();  // K(j) (and Q) are in; every warp is done with V(j - 1)
    if constexpr (FP8) {
      stage_tile(value_cache, kv0);
    } else {
      load_tile(v_s, value_cache, kv0);
    }
    cp_async_commit();

    float s[S_TILES][4];
#pragma unroll
    for (int n = 0; n < S_TILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int k = 0; k < K_STEPS; ++k) {
      const T* qa = q_warp + k * 16;
      const unsigned a[4] = {load_b32(qa), load_b32(qa + 8 * STRIDE), load_b32(qa + 8), load_b32(qa + 8 * STRIDE + 8)};
#pragma unroll
      for (int n = 0; n < S_TILES; ++n) {
        const T* kb = k_s + (n * 8 + g) * STRIDE + k * 16 + c2;
        mma_16816<T>(s[n], a, load_b32(kb), load_b32(kb + 8));
      }
    }

    const bool masked = kv0 + BLOCK_N > tile.full_end;  // some key of this tile is hidden from some row
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float m = row_max[i];
#pragma unroll
      for (int n = 0; n < S_TILES; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[n][2 * i + e] * scale_log2;
          if (masked && kv0 + n * 8 + c2 + e > qpos[i]) x = pf_neg_inf();
          s[n][2 * i + e] = x;
          m = fmaxf(m, x);
        }
      }
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float base = m == pf_neg_inf() ? 0.0f : m;  // a row that has seen nothing yet stays at zero
      const float correction = exp2f(row_max[i] - base);
      row_max[i] = m;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < S_TILES; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(s[n][2 * i + e] - base);
          s[n][2 * i + e] = p;
          sum += p;
        }
      }
      row_sum[i] = row_sum[i] * correction + sum;
#pragma unroll
      for (int n = 0; n < O_TILES; ++n) {
        o[n][2 * i] *= correction;
        o[n][2 * i + 1] *= correction;
      }
    }

    cp_async_wait_all();
    if constexpr (FP8) widen_tile(v_s);  // every warp is done with V(j - 1) since the barrier above
    __syncthreads();  // V(j) is in; every warp is done with K(j)
    if constexpr (FP8) {
      if (j + 1 < num_tiles) stage_tile(key_cache, kv0 + BLOCK_N);
    } else {
      if (j + 1 < num_tiles) load_tile(k_s, key_cache, kv0 + BLOCK_N);
    }
    cp_async_commit();

    // O += P V: S's accumulators for keys 16kk..16kk+15 are P's A fragment as they stand
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      const unsigned a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      // lanes 0-15 address keys 16kk + lane of columns 8n.., lanes 16-31 the same keys of columns 8(n+1)..
      const T* vrow = v_s + (kk * 16 + (lane & 15)) * STRIDE + (lane >> 4) * 8;
#pragma unroll
      for (int n = 0; n < O_TILES; n += 2) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3, vrow + n * 8);
        mma_16816<T>(o[n], a, b0, b1);
        mma_16816<T>(o[n + 1], a, b2, b3);
      }
    }
    if constexpr (FP8) {
      if (j + 1 < num_tiles) {  // every warp is done with K(j) since the barrier above
        cp_async_wait_all();
        widen_tile(k_s);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float sum = row_sum[i];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = warp * 16 + g + 8 * i;
    if (r < tile.valid_rows) {
      const float inv = __fdividef(1.0f, sum);
      const long long token = tile.q_start + tile.tok0 + r / heads_per_block;
      T* dst = out + (token * num_heads + tile.head0 + r % heads_per_block) * D + c2;
#pragma unroll
      for (int n = 0; n < O_TILES; ++n) {
        *reinterpret_cast<unsigned*>(dst + n * 8) = pack2<T>(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
      }
    }
  }
}

// ---- fp32 FMA path (any arch) --------------------------------------------------------------------

template <typename T, typename C, int D>
__device__ __forceinline__ void prefill_simt(PREFILL_ARGS(C)) {
  constexpr int BLOCK_M = SIMT_BLOCK_M;
  constexpr int BLOCK_N = SIMT_BLOCK_N;
  constexpr int ROWS = BLOCK_M / (PF_THREADS / PF_WARP);  // rows per warp
  constexpr int COLS = (D + PF_WARP - 1) / PF_WARP;  // output columns per lane
  __shared__ float q_s[BLOCK_M * D];  // pre-scaled
  __shared__ float k_s[BLOCK_N * (D + 1)];  // padded: lane = key reads conflict-free
  __shared__ float v_s[BLOCK_N * D];
  __shared__ float p_s[BLOCK_M * BLOCK_N];

  PrefillTile tile;
  if (!prefill_tile(tile, cu_seqlens_q, context_lens, BLOCK_M, num_heads, num_kv_heads, heads_per_block,
                    max_blocks)) {
    return;
  }
  const int tid = threadIdx.x, warp = tid / PF_WARP, lane = tid % PF_WARP;
  const long long block_stride = (long long)num_kv_heads * block_size * D;
  const long long head_offset = (long long)tile.kv_head * block_size * D;
  for (int i = tid; i < BLOCK_M * D; i += PF_THREADS) {
    const int r = i / D, d = i % D;
    float x = 0.0f;
    if (r < tile.valid_rows) {
      const int token = tile.q_start + tile.tok0 + r / heads_per_block;
      x = to_float(query[token * q_stride + (long long)(tile.head0 + r % heads_per_block) * D + d]) * scale;
    }
    q_s[i] = x;
  }
  int qpos[ROWS];
  float row_max[ROWS], row_sum[ROWS], acc[ROWS][COLS];
#pragma unroll
  for (int rr = 0; rr < ROWS; ++rr) {
    const int r = warp * ROWS + rr;
    qpos[rr] = r < tile.valid_rows ? tile.first_pos + tile.tok0 + r / heads_per_block : -1;
    row_max[rr] = pf_neg_inf();
    row_sum[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[rr][c] = 0.0f;
  }

  for (int kv0 = 0; kv0 < tile.kv_end; kv0 += BLOCK_N) {
    __syncthreads();  // the previous tile is no longer read
    for (int i = tid; i < BLOCK_N * D; i += PF_THREADS) {
      const int r = i / D, d = i % D, pos = kv0 + r;
      float k = 0.0f, v = 0.0f;
      if (pos < tile.kv_end) {
        const long long block = table_entry(block_tables, table_is_64, tile.table_row + pos / block_size);
        const long long at = block * block_stride + head_offset + (long long)(pos % block_size) * D + d;
        k = to_float(key_cache[at]);
        v = to_float(value_cache[at]);
      }
      k_s[r * (D + 1) + d] = k;
      v_s[i] = v;
    }
    __syncthreads();

    float s[ROWS];
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) s[rr] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
      const float k = k_s[lane * (D + 1) + d];
#pragma unroll
      for (int rr = 0; rr < ROWS; ++rr) s[rr] += q_s[(warp * ROWS + rr) * D + d] * k;
    }
    const int key = kv0 + lane;
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
      const float x = key > qpos[rr] ? pf_neg_inf() : s[rr];
      float m = x;
#pragma unroll
      for (int step = PF_WARP / 2; step > 0; step >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, step));
      m = fmaxf(m, row_max[rr]);
      const float base = m == pf_neg_inf() ? 0.0f : m;
      const float correction = expf(row_max[rr] - base);
      const float p = expf(x - base);
      float sum = p;
#pragma unroll
      for (int step = PF_WARP / 2; step > 0; step >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, step);
      row_max[rr] = m;
      row_sum[rr] = row_sum[rr] * correction + sum;
      p_s[(warp * ROWS + rr) * BLOCK_N + lane] = p;
#pragma unroll
      for (int c = 0; c < COLS; ++c) acc[rr][c] *= correction;
    }
    __syncwarp();  // a warp reads only its own rows of p_s
    for (int k = 0; k < BLOCK_N; ++k) {
#pragma unroll
      for (int c = 0; c < COLS; ++c) {
        const int d = lane + c * PF_WARP;
        if (d < D) {
          const float v = v_s[k * D + d];
#pragma unroll
          for (int rr = 0; rr < ROWS; ++rr) acc[rr][c] += p_s[(warp * ROWS + rr) * BLOCK_N + k] * v;
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < ROWS; ++rr) {
    const int r = warp * ROWS + rr;
    if (r < tile.valid_rows) {
      const long long token = tile.q_start + tile.tok0 + r / heads_per_block;
      T* dst = out + (token * num_heads + tile.head0 + r % heads_per_block) * D;
      const float inv = __fdividef(1.0f, row_sum[rr]);
#pragma unroll
      for (int c = 0; c < COLS; ++c) {
        const int d = lane + c * PF_WARP;
        if (d < D) dst[d] = from_float<T>(acc[rr][c] * inv);
      }
    }
  }
}

// CACHE: the cache's element type; CACHE_SUFFIX: empty, or _fp8
#define DEFINE_PREFILL_MMA(TYPE, NAME, D, BLOCK_N, CACHE, CACHE_SUFFIX)                                  \
  extern "C" __global__ void __launch_bounds__(PF_THREADS, 4)                                           \
      paged_prefill_mma_##NAME##_##D##CACHE_SUFFIX(PREFILL_ARGS(CACHE)) {                               \
    prefill_mma<T, CACHE, D, BLOCK_N>(PREFILL_PASS);                                                    \
  }
#define DEFINE_PREFILL_SIMT(TYPE, NAME, D, CACHE, CACHE_SUFFIX)                                          \
  extern "C" __global__ void __launch_bounds__(PF_THREADS)                                              \
      paged_prefill_simt_##NAME##_##D##CACHE_SUFFIX(PREFILL_ARGS(CACHE)) {                              \
    prefill_simt<T, CACHE, D>(PREFILL_PASS);                                                            \
  }
#define DEFINE_PREFILL_SIMT_ALL_HEADS(TYPE, NAME, CACHE, CACHE_SUFFIX) \
  DEFINE_PREFILL_SIMT(TYPE, NAME, 64, CACHE, CACHE_SUFFIX)             \
  DEFINE_PREFILL_SIMT(TYPE, NAME, 80, CACHE, CACHE_SUFFIX)             \
  DEFINE_PREFILL_SIMT(TYPE, NAME, 96, CACHE, CACHE_SUFFIX)             \
  DEFINE_PREFILL_SIMT(TYPE, NAME, 128, CACHE, CACHE_SUFFIX)
// K/V tiles of 64 keys, 32 at D = 80 and 128 (the 128-register budget; shared memory at D = 128:
// Q 17 KiB + K and V 8.5 KiB each, and for an fp8 cache the 4 KiB staging area)
#define DEFINE_PREFILL_MMA_ALL_HEADS(TYPE, NAME, CACHE, CACHE_SUFFIX) \
  DEFINE_PREFILL_MMA(TYPE, NAME, 64, 64, CACHE, CACHE_SUFFIX)         \
  DEFINE_PREFILL_MMA(TYPE, NAME, 80, 32, CACHE, CACHE_SUFFIX)         \
  DEFINE_PREFILL_MMA(TYPE, NAME, 96, 64, CACHE, CACHE_SUFFIX)         \
  DEFINE_PREFILL_MMA(TYPE, NAME, 128, 32, CACHE, CACHE_SUFFIX)

#define T float
DEFINE_PREFILL_SIMT_ALL_HEADS(float, f32, float, )
DEFINE_PREFILL_SIMT_ALL_HEADS(float, f32, fp8_e4m3_t, _fp8)
#undef T
#define T half_t
DEFINE_PREFILL_SIMT_ALL_HEADS(half_t, f16, half_t, )
DEFINE_PREFILL_MMA_ALL_HEADS(half_t, f16, half_t, )
DEFINE_PREFILL_SIMT_ALL_HEADS(half_t, f16, fp8_e4m3_t, _fp8)
DEFINE_PREFILL_MMA_ALL_HEADS(half_t, f16, fp8_e4m3_t, _fp8)
#undef T
#define T bf16_t
DEFINE_PREFILL_SIMT_ALL_HEADS(bf16_t, bf16, bf16_t, )
DEFINE_PREFILL_MMA_ALL_HEADS(bf16_t, bf16, bf16_t, )
DEFINE_PREFILL_SIMT_ALL_HEADS(bf16_t, bf16, fp8_e4m3_t, _fp8)
DEFINE_PREFILL_MMA_ALL_HEADS(bf16_t, bf16, fp8_e4m3_t, _fp8)
#undef T
