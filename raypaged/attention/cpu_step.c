/* A step's decoder layers on CPU in one call (raypaged.model.cpu_step): the same kernels, in the same order, as
 * LlamaDecoderLayer's fused path runs them one Python call at a time, so the same bits. A step is its decode
 * tokens (one per sequence) first, then the prefill spans' tokens, if any, back to back.
 *
 * A layer: x = norm(residual += x) (the first layer: residual = x, x = norm(x)); qkv = x W_qkv; q and k (each
 * head normed first where the model has q/k norms) rotated (the first rotary_dim features of each head) and
 * this step's K/V written to their slots; attention over the cache (the decode kernel for the decode tokens,
 * the varlen prefill kernel for the spans); x = attn W_o; x = norm(residual += x); h = silu(gate) * up from the
 * gated gate | up weight; x = h W_down. After the last: x = norm(residual += x). Where residual_scale is not 1
 * (Granite's residual_multiplier), x is multiplied by it after W_o and after W_down, before its residual add.
 *
 * A projection is fp32 (cpu_gemm.c) or W8A8 int8 (cpu_int8.c, quantizing the activations first), each as its
 * Python path runs it; a gate | up one packed gated, its SiLU stored from the GEMM's tiles. Called from
 * Python, each of those is a ctypes call behind its argument checks and a module call: about 3 ms of
 * SmolLM2's 26 ms decode step at 32 sequences on 2 cores.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"

/* A step's prefill spans (cpu_prefill.c's varlen inputs): span s owns tokens query_start + cu_seqlens_q[s] ..
 * query_start + cu_seqlens_q[s + 1] - 1, with context_lens[s] tokens in the cache (its own included) through its
 * row of block_tables (rows table_stride apart, table_width wide) */
struct step_prefill {
    const int32_t *cu_seqlens_q, *context_lens;
    const int64_t *block_tables;
    int64_t table_stride, table_width, num_spans, query_start, num_tokens;
};

/* One projection: an fp32 weight packed for cpu_gemm.c (colsum NULL; bf16 nonzero: its bf16 layout), or an int8
 * one packed for cpu_int8.c's VNNI GEMM (colsum its packed columns' sums, weight_scale [n], input_scale > 0 a
 * static activation scale or 0 for per-token scales); a gate | up one packed gated; bias NULL where none */
struct step_linear {
    const void *weight;
    const float *bias;
    const int32_t *colsum;
    const float *weight_scale;
    float input_scale;
    int bf16;
};

/* One layer's norms (q_norm, k_norm: per head over q and k before rotary, as Qwen3's; NULL where none),
 * projections, KV caches and their scales (an fp8 cache holds k / k_scale and v / v_scale; 1 otherwise); nope: its q
 * and k go unrotated (SmolLM3's NoPE layers) */
struct step_layer {
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    struct step_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    float k_scale, v_scale;
    int nope;
};

/* The model's shape and the cache's */
struct step_shape {
    int64_t hidden, num_heads, num_kv_heads, head_dim, rotary_dim, intermediate, block_size, num_blocks,
        max_positions;
    float eps, scale, residual_scale;
    int cache_format; /* cpu_cache.h */
};

/* x [n] *= scale, as torch's x.mul_(scale) (nothing at 1) */
static void scale_rows(float *x, int64_t n, float scale, int threads) {
    if (scale == 1.0f) return;
#pragma omp parallel for simd num_threads(threads) if (n >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

/* Scratch for the int8 projections: x quantized and its per-token scales */
struct int8_scratch {
    int8_t *xq;
    float *scales;
};

/* y [m, n] = x [m, k] @ W^T (+ bias) as the layer's Python path runs the projection (layers.linear, or
 * w8a8.int8_linear and then QuantLinear's bias add); silu (a gate | up, packed gated): y [m, n / 2] =
 * silu(gate) * up, stored from the GEMM's tiles. Returns 0, or -20 when the int8 or bf16 GEMM has no scratch. */
static int project(const struct step_linear *l, const float *x, int64_t m, int64_t k, int64_t n, float *y, int silu,
                   const struct int8_scratch *s, int threads, const struct step_linear *then, int64_t then_k,
                   int64_t then_n, int then_gated) {
    if (!l->colsum) {
        /* the next projection's first panels asked for meanwhile, where it is a float one too */
        const struct linear_next next = {.packed = then ? then->weight : NULL, .k = then_k, .n = then_n,
                                         .gated = then_gated, .bf16 = then ? then->bf16 : 0};
        const struct linear_next *after = then && !then->colsum ? &next : NULL;
        if (l->bf16)
            return raypaged_linear_bf16_then(x, m, k, k, l->weight, n, l->bias, y, silu ? n / 2 : n, silu ? 2 : 0,
                                             threads, after)
                       ? -20
                       : 0;
        raypaged_linear_f32_then(x, m, k, k, l->weight, n, l->bias, y, silu ? n / 2 : n, silu ? 2 : 0, threads, after);
        return 0;
    }
    const int fixed = l->input_scale > 0.0f;
    raypaged_quantize_int8_f32(x, k, m, k, fixed ? l->input_scale : 0.0f, s->xq, s->scales, threads);
    if (raypaged_int8_linear_f32(s->xq, m, k, k, l->weight, l->colsum, n, fixed ? &l->input_scale : s->scales,
                                 fixed ? 0 : 1, l->weight_scale, l->bias, y, silu ? n / 2 : n, silu ? 2 : 0, threads))
        return -20;
    if (l->bias && !silu)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < n; ++j) y[r * n + j] += l->bias[j];
    return 0;
}

/* num_layers >= 1 (raypaged.model.cpu_step takes no model without layers).
 * x [tokens, hidden]: the embeddings in, the final norm's output out; residual, qkv, attn and h: scratch of
 * [tokens, hidden], [tokens, (heads + 2 kv_heads) head_dim], [tokens, heads * head_dim], [tokens, intermediate].
 * The first num_decodes tokens are decodes (block_tables and context_lens: num_decodes rows); prefill (NULL:
 * none) the spans after them (query_start == num_decodes, num_tokens == tokens - num_decodes).
 * Returns 0, or the first failure: the rotary kernel's status - 10 (-11: a position outside the table, -12: a
 * slot outside the cache), the decode kernel's (-1 memory, -2 a context past its table, -3 a bad block id),
 * -20 (the int8 or bf16 GEMM's scratch memory), or the prefill kernel's status - 30 (-31 .. -35, as
 * cpu_prefill.c's). */
int raypaged_step_layers(const struct step_layer *layers, int64_t num_layers, const struct step_shape *s,
                         const float *final_norm, float *x, float *residual, int64_t tokens, const int64_t *positions,
                         const int64_t *slots, const float *cos_sin, int64_t num_decodes, const int64_t *block_tables,
                         int64_t table_stride, int64_t table_width, const int64_t *context_lens,
                         const struct step_prefill *prefill, float *qkv, float *attn, float *h, int threads) {
    const int64_t D = s->head_dim, q_width = s->num_heads * D, kv_width = s->num_kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width, widest = s->intermediate > q_width ? s->intermediate : q_width;
    struct int8_scratch scratch = {
        .xq = malloc((size_t)(tokens * (widest > s->hidden ? widest : s->hidden))),
        .scales = malloc(sizeof(float) * (size_t)tokens),
    };
    float *normed = malloc(sizeof(float) * (size_t)(tokens * (q_width + kv_width))); /* q, k after their norms */
    int status = scratch.xq && scratch.scales && normed ? 0 : -20;
    for (int64_t i = 0; i < num_layers && !status; ++i) {
        const struct step_layer *l = &layers[i];
        if (i == 0) {
            memcpy(residual, x, sizeof(float) * tokens * s->hidden);
            raypaged_rms_norm_f32(residual, s->hidden, 0, l->input_norm, x, tokens, 1, s->hidden, s->eps, threads);
        } else {
            raypaged_fused_add_rms_norm_f32(x, residual, l->input_norm, tokens, s->hidden, s->eps, threads);
        }
        if ((status = project(&l->qkv, x, tokens, s->hidden, qkv_width, qkv, 0, &scratch, threads, &l->o, q_width,
                              s->hidden, 0)))
            break;
        float *q = qkv, *k = qkv + q_width;
        int64_t q_stride = qkv_width, k_stride = qkv_width;
        if (l->q_norm) { /* into rows of their own, as cpu_fused.rms_norm returns them */
            q = normed, k = normed + tokens * q_width, q_stride = q_width, k_stride = kv_width;
            raypaged_rms_norm_f32(qkv, qkv_width, D, l->q_norm, q, tokens, s->num_heads, D, s->eps, threads);
            raypaged_rms_norm_f32(qkv + q_width, qkv_width, D, l->k_norm, k, tokens, s->num_kv_heads, D, s->eps,
                                  threads);
        }
        status = raypaged_rotary_and_cache_f32(positions, q, q_stride, k, k_stride, qkv + q_width + kv_width, qkv_width,
                                               cos_sin, s->max_positions, l->k_cache, l->v_cache, s->cache_format,
                                               l->k_scale, l->v_scale, s->num_blocks, slots, tokens, s->num_heads,
                                               s->num_kv_heads, D, l->nope ? 0 : s->rotary_dim, s->block_size,
                                               threads); /* rotating 0 features: the cache write alone */
        if (status) {
            status -= 10;
            break;
        }
        /* the scales fold into the attention as AttentionBackend.attend folds them: every token's reads the cache */
        const float cached_scale = s->scale * l->k_scale;
        if (num_decodes > 0)
            status = raypaged_paged_decode(q, q_stride, D, l->k_cache, l->v_cache, s->cache_format, s->num_blocks,
                                           block_tables, table_stride, table_width, context_lens, attn, num_decodes,
                                           s->num_heads, s->num_kv_heads, s->block_size, D, cached_scale, threads);
        if (status) break;
        if (prefill) {
            const int64_t first = prefill->query_start;
            status = raypaged_paged_prefill(q + first * q_stride, q_stride, D, prefill->num_tokens, l->k_cache,
                                            l->v_cache, s->cache_format, s->num_blocks, prefill->cu_seqlens_q,
                                            prefill->context_lens, prefill->block_tables, prefill->table_stride,
                                            prefill->table_width, attn + first * q_width, prefill->num_spans,
                                            s->num_heads, s->num_kv_heads, s->block_size, D, cached_scale, threads);
            if (status) {
                status -= 30;
                break;
            }
        }
        if (l->v_scale != 1.0f)
            for (int64_t i = 0; i < tokens * q_width; ++i) attn[i] *= l->v_scale;
        if ((status = project(&l->o, attn, tokens, q_width, s->hidden, x, 0, &scratch, threads, &l->gate_up, s->hidden,
                              2 * s->intermediate, 1)))
            break;
        scale_rows(x, tokens * s->hidden, s->residual_scale, threads);
        raypaged_fused_add_rms_norm_f32(x, residual, l->post_norm, tokens, s->hidden, s->eps, threads);
        if ((status = project(&l->gate_up, x, tokens, s->hidden, 2 * s->intermediate, h, 1, &scratch, threads,
                              &l->down, s->intermediate, s->hidden, 0)))
            break;
        status = project(&l->down, h, tokens, s->intermediate, s->hidden, x, 0, &scratch, threads,
                         i + 1 < num_layers ? &layers[i + 1].qkv : NULL, s->hidden, qkv_width, 0);
        scale_rows(x, tokens * s->hidden, s->residual_scale, threads);
    }
    free(scratch.xq);
    free(scratch.scales);
    free(normed);
    if (status) return status;
    raypaged_fused_add_rms_norm_f32(x, residual, final_norm, tokens, s->hidden, s->eps, threads);
    return 0;
}
