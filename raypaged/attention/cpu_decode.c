/* Paged decode attention on CPU, fp32 (over a float32, fp8 e4m3 or bf16 cache, whose rows are widened block by block):
 * one query token per sequence attends to its first
 * context_lens[s] cached tokens, read straight through its block table (no gather copy).
 *
 * Cache layout per layer (as raypaged.attention.torch_ops): [num_blocks, num_kv_heads,
 * block_size, head_dim], contiguous. The query is [num_seqs, num_heads, head_dim] with any
 * row strides and a contiguous last dimension; the output is [num_seqs, num_heads, head_dim],
 * contiguous. Query heads h * G .. h * G + G - 1 share KV head h (G = num_heads / num_kv_heads).
 *
 * Work items are (sequence, context partition): each walks its blocks twice, for each block all the KV heads
 * in turn, so that it reads one block's K rows (then, in the second pass, its V rows) as one contiguous run of
 * num_kv_heads * block_size * head_dim floats, scoring each K row once for all G query heads of its KV head.
 * Between the passes each query head's scores over the whole partition become softmax weights with their
 * true max, so nothing is rescaled as a running max rises (the online softmax per block that this replaced
 * spent more on its rescaling and its scalar max than on the dot products: a layer 133 -> 127 us from L3,
 * 236 -> 224 us from a 4 GiB pool, W6 +3 %). A context longer than one partition (PARTITION_TOKENS, rounded
 * to whole blocks; smaller when a step has too few tokens to give every thread work) is split, and a second
 * pass combines its partitions (flash-decoding). Partitions depend only on the inputs, never on the thread
 * count, so the result is the same on any number of threads.
 *
 * Blocks lie anywhere in the pool, so the hardware prefetcher loses the stream at every block: each
 * block's rows of a KV head are asked for while the block before is worked on for that head (all of the
 * next block at once, before the first head, arrived later: one layer from the 4 GiB pool 286-340 ->
 * 240-246 us, from L3 131-137 -> 129-131), and the V pass's first block during the K pass's last.
 * Measured with 32 sequences of 100-260 tokens (SmolLM2's 9 query heads over 3 KV heads of 64) on
 * 2 AVX-512 EPYC cores: 20 -> 25-28 GB/s from a 4 GiB pool of huge pages, 49 -> 58-63 GB/s from L3,
 * against the per-head two-pass kernel before those (which read each block once per KV head).
 *
 * raypaged_paged_decode_windowed takes three options of the attention some models need: a first visible position per
 * sequence (a sliding window's, Gemma's and gpt-oss's, or the start of a Llama 4 attention chunk: the partitions
 * cover [start, len) only), a sink logit per query head (gpt-oss: one more term of each head's softmax denominator,
 * exp(sink - max), with no value row) and Gemma 2's soft-capping of the scores (softcap * tanh(score / softcap),
 * before the softmax).
 *
 * Built by raypaged.attention.cpu_ops with the host's compiler and OpenMP (torch's own libgomp,
 * so both share one thread pool).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_exp.h"
#include "cpu_cache.h"

#define PARTITION_TOKENS 512
/* below this many work items a step's partitions shrink (to whole blocks, at least MIN_PARTITION_TOKENS) */
#define MIN_ITEMS 8
#define MIN_PARTITION_TOKENS 32

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR_PATH 1

/* [sum(a0), sum(a1), ..., sum(a7)] */
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* scores[g * n + j] = scale * q_g . k_j for 8 consecutive rows k_0..k_7 (D a multiple of 8) */
static inline void dot8(const float *q, int64_t G, int64_t D, const float *k, float scale, float *scores, int64_t n) {
    for (int64_t g = 0; g < G; ++g) {
        const float *qg = q + g * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(qg + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + D + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * D + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * D + d), a3);
            a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * D + d), a4);
            a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * D + d), a5);
            a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * D + d), a6);
            a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * D + d), a7);
        }
        _mm256_storeu_ps(scores + g * n, _mm256_mul_ps(sum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)));
    }
}

/* acc[g * D + d] += sum_t p[g * n + t] * v_t[d] over rows v_0..v_{run-1}, for GN (<= 4) heads at once:
 * each 8-wide column of V is loaded once for all of them */
static inline __attribute__((always_inline)) void weighted_rows(const float *p, int64_t n, const float *v, int64_t run,
                                                                int64_t D, float *acc, const int GN) {
    for (int64_t d = 0; d < D; d += 8) {
        __m256 a[4];
        for (int g = 0; g < GN; ++g) a[g] = _mm256_loadu_ps(acc + g * D + d);
        for (int64_t t = 0; t < run; ++t) {
            __m256 x = _mm256_loadu_ps(v + t * D + d);
            for (int g = 0; g < GN; ++g) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * n + t), x, a[g]);
        }
        for (int g = 0; g < GN; ++g) _mm256_storeu_ps(acc + g * D + d, a[g]);
    }
}
#else
#define VECTOR_PATH 0
#endif

#if VECTOR_PATH && defined(__AVX512F__) && defined(__AVX512DQ__)
#define WIDE_PATH 1
/* dot8 for GN (<= 3) heads at once, 16 wide (D a multiple of 16): each K row is loaded once for
 * all of them, and the 8 x GN sums stay in registers */
static inline __attribute__((always_inline)) void dot8_wide(const float *q, int64_t D, const float *k, float scale,
                                                            float *scores, int64_t n, const int GN) {
    __m512 a[3][8];
    for (int g = 0; g < GN; ++g)
        for (int r = 0; r < 8; ++r) a[g][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 qv[3];
        for (int g = 0; g < GN; ++g) qv[g] = _mm512_loadu_ps(q + g * D + d);
        for (int r = 0; r < 8; ++r) {
            __m512 kv = _mm512_loadu_ps(k + r * D + d);
            for (int g = 0; g < GN; ++g) a[g][r] = _mm512_fmadd_ps(qv[g], kv, a[g][r]);
        }
    }
    for (int g = 0; g < GN; ++g) {
        __m256 h[8];
        for (int r = 0; r < 8; ++r)
            h[r] = _mm256_add_ps(_mm512_castps512_ps256(a[g][r]), _mm512_extractf32x8_ps(a[g][r], 1));
        _mm256_storeu_ps(scores + g * n,
                         _mm256_mul_ps(sum8(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), _mm256_set1_ps(scale)));
    }
}

/* weighted_rows for GN (<= 3) heads over CH (<= 4) 16-wide columns from d0: all GN x CH accumulators
 * stay in registers across the run */
static inline __attribute__((always_inline)) void weighted_columns(const float *p, int64_t n, const float *v,
                                                                   int64_t run, int64_t D, float *acc, int64_t d0,
                                                                   const int GN, const int CH) {
    __m512 a[3][4];
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < CH; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + d0 + 16 * c);
    for (int64_t t = 0; t < run; ++t) {
        __m512 x[4];
        for (int c = 0; c < CH; ++c) x[c] = _mm512_loadu_ps(v + t * D + d0 + 16 * c);
        for (int g = 0; g < GN; ++g) {
            const __m512 pg = _mm512_set1_ps(p[g * n + t]);
            for (int c = 0; c < CH; ++c) a[g][c] = _mm512_fmadd_ps(pg, x[c], a[g][c]);
        }
    }
    for (int g = 0; g < GN; ++g)
        for (int c = 0; c < CH; ++c) _mm512_storeu_ps(acc + g * D + d0 + 16 * c, a[g][c]);
}

/* weighted_rows for GN (<= 3) heads, 16 wide (D a multiple of 16), 64 columns at a time */
static inline __attribute__((always_inline)) void weighted_rows_wide(const float *p, int64_t n, const float *v,
                                                                     int64_t run, int64_t D, float *acc, const int GN) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) weighted_columns(p, n, v, run, D, acc, d0, GN, 4);
    for (; d0 < D; d0 += 16) weighted_columns(p, n, v, run, D, acc, d0, GN, 1);
}
#else
#define WIDE_PATH 0
#endif

/* Asks for the bytes [p, p + bytes) ahead of use, line by line: a block's rows lie far from the next block's,
 * beyond where the hardware prefetcher follows a stream. */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* scores[g * n + t] = scale * q_g . k_t for the run's K rows and the G query heads of one KV head */
static void score_rows(const float *q, int64_t G, int64_t D, const float *k, int64_t run, float scale,
                       float *scores, int64_t n) {
    int64_t t = 0;
#if WIDE_PATH
    if (D % 16 == 0) {
        for (int64_t g = 0; g < G; g += 3) {
            const float *qg = q + g * D;
            float *s = scores + g * n;
            int64_t u = 0;
            switch (G - g) {
                case 1: for (; u + 8 <= run; u += 8) dot8_wide(qg, D, k + u * D, scale, s + u, n, 1); break;
                case 2: for (; u + 8 <= run; u += 8) dot8_wide(qg, D, k + u * D, scale, s + u, n, 2); break;
                default: for (; u + 8 <= run; u += 8) dot8_wide(qg, D, k + u * D, scale, s + u, n, 3); break;
            }
            t = u;
        }
    }
#endif
#if VECTOR_PATH
    if (D % 8 == 0)
        for (; t + 8 <= run; t += 8) dot8(q, G, D, k + t * D, scale, scores + t, n);
#endif
    for (; t < run; ++t) {
        const float *kt = k + t * D;
        for (int64_t g = 0; g < G; ++g) {
            const float *qg = q + g * D;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kt[d];
            scores[g * n + t] = dot * scale;
        }
    }
}

/* acc[g * D ..] += sum_t p[g * n + t] * v_t for the run's V rows, G query heads */
static void accumulate_rows(const float *p, int64_t n, int64_t G, int64_t D, const float *v, int64_t run, float *acc) {
#if WIDE_PATH
    if (D % 16 == 0) {
        for (int64_t g = 0; g < G; g += 3) {
            switch (G - g) {
                case 1: weighted_rows_wide(p + g * n, n, v, run, D, acc + g * D, 1); break;
                case 2: weighted_rows_wide(p + g * n, n, v, run, D, acc + g * D, 2); break;
                default: weighted_rows_wide(p + g * n, n, v, run, D, acc + g * D, 3); break;
            }
        }
        return;
    }
#endif
#if VECTOR_PATH
    if (D % 8 == 0) {
        for (int64_t g = 0; g < G; g += 4) {
            switch (G - g) {
                case 1: weighted_rows(p + g * n, n, v, run, D, acc + g * D, 1); break;
                case 2: weighted_rows(p + g * n, n, v, run, D, acc + g * D, 2); break;
                case 3: weighted_rows(p + g * n, n, v, run, D, acc + g * D, 3); break;
                default: weighted_rows(p + g * n, n, v, run, D, acc + g * D, 4); break;
            }
        }
        return;
    }
#endif
    for (int64_t t = 0; t < run; ++t) {
        const float *vt = v + t * D;
        for (int64_t g = 0; g < G; ++g) {
            float pg = p[g * n + t], *a = acc + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += pg * vt[d];
        }
    }
}

/* The softmax of each of the H rows of n scores (rows n apart), in place into the weights exp(s - max):
 * stats[2 * h] is the row's max, stats[2 * h + 1] the sum of its weights */
static void softmax_rows(float *scores, int64_t H, int64_t n, float *stats, float softcap) {
    for (int64_t h = 0; h < H; ++h) {
        float *s = scores + h * n;
        if (softcap > 0.0f)
            for (int64_t t = 0; t < n; ++t) s[t] = softcap * tanhf(s[t] / softcap);
        float max = s[0], sum = 0.0f, lanes[16];
        int64_t t = 0;
        if (n >= 16) { /* 16 running maxima side by side (a vector), then theirs */
            for (int l = 0; l < 16; ++l) lanes[l] = s[l];
            for (t = 16; t + 16 <= n; t += 16)
                for (int l = 0; l < 16; ++l) lanes[l] = s[t + l] > lanes[l] ? s[t + l] : lanes[l];
            for (int l = 0; l < 16; ++l) max = lanes[l] > max ? lanes[l] : max;
        }
        for (; t < n; ++t) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
            const float w = exp_nonpositive(s[t] - max);
            s[t] = w;
            sum += w;
        }
        stats[2 * h] = max;
        stats[2 * h + 1] = sum;
    }
}

/* One work item's tokens [start, end) of one sequence, the block table its blocks', and the layout */
struct partition {
    const int64_t *table;
    int64_t block_size, num_kv_heads, G, D, start, end;
    int format; /* cpu_cache.h */
};

/* One pass over a partition's blocks, a block run at a time and each KV head's rows of it in turn (widened from
 * fp8 or bf16 into `widened` first), the next block's rows of that head asked for meanwhile (after the
 * last run: the first block of `then`, the next pass's cache, unless NULL). The K pass (is_v 0) writes the
 * scores (rows n = end - start apart, G of each KV head in turn); the V pass (is_v 1) adds the weights in
 * their place times the V rows into acc [H, D]. */
static void pass(const struct partition *w, const float *q, float scale, const void *cache, const void *then,
                 int is_v, float *scores, float *acc, float *widened) {
    const int64_t G = w->G, D = w->D, n = w->end - w->start, head_floats = w->block_size * D;
    const int64_t head_bytes = cache_element_bytes(w->format) * head_floats, block_bytes = head_bytes * w->num_kv_heads;
    for (int64_t pos = w->start, run; pos < w->end; pos += run) {
        const int64_t block = w->table[pos / w->block_size], offset = pos % w->block_size;
        run = w->block_size - offset < w->end - pos ? w->block_size - offset : w->end - pos;
        const char *next = NULL;
        if (pos + run < w->end)
            next = (const char *)cache + w->table[(pos + run) / w->block_size] * block_bytes;
        else if (then)
            next = (const char *)then + w->table[w->start / w->block_size] * block_bytes;
        for (int64_t h = 0; h < w->num_kv_heads; ++h) {
            if (next) prefetch_bytes(next + h * head_bytes, head_bytes);
            const int64_t row = (block * w->num_kv_heads + h) * head_floats + offset * D;
            const float *rows = (const float *)cache + row;
            if (w->format != CACHE_F32) {
                widen_cache(cache, w->format, row, run * D, widened);
                rows = widened;
            }
            float *s = scores + h * G * n + (pos - w->start);
            if (is_v)
                accumulate_rows(s, n, G, D, rows, run, acc + h * G * D);
            else
                score_rows(q + h * G * D, G, D, rows, run, scale, s, n);
        }
    }
}

/* One work item: all H query heads (q [H, D]) over its partition, in two passes over its blocks with the
 * softmax between (no rescaling as a running max rises). Writes each head's max and sum (stats[2 * h],
 * stats[2 * h + 1]) and unnormalized output (acc[h * D ..]); scores holds H * (end - start) floats, widened
 * block_size * D (fp8 and bf16 caches). */
static void attend_partition(const struct partition *w, const float *q, const void *k_cache, const void *v_cache,
                             float scale, float softcap, float *scores, float *acc, float *stats, float *widened) {
    const int64_t H = w->G * w->num_kv_heads, head_bytes = cache_element_bytes(w->format) * w->block_size * w->D;
    const int64_t first = w->table[w->start / w->block_size] * head_bytes * w->num_kv_heads;
    prefetch_bytes((const char *)k_cache + first, head_bytes * w->num_kv_heads);
    pass(w, q, scale, k_cache, v_cache, 0, scores, acc, widened);
    softmax_rows(scores, H, w->end - w->start, stats, softcap);
    memset(acc, 0, sizeof(float) * H * w->D);
    pass(w, q, scale, v_cache, NULL, 1, scores, acc, widened);
}

/* The caches hold float32, fp8 e4m3 or bf16 (format: cpu_cache.h), read as stored (K/V scales are the caller's: it
 * passes scale * k_scale and multiplies the output by v_scale, as AttentionBackend.attend does).
 * Returns 0; -1 when scratch memory could not be allocated; -2 when a context length is beyond its
 * block table's width; -3 when a block id in use is outside the cache. Nothing is read from the
 * cache before these checks pass. */
int raypaged_paged_decode(const float *query, int64_t query_seq_stride, int64_t query_head_stride,
                          const void *k_cache, const void *v_cache, int format, int64_t num_blocks,
                          const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                          const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale, int num_threads) {
    return raypaged_paged_decode_windowed(query, query_seq_stride, query_head_stride, k_cache, v_cache, format,
                                          num_blocks, block_tables, table_stride, table_width, context_lens, NULL,
                                          NULL, 0.0f, out, num_seqs, num_heads, num_kv_heads, block_size, head_dim,
                                          scale, num_threads);
}

/* The first position sequence s sees (starts NULL: 0), within [0, len) */
static inline int64_t first_seen(const int64_t *starts, int64_t s, int64_t len) {
    const int64_t start = starts ? starts[s] : 0;
    return start < 0 ? 0 : (start > len ? len : start);
}

/* ``starts`` (NULL: every sequence from 0), ``sinks`` ([num_heads], NULL: none) and ``softcap`` (0: none): see the
 * top of this file. Returns as raypaged_paged_decode. */
int raypaged_paged_decode_windowed(const float *query, int64_t query_seq_stride, int64_t query_head_stride,
                                   const void *k_cache, const void *v_cache, int format, int64_t num_blocks,
                                   const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                                   const int64_t *context_lens, const int64_t *starts, const float *sinks,
                                   float softcap, float *out, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
                                   int num_threads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, H = num_heads;
    int64_t total = 0, part = PARTITION_TOKENS / block_size * block_size;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t len = context_lens[s], used = len > 0 ? (len + block_size - 1) / block_size : 0;
        if (used > table_width) return -2;
        for (int64_t j = first_seen(starts, s, len) / block_size; j < used; ++j)
            if (block_tables[s * table_stride + j] < 0 || block_tables[s * table_stride + j] >= num_blocks) return -3;
        total += len > 0 ? len - first_seen(starts, s, len) : 0;
    }
    if (total < MIN_ITEMS * part) { /* few tokens in the step: smaller partitions, so every thread has work */
        int64_t want = (total + MIN_ITEMS - 1) / MIN_ITEMS;
        want = want < MIN_PARTITION_TOKENS ? MIN_PARTITION_TOKENS : want;
        want = (want + block_size - 1) / block_size * block_size;
        part = want < part ? want : part;
    }
    if (part < block_size) part = block_size;
    /* first work item of each sequence; a sequence with more than one partition gets scratch rows */
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (first == NULL) return -1;
    int64_t items = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t seen = context_lens[s] - first_seen(starts, s, context_lens[s]);
        first[s] = items;
        items += seen > 0 ? (seen + part - 1) / part : 1;
    }
    first[num_seqs] = items;
    const int64_t per_item = H * (D + 2); /* unnormalized output, then max and sum per head */
    float *scratch = items > num_seqs ? malloc(sizeof(float) * items * per_item) : NULL;
    if (items > num_seqs && scratch == NULL) {
        free(first);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t widened_floats = format != CACHE_F32 ? block_size * D : 0;
        float *local = malloc(sizeof(float) * (H * part + 2 * H * D + 2 * H + widened_floats));
        if (local == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            if (local == NULL) continue;
            int64_t lo = 0, hi = num_seqs; /* the sequence s with first[s] <= item < first[s + 1] */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (first[mid] <= item) lo = mid; else hi = mid;
            }
            const int64_t s = lo, len = context_lens[s], parts = first[s + 1] - first[s];
            const int64_t seen_from = first_seen(starts, s, len);
            float *q = local + H * part, *acc = q + H * D, *stats = acc + H * D, *widened = stats + 2 * H;
            float *o = out + s * H * D;
            if (len - seen_from <= 0) {
                memset(o, 0, sizeof(float) * H * D);
                continue;
            }
            for (int64_t h = 0; h < H; ++h)
                memcpy(q + h * D, query + s * query_seq_stride + h * query_head_stride, sizeof(float) * D);
            const int64_t start = seen_from + (item - first[s]) * part, end = start + part < len ? start + part : len;
            const struct partition w = {
                .table = block_tables + s * table_stride, .block_size = block_size, .num_kv_heads = num_kv_heads,
                .G = G, .D = D, .start = start, .end = end, .format = format};
            if (parts == 1) {
                attend_partition(&w, q, k_cache, v_cache, scale, softcap, local, acc, stats, widened);
                for (int64_t h = 0; h < H; ++h) {
                    float keep = 1.0f, sum = stats[2 * h + 1];
                    if (sinks) { /* the sink joins the denominator: everything relative to the larger max */
                        const float max = stats[2 * h], top = sinks[h] > max ? sinks[h] : max;
                        keep = exp_nonpositive(max - top);
                        sum = sum * keep + exp_nonpositive(sinks[h] - top);
                    }
                    const float inv = keep / sum;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) o[h * D + d] = acc[h * D + d] * inv;
                }
            } else {
                float *row = scratch + item * per_item;
                attend_partition(&w, q, k_cache, v_cache, scale, softcap, local, row, row + H * D, widened);
            }
        }
        /* combine the partitions of long sequences: weights exp(max_p - max) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * H; ++item) {
            const int64_t s = item / H, h = item % H, parts = first[s + 1] - first[s];
            if (parts == 1 || context_lens[s] - first_seen(starts, s, context_lens[s]) <= 0) continue;
            float *o = out + (s * H + h) * D, max = sinks ? sinks[h] : -FLT_MAX, sum = 0.0f;
            for (int64_t p = 0; p < parts; ++p) {
                const float *stats = scratch + (first[s] + p) * per_item + H * D;
                max = stats[2 * h] > max ? stats[2 * h] : max;
            }
            if (sinks) sum = exp_nonpositive(sinks[h] - max); /* the sink's term of the denominator */
            memset(o, 0, sizeof(float) * D);
            for (int64_t p = 0; p < parts; ++p) {
                const float *row = scratch + (first[s] + p) * per_item;
                const float w = exp_nonpositive(row[H * D + 2 * h] - max);
                sum += w * row[H * D + 2 * h + 1];
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] += w * row[h * D + d];
            }
            const float inv = 1.0f / sum;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] *= inv;
        }
        free(local);
    }
    free(scratch);
    free(first);
    return failed ? -1 : 0;
}
