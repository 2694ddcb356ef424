/* Paged prefill attention on CPU, fp32 (over a float32 or an fp8 e4m3 cache): every prefill span of a step in one
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
 * Work items are (span, tile of TILE_TOKENS query tokens, KV head): the tile's G query heads of that
 * KV head make up to TILE_TOKENS * G rows, flash-attention style over the keys in chunks of CHUNK:
 * a chunk's K rows are transposed once ([D][CHUNK]), so each row's CHUNK scores are D
 * multiply-adds of whole vectors, no horizontal sums; then an online softmax (running max, sum
 * and unnormalized output per row) and the chunk's V rows weighted into the output. Causal masking
 * touches only the chunks that reach past a tile's first position.
 *
 * The vectors are GCC's generic 16-float vectors: AVX-512 registers where the CPU has them, pairs of
 * AVX registers (or narrower) elsewhere. Each work item is one thread's, so the result does not
 * depend on the thread count.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_fp8.h"
#include "cpu_softmax.h"

#define TILE_TOKENS 16
#if defined(__AVX512F__)
#define CHUNK 16 /* keys per chunk: one vector of scores per query row, as wide as the CPU's registers */
#else
#define CHUNK 8
#endif
#define SCORE_ROWS 8 /* query rows scored at once: their sums stay in registers */
#define WEIGH_ROWS 4 /* output rows weighted at once */

typedef float vec __attribute__((vector_size(CHUNK * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(CHUNK * sizeof(float)), aligned(4)));

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }

/* One work item's scratch, floats: the transposed K chunk ([D][CHUNK]), the tile's query rows and outputs
 * ([rows][D] each), the scores ([rows][CHUNK]), max and sum per row, then a chunk's K or V rows widened from
 * an fp8 cache ([CHUNK][D]). */
static inline int64_t scratch_floats(int64_t rows, int64_t D) {
    return D * CHUNK + 2 * rows * D + rows * CHUNK + 2 * rows + CHUNK * D;
}

/* kt[d][j] = k_j[d] for the chunk's n (<= CHUNK) rows, zeros past them */
static void transpose_chunk(const float *k, int64_t n, int64_t D, float *kt) {
    if (n < CHUNK) memset(kt, 0, sizeof(float) * D * CHUNK);
    for (int64_t j = 0; j < n; ++j)
        for (int64_t d = 0; d < D; ++d) kt[d * CHUNK + j] = k[j * D + d];
}

/* s[r][:] = scale * q_r . kt for rows [0, rows), SCORE_ROWS at a time */
static void score_chunk(const float *q, int64_t rows, int64_t D, const float *kt, float scale, float *s) {
    int64_t r = 0;
    for (; r + SCORE_ROWS <= rows; r += SCORE_ROWS) {
        const float *q0 = q + r * D;
        vec a[SCORE_ROWS] = {{0}};
        for (int64_t d = 0; d < D; ++d) {
            const vec k = *(const vec *)(kt + d * CHUNK);
            for (int i = 0; i < SCORE_ROWS; ++i) a[i] += q0[i * D + d] * k;
        }
        for (int i = 0; i < SCORE_ROWS; ++i) store(s + (r + i) * CHUNK, a[i] * scale);
    }
    for (; r < rows; ++r) {
        const float *q0 = q + r * D;
        vec a0 = {0};
        for (int64_t d = 0; d < D; ++d) a0 += q0[d] * *(const vec *)(kt + d * CHUNK);
        store(s + r * CHUNK, a0 * scale);
    }
}

/* o[r][:] += sum_j p[r][j] * v_j for the chunk's n rows of V, rows [0, rows) */
static void weigh_chunk(const float *p, int64_t rows, const float *v, int64_t n, int64_t D, float *o) {
    int64_t d0 = 0;
    for (; d0 + CHUNK <= D; d0 += CHUNK) {
        int64_t r = 0;
        for (; r + WEIGH_ROWS <= rows; r += WEIGH_ROWS) {
            float *o0 = o + r * D + d0;
            vec a0 = load(o0), a1 = load(o0 + D), a2 = load(o0 + 2 * D), a3 = load(o0 + 3 * D);
            const float *p0 = p + r * CHUNK;
            for (int64_t j = 0; j < n; ++j) {
                const vec x = load(v + j * D + d0);
                a0 += p0[j] * x;
                a1 += p0[CHUNK + j] * x;
                a2 += p0[2 * CHUNK + j] * x;
                a3 += p0[3 * CHUNK + j] * x;
            }
            store(o0, a0);
            store(o0 + D, a1);
            store(o0 + 2 * D, a2);
            store(o0 + 3 * D, a3);
        }
        for (; r < rows; ++r) {
            float *o0 = o + r * D + d0;
            vec a0 = load(o0);
            for (int64_t j = 0; j < n; ++j) a0 += p[r * CHUNK + j] * load(v + j * D + d0);
            store(o0, a0);
        }
    }
    for (int64_t d = d0; d < D; ++d) /* a head size that is not a multiple of CHUNK: the last columns */
        for (int64_t r = 0; r < rows; ++r) {
            float acc = o[r * D + d];
            for (int64_t j = 0; j < n; ++j) acc += p[r * CHUNK + j] * v[j * D + d];
            o[r * D + d] = acc;
        }
}

/* The online softmax of one chunk's scores s ([rows][CHUNK], the first n valid) in place into
 * weights. Row r (query position first_pos + r / G) sees the keys at positions <= its own; the
 * chunk starts at key position key_pos. A row that sees none of the chunk gets zero weights. */
static void softmax_chunk(float *s, int64_t rows, int64_t G, int64_t n, int64_t first_pos, int64_t key_pos,
                          float *o, int64_t D, float *max_sum) {
    for (int64_t r = 0; r < rows; ++r) {
        float *row = s + r * CHUNK;
        int64_t visible = first_pos + r / G - key_pos + 1; /* keys of the chunk this row sees */
        visible = visible < n ? visible : n;
        if (visible <= 0) {
            memset(row, 0, sizeof(float) * CHUNK);
            continue;
        }
        online_softmax_row(row, visible, CHUNK, o + r * D, D, max_sum + 2 * r);
    }
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 when a context is beyond its block
 * table's width; -3 when a block id in use is outside the cache (the codes of cpu_decode.c); -4 when the
 * spans' query offsets do not ascend within the query's rows or a span has no query token; -5 when a
 * span's query is longer than its context. Nothing is read from the cache before these checks pass. The
 * caches hold float32, or fp8 e4m3 (scale 1) when fp8 is set. */
int raypaged_paged_prefill(const float *query, int64_t query_token_stride, int64_t query_head_stride,
                           int64_t num_tokens, const void *k_cache, const void *v_cache, int fp8, int64_t num_blocks,
                           const int32_t *cu_seqlens_q, const int32_t *context_lens, const int64_t *block_tables,
                           int64_t table_stride, int64_t table_width, float *out, int64_t num_spans,
                           int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                           float scale, int num_threads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, rows_max = TILE_TOKENS * G;
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
        tiles += (end - start + TILE_TOKENS - 1) / TILE_TOKENS;
    }
    first[num_spans] = tiles;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *local = malloc(sizeof(float) * scratch_floats(rows_max, D) + 64);
        if (local == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* the transposed chunk is read as whole vectors: aligned to 64 bytes */
        float *kt = local == NULL ? NULL : (float *)(((uintptr_t)local + 63) & ~(uintptr_t)63);
        float *q = kt + D * CHUNK, *o = q + rows_max * D, *s = o + rows_max * D, *max_sum = s + rows_max * CHUNK;
        float *widened = max_sum + 2 * rows_max;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * num_kv_heads; ++item) {
            if (local == NULL) continue;
            const int64_t tile = item / num_kv_heads, head = item % num_kv_heads;
            int64_t lo = 0, hi = num_spans; /* the span with first[lo] <= tile < first[lo + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= tile) lo = mid; else hi = mid;
            }
            const int64_t span = lo, q_start = cu_seqlens_q[span], q_len = cu_seqlens_q[span + 1] - q_start;
            const int64_t t0 = (tile - first[span]) * TILE_TOKENS;
            const int64_t tokens = q_len - t0 < TILE_TOKENS ? q_len - t0 : TILE_TOKENS, rows = tokens * G;
            const int64_t first_pos = context_lens[span] - q_len + t0, last_pos = first_pos + tokens - 1;
            const int64_t *table = block_tables + span * table_stride;
            for (int64_t i = 0; i < tokens; ++i) /* row i * G + g: token t0 + i, query head head * G + g */
                for (int64_t g = 0; g < G; ++g)
                    memcpy(q + (i * G + g) * D,
                           query + (q_start + t0 + i) * query_token_stride + (head * G + g) * query_head_stride,
                           sizeof(float) * D);
            memset(o, 0, sizeof(float) * rows * D);
            for (int64_t r = 0; r < rows; ++r) {
                max_sum[2 * r] = -FLT_MAX;
                max_sum[2 * r + 1] = 0.0f;
            }
            for (int64_t key = 0; key <= last_pos;) { /* chunks that stay inside one block */
                const int64_t block = table[key / block_size], offset = key % block_size;
                int64_t n = block_size - offset < CHUNK ? block_size - offset : CHUNK;
                n = n < last_pos + 1 - key ? n : last_pos + 1 - key;
                const int64_t at = ((block * num_kv_heads + head) * block_size + offset) * D; /* in elements */
                /* an fp8 cache's K rows are widened for the transpose, then its V rows in the same place */
                if (fp8) widen_fp8_e4m3((const uint8_t *)k_cache + at, n * D, widened);
                transpose_chunk(fp8 ? widened : (const float *)k_cache + at, n, D, kt);
                score_chunk(q, rows, D, kt, scale, s);
                softmax_chunk(s, rows, G, n, first_pos, key, o, D, max_sum);
                if (fp8) widen_fp8_e4m3((const uint8_t *)v_cache + at, n * D, widened);
                weigh_chunk(s, rows, fp8 ? widened : (const float *)v_cache + at, n, D, o);
                key += n;
            }
            for (int64_t i = 0; i < tokens; ++i)
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t r = i * G + g;
                    const float inv = 1.0f / max_sum[2 * r + 1];
                    float *dst = out + ((q_start + t0 + i) * num_heads + head * G + g) * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
                }
        }
        free(local);
    }
    free(first);
    return failed ? -1 : 0;
}
