/* A decode step's decoder layers on CPU in one call (raypaged.model.cpu_step): the same kernels, in the same
 * order, as LlamaDecoderLayer's fused path runs them one Python call at a time, so the same bits.
 *
 * A layer: x = norm(residual += x) (the first layer: residual = x, x = norm(x)); qkv = x W_qkv; q and k rotated
 * and this step's K/V written to their slots; attention over the cache; x = attn W_o; x = norm(residual += x);
 * h = silu(gate) * up from the gated gate | up weight; x = h W_down. After the last: x = norm(residual += x).
 *
 * Called from Python, each of those is a ctypes call behind its argument checks and a module call: about 3 ms of
 * SmolLM2's 26 ms decode step at 32 sequences on 2 cores, and 2.5 of 13 at one sequence.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_api.h"

/* One layer's weights (packed for cpu_gemm.c; gate_up gated; biases NULL where none) and KV caches */
struct decode_layer {
    const float *input_norm, *post_norm;
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    void *k_cache, *v_cache;
};

/* The model's shape and the cache's */
struct decode_shape {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, num_blocks, max_positions;
    float eps, scale;
    int fp8;
};

/* x [tokens, hidden]: the embeddings in, the final norm's output out; residual, qkv, attn and h: scratch of
 * [tokens, hidden], [tokens, (heads + 2 kv_heads) head_dim], [tokens, heads * head_dim], [tokens, intermediate].
 * Returns 0, or the first failure: the rotary kernel's status - 10 (-11: a position outside the table, -12: a
 * slot outside the cache), or the decode kernel's (-1 memory, -2 a context past its table, -3 a bad block id). */
int raypaged_decode_layers(const struct decode_layer *layers, int64_t num_layers, const struct decode_shape *s,
                           const float *final_norm, float *x, float *residual, int64_t tokens, const int64_t *positions,
                           const int64_t *slots, const float *cos_sin, const int64_t *block_tables,
                           int64_t table_stride, int64_t table_width, const int64_t *context_lens, float *qkv,
                           float *attn, float *h, int threads) {
    const int64_t D = s->head_dim, q_width = s->num_heads * D, kv_width = s->num_kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width;
    for (int64_t i = 0; i < num_layers; ++i) {
        const struct decode_layer *l = &layers[i];
        if (i == 0) {
            memcpy(residual, x, sizeof(float) * tokens * s->hidden);
            raypaged_rms_norm_f32(residual, s->hidden, 0, l->input_norm, x, tokens, 1, s->hidden, s->eps, threads);
        } else {
            raypaged_fused_add_rms_norm_f32(x, residual, l->input_norm, tokens, s->hidden, s->eps, threads);
        }
        raypaged_linear_f32(x, tokens, s->hidden, s->hidden, l->qkv, qkv_width, l->qkv_bias, qkv, qkv_width, 0,
                            threads);
        int status = raypaged_rotary_and_cache_f32(
            positions, qkv, qkv_width, qkv + q_width, qkv_width, qkv + q_width + kv_width, qkv_width, cos_sin,
            s->max_positions, l->k_cache, l->v_cache, s->fp8, s->num_blocks, slots, tokens, s->num_heads,
            s->num_kv_heads, D, s->block_size, threads);
        if (status) return status - 10;
        status = raypaged_paged_decode(qkv, qkv_width, D, l->k_cache, l->v_cache, s->fp8, s->num_blocks, block_tables,
                                       table_stride, table_width, context_lens, attn, tokens, s->num_heads,
                                       s->num_kv_heads, s->block_size, D, s->scale, threads);
        if (status) return status;
        raypaged_linear_f32(attn, tokens, q_width, q_width, l->o, s->hidden, l->o_bias, x, s->hidden, 0, threads);
        raypaged_fused_add_rms_norm_f32(x, residual, l->post_norm, tokens, s->hidden, s->eps, threads);
        raypaged_linear_f32(x, tokens, s->hidden, s->hidden, l->gate_up, 2 * s->intermediate, l->gate_up_bias, h,
                            s->intermediate, 2, threads);
        raypaged_linear_f32(h, tokens, s->intermediate, s->intermediate, l->down, s->hidden, l->down_bias, x,
                            s->hidden, 0, threads);
    }
    if (num_layers == 0)
        raypaged_rms_norm_f32(x, s->hidden, 0, final_norm, x, tokens, 1, s->hidden, s->eps, threads);
    else
        raypaged_fused_add_rms_norm_f32(x, residual, final_norm, tokens, s->hidden, s->eps, threads);
    return 0;
}
