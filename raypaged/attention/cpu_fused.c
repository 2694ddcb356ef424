/* The model step's elementwise work on CPU, fp32, one pass each: the CPU side of the fused path
 * (raypaged.attention.cpu_fused; the CUDA side is kernels/fused_ops.cu). References:
 * raypaged.model.layers' rms_norm, add_rms_norm, silu_and_mul and RotaryEmbedding.rotate_
 * followed by reshape_and_cache.
 *
 * At a decode step's sizes torch spends more on dispatching its small ops (about 20 a layer) than
 * on the arithmetic; at a prefill's the separate passes each stream the activations through
 * memory. Rows are shared among OpenMP threads (torch's own pool) only when a call has enough
 * elements to pay for waking them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_cache.h"
#include "cpu_silu.h"

#define PARALLEL_ELEMENTS 65536

/* out = w * (x / sqrt(mean(x^2) + eps)) over one row of n */
static inline void norm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t d = 0; d < n; ++d) squares += x[d] * x[d];
    const float inv = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) out[d] = w[d] * (x[d] * inv);
}

/* out[r, h] = norm(x[r * row_stride + h * head_stride]) for rows x heads vectors of n, out contiguous */
void raypaged_rms_norm_f32(const float *x, int64_t row_stride, int64_t head_stride, const float *w, float *out,
                           int64_t rows, int64_t heads, int64_t n, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * heads * n >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t h = 0; h < heads; ++h)
            norm_row(x + r * row_stride + h * head_stride, w, out + (r * heads + h) * n, n, eps);
}

/* residual += x; x = norm(residual), row by row ([rows, n], contiguous) */
void raypaged_fused_add_rms_norm_f32(float *x, float *residual, const float *w, int64_t rows, int64_t n, float eps,
                                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = x + r * n, *res = residual + r * n;
#pragma omp simd
        for (int64_t d = 0; d < n; ++d) res[d] += xr[d];
        norm_row(res, w, xr, n, eps);
    }
}

/* out[r] = silu(x[r, :n]) * x[r, n:] */
void raypaged_silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t n, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) silu_mul_row(x + r * 2 * n, x + r * 2 * n + n, out + r * n, n);
}

/* x1, x2 (the halves of one head of 2 * half) -> x1 cos - x2 sin, x2 cos + x1 sin, rounded as
 * RotaryEmbedding.rotate_ rounds them (each product alone, no fused multiply-add) */
__attribute__((optimize("fp-contract=off"))) static inline void rotate_head(float *x, const float *cos,
                                                                           const float *sin, int64_t half) {
    float *x1 = x, *x2 = x + half;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
        const float a = x1[d], b = x2[d], c = cos[d], s = sin[d];
        const float a_sin = a * s, b_sin = b * s, a_cos = a * c, b_cos = b * c;
        x1[d] = a_cos - b_sin;
        x2[d] = b_cos + a_sin;
    }
}

/* One head's row into a cache of `format` (cpu_cache.h): a copy; divided by the layer's scale and narrowed to fp8
 * e4m3 as torch's (x / scale).to(torch.float8_e4m3fn); or rounded to bf16 as torch's x.to(torch.bfloat16) */
static inline void cache_row(void *cache, int64_t row, const float *x, int64_t D, int format, float scale) {
    if (format == CACHE_FP8_E4M3) {
        uint8_t *dst = (uint8_t *)cache + row;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_fp8_e4m3(x[d] / scale);
    } else if (format == CACHE_BF16) {
        uint16_t *dst = (uint16_t *)cache + row;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_bf16(x[d]);
    } else {
        memcpy((float *)cache + row, x, sizeof(float) * D);
    }
}

/* Rotates the first R features of each head of q (heads of D at q + t * q_stride) and k in place by each
 * token's position (R = D but for a partial rotation, as Phi-3's; the others pass), then writes the whole
 * k and v of each token with a slot >= 0 into the caches ([blocks, kv_heads, block_size, D]; float32, bf16, or fp8
 * e4m3 holding k / k_scale and v / v_scale, as format says: cpu_cache.h). Returns 0; -1 when a position is outside
 * cos_sin ([max_positions, 2, R / 2]); -2 when a slot is outside the cache. Nothing is written before these
 * checks pass. */
int raypaged_rotary_and_cache_f32(const int64_t *positions, float *q, int64_t q_stride, float *k, int64_t k_stride,
                                  const float *v, int64_t v_stride, const float *cos_sin, int64_t max_positions,
                                  void *k_cache, void *v_cache, int format, float k_scale, float v_scale,
                                  int64_t num_blocks, const int64_t *slots, int64_t tokens, int64_t heads,
                                  int64_t kv_heads, int64_t D, int64_t R, int64_t block_size, int num_threads) {
    for (int64_t t = 0; t < tokens; ++t) {
        if (positions[t] < 0 || positions[t] >= max_positions) return -1;
        if (slots[t] >= num_blocks * block_size) return -2;
    }
    const int64_t half = R / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * (heads + 2 * kv_heads) * D >= PARALLEL_ELEMENTS) \
    schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *cos = cos_sin + positions[t] * R, *sin = cos + half;
        for (int64_t h = 0; h < heads; ++h) rotate_head(q + t * q_stride + h * D, cos, sin, half);
        float *kt = k + t * k_stride;
        for (int64_t h = 0; h < kv_heads; ++h) rotate_head(kt + h * D, cos, sin, half);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t block = slot / block_size, offset = slot % block_size;
        for (int64_t h = 0; h < kv_heads; ++h) {
            const int64_t row = ((block * kv_heads + h) * block_size + offset) * D;
            cache_row(k_cache, row, kt + h * D, D, format, k_scale);
            cache_row(v_cache, row, v + t * v_stride + h * D, D, format, v_scale);
        }
    }
    return 0;
}

/* out[r * cols + c] = fp8(w[r * cols + c]) * scale[r * scale_row_stride + c / group] for r < rows, c < cols: an fp8
 * e4m3 weight dequantized as torch's weight.to(torch.float32) * scale (the widening exact, one rounding in the
 * product), for the fp8 linears' float GEMM. group: inputs per scale (cols: one scale per row); scale_row_stride:
 * scales per row (0: one scale for every row). */
void raypaged_dequantize_fp8_f32(const uint8_t *w, int64_t rows, int64_t cols, const float *scale,
                                 int64_t scale_row_stride, int64_t group, float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float *o = out + r * cols;
        const float *s = scale + r * scale_row_stride;
        widen_fp8_e4m3(w + r * cols, cols, o);
        for (int64_t c0 = 0; c0 < cols; c0 += group) {
            const int64_t end = c0 + group < cols ? c0 + group : cols;
            const float g = s[c0 / group];
#pragma omp simd
            for (int64_t c = c0; c < end; ++c) o[c] *= g;
        }
    }
}

/* out = x quantized to fp8 e4m3 and back, per row and group of `group` inputs (group >= cols: per row), as
 * torch's quantize-then-dequantize of the fp8 linears: scale = max(amax, min_scale) / 448 (or `fixed` when
 * positive: one scale for everything), q = fp8(clamp(x / scale, -448, 448)), out = float(q) * scale. The
 * same operations in the same order, so the same bits, NaN and infinities included (a NaN in a group makes
 * its scale NaN, as torch's amax does). */
void raypaged_fake_quantize_fp8_f32(const float *x, int64_t rows, int64_t cols, int64_t ldx, int64_t group,
                                    float fixed, float min_scale, float *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * ldx;
        float *o = out + r * cols;
        for (int64_t c0 = 0; c0 < cols; c0 += group) {
            const int64_t end = c0 + group < cols ? c0 + group : cols;
            float scale = fixed;
            if (!(fixed > 0.0f)) {
                float amax = 0.0f;
                int nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
                for (int64_t c = c0; c < end; ++c) {
                    const float a = fabsf(xr[c]);
                    nan |= a != a;
                    amax = a > amax ? a : amax;
                }
                amax = nan ? __builtin_nanf("") : (amax < min_scale ? min_scale : amax);
                scale = amax / 448.0f;
            }
#pragma omp simd
            for (int64_t c = c0; c < end; ++c) {
                float v = xr[c] / scale;
                v = v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);
                o[c] = fp8_e4m3_to_f32(f32_to_fp8_e4m3(v)) * scale;
            }
        }
    }
}
