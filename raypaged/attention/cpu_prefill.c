/* Paged prefill attention on CPU, fp32 (over a float32, fp8 e4m3 or bf16 cache): every prefill span of a step in one
 * call, each reading its
 * context straight through its block table (no gather copy), its own K/V of this step included
 * (written to the cache just before). The contract of raypaged.kernels.paged_prefill_attention:
 * query token i of span s sits at position context_lens[s] - query_len_s + i and sees the cache
 * positions up to it, so a whole prompt and a chunk after a prefix-cache hit or an earlier chunk
 * are the same case.
 *
 * Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_dim], contiguous. The query is
 * [tokens, num_heads, head_dim] with any token and head strides and contiguous rows; the output is
 * [tokens, num_heads, head_dim], contiguous.
 *
 * Work items are (span, tile of query tokens, KV head): the tile's tokens times the G query heads of that KV
 * head make its rows (up to TILE_ROWS: 16 tokens of 3 heads). Everything of a tile is kept transposed, rows in
 * the vector lanes: its queries ([D][rows], transposed once), its scores and weights ([key][rows]) and its
 * unnormalized outputs ([D][rows], transposed back once at the end). So a key's scores for all rows are D
 * multiply-adds of whole vectors by its K row's elements (broadcast), a key's weights go into the outputs the
 * same way from its V row, and the online softmax (running max, sum and rescale per row) is whole-vector work
 * too. Nothing is transposed per chunk of keys, no horizontal sums, no scalar max, and a chunk is CHUNK keys
 * across as many blocks as it spans (each row read through the block table).
 * The chunk-of-16-keys kernel this replaced transposed each chunk's K rows and ran each row's softmax alone:
 * SmolLM2's W6 prefill (32 prompts of 50-200 tokens, 9 query heads over 3 KV heads of 64) 4.73 -> 2.7-2.9 ms a layer
 * on 2 AVX-512 EPYC cores. Causal masking touches only the chunks that reach past a tile's first position.
 *
 * The vectors are GCC's generic ones, ROW_LANES floats: an AVX-512 register where the CPU has them, an AVX
 * one elsewhere. Each work item is one thread's, so the result does not depend on the thread count.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_exp.h"
#include "cpu_cache.h"

#if defined(__AVX512F__)
#define ROW_LANES 16 /* rows per vector */
#define KEY_GROUP 8  /* keys scored, and V columns weighted, at once: 3 x 8 sums in registers */
#else
#define ROW_LANES 8
#define KEY_GROUP 4
#endif
#define ROW_GROUP 3   /* row vectors at once */
#define TILE_ROWS 48  /* a tile's rows: whole tokens of G query heads (one token's G rows when G > 48) */
#define CHUNK 64      /* keys per online-softmax step */

typedef float vec __attribute__((vector_size(ROW_LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(ROW_LANES * sizeof(int32_t))));
typedef int32_t ivec_unaligned __attribute__((vector_size(ROW_LANES * sizeof(int32_t)), aligned(4)));

/* scores[j][r] = scale * q_r . k_j for the rows of row vectors [v0, v0 + NV) (NV <= ROW_GROUP) and keys
 * [j0, j0 + KEY_GROUP); qt is [D][width] (width = lanes of all the tile's row vectors), k[j] a key's row */
static inline __attribute__((always_inline)) void score_group(const float *qt, int64_t width, int64_t v0, const int NV,
                                                              const float *const *k, int64_t j0, int64_t D,
                                                              float scale, float *scores) {
    vec acc[KEY_GROUP][ROW_GROUP] = {{{0}}};
    for (int64_t d = 0; d < D; ++d) {
        vec q[ROW_GROUP];
        for (int i = 0; i < NV; ++i) q[i] = *(const vec *)(qt + d * width + (v0 + i) * ROW_LANES);
        for (int j = 0; j < KEY_GROUP; ++j) {
            const float kd = k[j0 + j][d];
            for (int i = 0; i < NV; ++i) acc[j][i] += kd * q[i];
        }
    }
    for (int j = 0; j < KEY_GROUP; ++j)
        for (int i = 0; i < NV; ++i) *(vec *)(scores + (j0 + j) * width + (v0 + i) * ROW_LANES) = acc[j][i] * scale;
}

/* ot[d][r] += sum_j p[j][r] * v_j[d] for the rows of row vectors [v0, v0 + NV), columns [d0, d0 + DN) (DN <=
 * KEY_GROUP) and keys [0, n) */
static inline __attribute__((always_inline)) void weigh_group(const float *p, int64_t width, int64_t v0, const int NV,
                                                              const float *const *v, int64_t n, int64_t d0,
                                                              const int DN, float *ot) {
    vec acc[KEY_GROUP][ROW_GROUP];
    for (int c = 0; c < DN; ++c)
        for (int i = 0; i < NV; ++i) acc[c][i] = *(vec *)(ot + (d0 + c) * width + (v0 + i) * ROW_LANES);
    for (int64_t j = 0; j < n; ++j) {
        vec w[ROW_GROUP];
        for (int i = 0; i < NV; ++i) w[i] = *(const vec *)(p + j * width + (v0 + i) * ROW_LANES);
        for (int c = 0; c < DN; ++c) {
            const float vd = v[j][d0 + c];
            for (int i = 0; i < NV; ++i) acc[c][i] += vd * w[i];
        }
    }
    for (int c = 0; c < DN; ++c)
        for (int i = 0; i < NV; ++i) *(vec *)(ot + (d0 + c) * width + (v0 + i) * ROW_LANES) = acc[c][i];
}

/* The chunk's scores ([n_padded][width]) for rows of row vectors [v0, v0 + NV), keys [0, n_padded) */
static void score_chunk(const float *qt, int64_t width, int64_t v0, int NV, const float *const *k, int64_t n_padded,
                        int64_t D, float scale, float *scores) {
    for (int64_t j0 = 0; j0 < n_padded; j0 += KEY_GROUP) switch (NV) {
            case 1: score_group(qt, width, v0, 1, k, j0, D, scale, scores); break;
            case 2: score_group(qt, width, v0, 2, k, j0, D, scale, scores); break;
            default: score_group(qt, width, v0, 3, k, j0, D, scale, scores); break;
        }
}

/* The chunk's weights ([n][width]) times its V rows into ot, rows of row vectors [v0, v0 + NV) */
static void weigh_chunk(const float *p, int64_t width, int64_t v0, int NV, const float *const *v, int64_t n, int64_t D,
                        float *ot) {
    int64_t d0 = 0;
    for (; d0 + KEY_GROUP <= D; d0 += KEY_GROUP) switch (NV) {
            case 1: weigh_group(p, width, v0, 1, v, n, d0, KEY_GROUP, ot); break;
            case 2: weigh_group(p, width, v0, 2, v, n, d0, KEY_GROUP, ot); break;
            default: weigh_group(p, width, v0, 3, v, n, d0, KEY_GROUP, ot); break;
        }
    for (; d0 < D; ++d0) switch (NV) { /* a head size that is not a multiple of KEY_GROUP: the last columns */
            case 1: weigh_group(p, width, v0, 1, v, n, d0, 1, ot); break;
            case 2: weigh_group(p, width, v0, 2, v, n, d0, 1, ot); break;
            default: weigh_group(p, width, v0, 3, v, n, d0, 1, ot); break;
        }
}

/* One online-softmax step over the chunk's n keys (from key position key_pos) for the row lanes [0, lanes) (whole
 * vectors, of the width lanes the arrays hold):
 * scores ([n][width]) become the weights exp(s - max), zero where masked and a key is past the row's position
 * (pos[r]); max_sum is the running max (first width floats) and sum (next width); the
 * outputs ot ([D][width]) are rescaled by exp(old max - new max). */
static void softmax_chunk(float *scores, int64_t width, int64_t lanes, int64_t n, int64_t key_pos, const int32_t *pos,
                          int masked, float *ot, int64_t D, float *max_sum) {
    float *max = max_sum, *sum = max_sum + width;
    for (int64_t r0 = 0; r0 < lanes; r0 += ROW_LANES) {
        float m[ROW_LANES], c[ROW_LANES], add[ROW_LANES];
        /* the running max as vectors: where a score beats one (and its key is visible), the compare's all-ones
         * mask selects the score; four of them, keys j % 4, so that no step waits on the one before */
        vec top[4];
        for (int t = 0; t < 4; ++t) top[t] = *(const vec *)(max + r0);
        const ivec row_pos = *(const ivec_unaligned *)(pos + r0);
        for (int64_t j = 0; j < n; ++j) {
            const vec s = *(const vec *)(scores + j * width + r0);
            ivec beats = s > top[j & 3];
            if (masked) beats &= (int32_t)(key_pos + j) <= row_pos;
            top[j & 3] = (vec)((beats & (ivec)s) | (~beats & (ivec)top[j & 3]));
        }
        for (int t = 1; t < 4; ++t) {
            const ivec beats = top[t] > top[0];
            top[0] = (vec)((beats & (ivec)top[t]) | (~beats & (ivec)top[0]));
        }
        for (int l = 0; l < ROW_LANES; ++l) m[l] = top[0][l];
        for (int l = 0; l < ROW_LANES; ++l) {
            c[l] = exp_nonpositive(max[r0 + l] - m[l]); /* the first chunk: exp(-FLT_MAX - m) times zeros */
            add[l] = 0.0f;
        }
        for (int64_t j = 0; j < n; ++j) {
            float *s = scores + j * width + r0;
#pragma omp simd
            for (int l = 0; l < ROW_LANES; ++l) {
                const float w = exp_nonpositive(s[l] - m[l]);
                s[l] = !masked || key_pos + j <= pos[r0 + l] ? w : 0.0f;
                add[l] += s[l];
            }
        }
        for (int l = 0; l < ROW_LANES; ++l) {
            sum[r0 + l] = sum[r0 + l] * c[l] + add[l];
            max[r0 + l] = m[l];
        }
        for (int64_t d = 0; d < D; ++d)
#pragma omp simd
            for (int l = 0; l < ROW_LANES; ++l) ot[d * width + r0 + l] *= c[l];
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* dst[c][at + i] = src[i][from + c] for i, c < 16: a 16 x 16 block transposed in registers */
static inline void transpose16(const float *const *src, int64_t from, float *const *dst, int64_t at) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src[i] + from);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int j = 0; j < 2; ++j) {
            r[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
            r[i + j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
        }
    for (int i = 0; i < 16; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
    /* r[k] now holds column c(k) of the block, c = the lane order the three shuffles leave */
    static const int column[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    for (int k = 0; k < 16; ++k) _mm512_storeu_ps(dst[column[k]] + at, r[k]);
}
#endif

/* dst[c][i] = src[i][c] for i < n, c < m: 16 x 16 blocks in registers where the CPU has AVX-512 */
static void transpose(const float *const *src, int64_t n, int64_t m, float *const *dst) {
    int64_t i0 = 0;
#if defined(__AVX512F__)
    int64_t c0 = 0;
    for (; i0 + 16 <= n; i0 += 16)
        for (c0 = 0; c0 + 16 <= m; c0 += 16) transpose16(src + i0, c0, dst + c0, i0);
    for (int64_t i = 0; i < i0; ++i) /* the columns past the last whole block */
        for (int64_t c = c0; c < m; ++c) dst[c][i] = src[i][c];
#endif
    for (int64_t i = i0; i < n; ++i)
        for (int64_t c = 0; c < m; ++c) dst[c][i] = src[i][c];
}

/* One work item's scratch, floats: qt and ot ([D][width] each), the scores ([CHUNK][width]), max and sum
 * ([width] each), the chunk's K and V rows widened from an fp8 or bf16 cache ([CHUNK][D] each), a row of zeros
 * ([D]) */
static inline int64_t scratch_floats(int64_t width, int64_t D) {
    return 2 * D * width + CHUNK * width + 2 * width + 2 * CHUNK * D + D;
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 when a context is beyond its block
 * table's width; -3 when a block id in use is outside the cache (the codes of cpu_decode.c); -4 when the
 * spans' query offsets do not ascend within the query's rows or a span has no query token; -5 when a
 * span's query is longer than its context. Nothing is read from the cache before these checks pass. The
 * caches hold float32, fp8 e4m3 or bf16 (format: cpu_cache.h), read as stored (K/V scales: as cpu_decode.c's). */
int raypaged_paged_prefill(const float *query, int64_t query_token_stride, int64_t query_head_stride,
                           int64_t num_tokens, const void *k_cache, const void *v_cache, int format, int64_t num_blocks,
                           const int32_t *cu_seqlens_q, const int32_t *context_lens, const int64_t *block_tables,
                           int64_t table_stride, int64_t table_width, float *out, int64_t num_spans,
                           int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                           float scale, int num_threads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    const int64_t tile_tokens = G < TILE_ROWS ? TILE_ROWS / G : 1, rows_max = tile_tokens * G;
    const int64_t width = (rows_max + ROW_LANES - 1) / ROW_LANES * ROW_LANES; /* row lanes, padded */
    int64_t *first = malloc(sizeof(int64_t) * (num_spans + 1)); /* first tile of each span */
    if (first == NULL) return -1;
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_spans; ++s) {
        const int64_t start = cu_seqlens_q[s], end = cu_seqlens_q[s + 1], len = context_lens[s];
        int status = 0;
        if (start < 0 || end <= start || end > num_tokens) status = -4;
        else if (end - start > len) status = -5;
        else if ((len + block_size - 1) / block_size > table_width) status = -2;
        for (int64_t j = 0; status == 0 && j < (len + block_size - 1) / block_size; ++j)
            if (block_tables[s * table_stride + j] < 0 || block_tables[s * table_stride + j] >= num_blocks) status = -3;
        if (status) {
            free(first);
            return status;
        }
        first[s] = tiles;
        tiles += (end - start + tile_tokens - 1) / tile_tokens;
    }
    first[num_spans] = tiles;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* the vectors are read and written whole: aligned to 64 bytes */
        float *local = malloc(sizeof(float) * scratch_floats(width, D) + 64);
        int32_t *pos = malloc(sizeof(int32_t) * width); /* each row's position (< 2^31: a context's) */
        const float **rows = malloc(sizeof(float *) * 2 * CHUNK); /* the chunk's K rows, then its V rows */
        /* the transposes' rows: the queries', the outputs' and the columns of qt or ot */
        const float **query_rows = malloc(sizeof(float *) * width);
        float **out_rows = malloc(sizeof(float *) * (width + D)), **columns = out_rows + width;
        const int ok = local != NULL && pos != NULL && rows != NULL && query_rows != NULL && out_rows != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        float *qt = local == NULL ? NULL : (float *)(((uintptr_t)local + 63) & ~(uintptr_t)63);
        float *ot = qt + D * width, *scores = ot + D * width, *max_sum = scores + CHUNK * width;
        float *widened = max_sum + 2 * width, *zeros = widened + 2 * CHUNK * D;
        if (ok) memset(zeros, 0, sizeof(float) * D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * num_kv_heads; ++item) {
            if (!ok) continue;
            const int64_t tile = item / num_kv_heads, head = item % num_kv_heads;
            int64_t lo = 0, hi = num_spans; /* the span with first[lo] <= tile < first[lo + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= tile) lo = mid; else hi = mid;
            }
            const int64_t span = lo, q_start = cu_seqlens_q[span], q_len = cu_seqlens_q[span + 1] - q_start;
            const int64_t t0 = (tile - first[span]) * tile_tokens;
            const int64_t tokens = q_len - t0 < tile_tokens ? q_len - t0 : tile_tokens, n_rows = tokens * G;
            const int64_t first_pos = context_lens[span] - q_len + t0, last_pos = first_pos + tokens - 1;
            const int64_t *table = block_tables + span * table_stride;
            const int64_t vectors = (n_rows + ROW_LANES - 1) / ROW_LANES, lanes = vectors * ROW_LANES;
            /* row r = i * G + g: token t0 + i, query head head * G + g; padding rows (zero queries) see every key */
            for (int64_t r = 0; r < lanes; ++r) { /* the row vectors in use; the width's others stay idle */
                pos[r] = (int32_t)(r < n_rows ? first_pos + r / G : last_pos);
                max_sum[r] = -FLT_MAX;
                max_sum[width + r] = 0.0f;
                query_rows[r] = r < n_rows ? query + (q_start + t0 + r / G) * query_token_stride +
                                            (head * G + r % G) * query_head_stride
                                      : zeros;
            }
            for (int64_t d = 0; d < D; ++d) columns[d] = qt + d * width;
            transpose(query_rows, lanes, D, columns);
            memset(ot, 0, sizeof(float) * D * width);
            for (int64_t key = 0; key <= last_pos; key += CHUNK) {
                const int64_t n = last_pos + 1 - key < CHUNK ? last_pos + 1 - key : CHUNK;
                const int64_t n_padded = (n + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
                for (int64_t j = 0; j < n;) { /* the chunk's rows, a block's run at a time */
                    const int64_t block = table[(key + j) / block_size], offset = (key + j) % block_size;
                    const int64_t run = block_size - offset < n - j ? block_size - offset : n - j;
                    const int64_t at = ((block * num_kv_heads + head) * block_size + offset) * D; /* in elements */
                    const float *k_rows = (const float *)k_cache + at, *v_rows = (const float *)v_cache + at;
                    if (format != CACHE_F32) {
                        widen_cache(k_cache, format, at, run * D, widened + j * D);
                        widen_cache(v_cache, format, at, run * D, widened + (CHUNK + j) * D);
                        k_rows = widened + j * D;
                        v_rows = widened + (CHUNK + j) * D;
                    }
                    for (int64_t u = 0; u < run; ++u) {
                        rows[j + u] = k_rows + u * D;
                        rows[CHUNK + j + u] = v_rows + u * D;
                    }
                    j += run;
                }
                for (int64_t j = n; j < n_padded; ++j) rows[j] = rows[0]; /* scored, then masked out */
                const int masked = key + n_padded - 1 > first_pos;
                for (int64_t v0 = 0; v0 < vectors; v0 += ROW_GROUP) {
                    const int NV = vectors - v0 < ROW_GROUP ? (int)(vectors - v0) : ROW_GROUP;
                    score_chunk(qt, width, v0, NV, rows, n_padded, D, scale, scores);
                }
                softmax_chunk(scores, width, lanes, n_padded, key, pos, masked, ot, D, max_sum);
                for (int64_t v0 = 0; v0 < vectors; v0 += ROW_GROUP) {
                    const int NV = vectors - v0 < ROW_GROUP ? (int)(vectors - v0) : ROW_GROUP;
                    weigh_chunk(scores, width, v0, NV, rows + CHUNK, n, D, ot);
                }
            }
            for (int64_t r = 0; r < lanes; ++r) max_sum[width + r] = 1.0f / max_sum[width + r];
            for (int64_t d = 0; d < D; ++d) {
#pragma omp simd
                for (int64_t r = 0; r < lanes; ++r) ot[d * width + r] *= max_sum[width + r];
                columns[d] = ot + d * width;
            }
            for (int64_t r = 0; r < n_rows; ++r)
                out_rows[r] = out + ((q_start + t0 + r / G) * num_heads + head * G + r % G) * D;
            transpose((const float *const *)columns, D, n_rows, out_rows);
        }
        free(local);
        free(pos);
        free(rows);
        free(query_rows);
        free(out_rows);
    }
    free(first);
    return failed ? -1 : 0;
}
