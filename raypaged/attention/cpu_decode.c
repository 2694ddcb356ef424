/* Paged decode attention on CPU, fp32: one query token per sequence attends to its first
 * context_lens[s] cached tokens, read straight through its block table (no gather copy).
 *
 * Cache layout per layer (as raypaged.attention.torch_ops): [num_blocks, num_kv_heads,
 * block_size, head_dim], contiguous. The query is [num_seqs, num_heads, head_dim] with any
 * row strides and a contiguous last dimension; the output is [num_seqs, num_heads, head_dim],
 * contiguous. Query heads h * G .. h * G + G - 1 share KV head h (G = num_heads / num_kv_heads).
 *
 * Work items are (sequence, context partition, KV head): each reads its K and V rows once for
 * all G query heads. A sequence longer than one partition (PARTITION_TOKENS, rounded to whole
 * blocks) is split so that few long sequences still use every thread; its partitions keep
 * their running max, sum and unnormalized output, and a second pass combines them.
 *
 * Blocks lie anywhere in the pool, a few KiB each, so the hardware prefetcher loses the stream at
 * every block: a work item asks for all its K rows before the first dot product and for each
 * block's V rows while it scores that block's K (from a 1 GiB pool on 2 AVX-512 EPYC cores, 11.7
 * -> 15.1 GB/s on 4 KiB pages, 14 -> 20.6 GB/s on the huge pages the worker gives the CPU cache).
 *
 * Built by raypaged.attention.cpu_ops with the host's compiler and OpenMP (torch's own libgomp,
 * so both share one thread pool).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"

#define PARTITION_TOKENS 512

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

/* Asks for the bytes [p, p + bytes) ahead of use: a block's rows lie 4 KiB or so apart from the
 * next block's, beyond where the hardware prefetcher follows a stream. */
static inline void prefetch(const float *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
}

/* The tokens from pos to the end of its block or at end, whichever is first; *row: where the first
 * one's row of KV head `head` lies in a cache (in floats). */
static inline int64_t block_run(const int64_t *table, int64_t pos, int64_t end, int64_t head, int64_t num_kv_heads,
                                int64_t block_size, int64_t D, int64_t *row) {
    int64_t block = table[pos / block_size], offset = pos % block_size;
    *row = ((block * num_kv_heads + head) * block_size + offset) * D;
    return block_size - offset < end - pos ? block_size - offset : end - pos;
}

/* One work item: G query heads over tokens [start, end) of one sequence. Writes the partition's
 * max and sum per head (stats[2 * g], stats[2 * g + 1]) and its unnormalized output acc[g * D ..]. */
static void attend_partition(const float *q, int64_t G, int64_t D, const float *k_cache, const float *v_cache,
                             const int64_t *table, int64_t head, int64_t num_kv_heads, int64_t block_size,
                             int64_t start, int64_t end, float scale, float *scores, float *acc, float *stats) {
    const int64_t n = end - start;
    const int vector = VECTOR_PATH && D % 8 == 0;
    int64_t run, row;
    for (int64_t pos = start; pos < end; pos += run) { /* every K row of the partition asked for at once */
        run = block_run(table, pos, end, head, num_kv_heads, block_size, D, &row);
        prefetch(k_cache + row, sizeof(float) * run * D);
    }
    for (int64_t pos = start; pos < end; pos += run) {
        run = block_run(table, pos, end, head, num_kv_heads, block_size, D, &row);
        const float *rows = k_cache + row;
        prefetch(v_cache + row, sizeof(float) * run * D);
        int64_t t = 0;
#if VECTOR_PATH
        if (vector)
            for (; t + 8 <= run; t += 8) dot8(q, G, D, rows + t * D, scale, scores + pos - start + t, n);
#endif
        for (; t < run; ++t) {
            const float *k = rows + t * D;
            for (int64_t g = 0; g < G; ++g) {
                const float *qg = q + g * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
                scores[g * n + pos - start + t] = dot * scale;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float *s = scores + g * n, max = -FLT_MAX, sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) max = s[t] > max ? s[t] : max;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
            s[t] = exp_nonpositive(s[t] - max);
            sum += s[t];
        }
        stats[2 * g] = max;
        stats[2 * g + 1] = sum;
    }
    memset(acc, 0, sizeof(float) * G * D);
    for (int64_t pos = start; pos < end; pos += run) {
        run = block_run(table, pos, end, head, num_kv_heads, block_size, D, &row);
        const float *rows = v_cache + row;
        const float *p = scores + pos - start;
#if VECTOR_PATH
        if (vector) {
            int64_t g = 0;
            for (; g + 4 <= G; g += 4) weighted_rows(p + g * n, n, rows, run, D, acc + g * D, 4);
            switch (G - g) {
                case 3: weighted_rows(p + g * n, n, rows, run, D, acc + g * D, 3); break;
                case 2: weighted_rows(p + g * n, n, rows, run, D, acc + g * D, 2); break;
                case 1: weighted_rows(p + g * n, n, rows, run, D, acc + g * D, 1); break;
                default: break;
            }
            continue;
        }
#endif
        for (int64_t t = 0; t < run; ++t) {
            const float *v = rows + t * D;
            for (int64_t g = 0; g < G; ++g) {
                float pg = p[g * n + t], *a = acc + g * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) a[d] += pg * v[d];
            }
        }
    }
}

/* Returns 0; -1 when scratch memory could not be allocated; -2 when a context length is beyond its
 * block table's width; -3 when a block id in use is outside the cache. Nothing is read from the
 * cache before these checks pass. */
int raypaged_paged_decode_f32(const float *query, int64_t query_seq_stride, int64_t query_head_stride,
                              const float *k_cache, const float *v_cache, int64_t num_blocks,
                              const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                              const int64_t *context_lens, float *out, int64_t num_seqs,
                              int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                              float scale, int num_threads) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t len = context_lens[s], used = len > 0 ? (len + block_size - 1) / block_size : 0;
        if (used > table_width) return -2;
        for (int64_t j = 0; j < used; ++j)
            if (block_tables[s * table_stride + j] < 0 || block_tables[s * table_stride + j] >= num_blocks) return -3;
    }
    int64_t part = PARTITION_TOKENS / block_size * block_size;
    if (part < block_size) part = block_size;
    /* first work item of each sequence; a sequence with more than one partition gets scratch rows */
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (first == NULL) return -1;
    int64_t items = 0, max_len = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        int64_t len = context_lens[s], parts = len > 0 ? (len + part - 1) / part : 1;
        first[s] = items;
        items += parts;
        max_len = len > max_len ? len : max_len;
    }
    first[num_seqs] = items;
    const int64_t per_item = G * (D + 2); /* unnormalized output, then max and sum per head */
    float *scratch = items > num_seqs ? malloc(sizeof(float) * items * num_kv_heads * per_item) : NULL;
    if (items > num_seqs && scratch == NULL) {
        free(first);
        return -1;
    }
    const int64_t work_tokens = max_len < part ? (max_len > 0 ? max_len : 1) : part;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *local = malloc(sizeof(float) * (G * work_tokens + G * D + 2 * G + G * D));
        if (local == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items * num_kv_heads; ++item) {
            if (local == NULL) continue;
            int64_t flat = item / num_kv_heads, head = item % num_kv_heads;
            int64_t lo = 0, hi = num_seqs; /* the sequence s with first[s] <= flat < first[s + 1] */
            while (hi - lo > 1) {
                int64_t mid = (lo + hi) / 2;
                if (first[mid] <= flat) lo = mid; else hi = mid;
            }
            int64_t s = lo, index = flat - first[s], len = context_lens[s];
            int64_t parts = first[s + 1] - first[s];
            float *qg = local + G * work_tokens, *stats = qg + G * D, *acc = stats + 2 * G;
            float *o = out + (s * num_heads + head * G) * D;
            if (len <= 0) {
                memset(o, 0, sizeof(float) * G * D);
                continue;
            }
            for (int64_t g = 0; g < G; ++g)
                memcpy(qg + g * D, query + s * query_seq_stride + (head * G + g) * query_head_stride,
                       sizeof(float) * D);
            int64_t start = index * part, end = start + part < len ? start + part : len;
            if (parts == 1) {
                attend_partition(qg, G, D, k_cache, v_cache, block_tables + s * table_stride, head, num_kv_heads,
                                 block_size, start, end, scale, local, acc, stats);
                for (int64_t g = 0; g < G; ++g) {
                    float inv = 1.0f / stats[2 * g + 1];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) o[g * D + d] = acc[g * D + d] * inv;
                }
            } else {
                float *row = scratch + (flat * num_kv_heads + head) * per_item;
                attend_partition(qg, G, D, k_cache, v_cache, block_tables + s * table_stride, head, num_kv_heads,
                                 block_size, start, end, scale, local, row, row + G * D);
            }
        }
        /* combine the partitions of long sequences: weights exp(max_p - max) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
            int64_t s = item / num_kv_heads, head = item % num_kv_heads, parts = first[s + 1] - first[s];
            if (parts == 1 || context_lens[s] <= 0) continue;
            float *o = out + (s * num_heads + head * G) * D;
            for (int64_t g = 0; g < G; ++g) {
                float max = -FLT_MAX, sum = 0.0f;
                for (int64_t p = 0; p < parts; ++p) {
                    const float *stats = scratch + ((first[s] + p) * num_kv_heads + head) * per_item + G * D;
                    max = stats[2 * g] > max ? stats[2 * g] : max;
                }
                memset(o + g * D, 0, sizeof(float) * D);
                for (int64_t p = 0; p < parts; ++p) {
                    const float *row = scratch + ((first[s] + p) * num_kv_heads + head) * per_item;
                    float w = exp_nonpositive(row[G * D + 2 * g] - max);
                    sum += w * row[G * D + 2 * g + 1];
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) o[g * D + d] += w * row[g * D + d];
                }
                float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[g * D + d] *= inv;
            }
        }
        free(local);
    }
    free(scratch);
    free(first);
    return failed ? -1 : 0;
}
