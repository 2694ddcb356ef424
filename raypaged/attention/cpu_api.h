/* The CPU kernels that cpu_step.c calls from C, declared once for their definitions (cpu_decode.c, cpu_prefill.c,
 * cpu_fused.c, cpu_gemm.c, cpu_int8.c) and their callers to be checked against. Python calls them through ctypes
 * (cpu_ops._SIGNATURES). */
#ifndef RAYPAGED_CPU_API_H
#define RAYPAGED_CPU_API_H

#include <stdint.h>

int raypaged_paged_decode(const float *query, int64_t query_seq_stride, int64_t query_head_stride,
                          const void *k_cache, const void *v_cache, int format, int64_t num_blocks,
                          const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                          const int64_t *context_lens, float *out, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale, int num_threads);

int raypaged_paged_decode_windowed(const float *query, int64_t query_seq_stride, int64_t query_head_stride,
                                   const void *k_cache, const void *v_cache, int format, int64_t num_blocks,
                                   const int64_t *block_tables, int64_t table_stride, int64_t table_width,
                                   const int64_t *context_lens, const int64_t *starts, const float *sinks,
                                   float softcap, float *out, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t block_size, int64_t head_dim, float scale,
                                   int num_threads);

int raypaged_paged_prefill(const float *query, int64_t query_token_stride, int64_t query_head_stride,
                           int64_t num_tokens, const void *k_cache, const void *v_cache, int format, int64_t num_blocks,
                           const int32_t *cu_seqlens_q, const int32_t *context_lens, const int64_t *block_tables,
                           int64_t table_stride, int64_t table_width, float *out, int64_t num_spans,
                           int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                           float scale, int num_threads);

void raypaged_rms_norm_f32(const float *x, int64_t row_stride, int64_t head_stride, const float *w, float *out,
                           int64_t rows, int64_t heads, int64_t n, float eps, int num_threads);

void raypaged_fused_add_rms_norm_f32(float *x, float *residual, const float *w, int64_t rows, int64_t n, float eps,
                                     int num_threads);

int raypaged_rotary_and_cache_f32(const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
                                  const float *v, int64_t v_stride, const float *cos_sin, int64_t max_positions,
                                  void *k_cache, void *v_cache, int format, float k_scale, float v_scale,
                                  int64_t num_blocks, const int64_t *slots, int64_t tokens, int64_t heads,
                                  int64_t kv_heads, int64_t D, int64_t R, int64_t block_size, int num_threads);

void raypaged_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t n, int num_threads);

void raypaged_quantize_int8_f32(const float *x, int64_t x_stride, int64_t rows, int64_t k, float fixed_scale,
                                int8_t *q, float *scales, int num_threads);

int raypaged_int8_linear_f32(const int8_t *x_q, int64_t m, int64_t k, int64_t ldx, const int8_t *packed,
                             const int32_t *colsum, int64_t n, const float *x_scales, int64_t x_scale_stride,
                             const float *w_scales, const float *bias, float *y, int64_t ldy, int gated,
                             int num_threads);

void raypaged_linear_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                         const float *bias, float *y, int64_t ldy, int gated, int threads);

/* The linear that runs next (cpu_gemm.c: raypaged_linear_f32_then, raypaged_linear_bf16_then): its packed
 * weight, in and out features, gated (nonzero: packed gated), bf16 (nonzero: raypaged_pack_weight_bf16's layout) */
struct linear_next {
    const void *packed;
    int64_t k, n;
    int gated, bf16;
};

void raypaged_linear_f32_then(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                              const float *bias, float *y, int64_t ldy, int gated, int threads,
                              const struct linear_next *then);

/* The same product from a weight of bf16 values packed by raypaged_pack_weight_bf16: 0, or -1 without scratch memory */
int raypaged_linear_bf16_then(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                              const float *bias, float *y, int64_t ldy, int gated, int threads,
                              const struct linear_next *then);

#endif
