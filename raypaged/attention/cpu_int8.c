/* The int8 W8A8 linear on CPU (raypaged.quantization.w8a8.int8_linear). Its float ends, one pass each, bit
 * for bit as its torch reference: quantizing the activations before torch._int_mm and scaling its int32
 * products after, in place of about eight torch ops (per projection at SmolLM2's shapes on 2 AVX-512 EPYC
 * cores: 1.2-1.4x faster from 1 to 32 rows, 1.1x at 256). And, where the CPU has VNNI, the GEMM itself
 * (below), on weights packed at load.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_api.h"

#define PARALLEL_ELEMENTS 65536
#define MIN_SCALE 1e-12f
#define INT8_LIMIT 127.0f
/* adding and taking back 1.5 * 2^23 rounds |v| <= 2^22 to an integer, ties to even (the default rounding
 * mode; the compiler keeps both additions without -ffast-math) */
#define ROUND_MAGIC 12582912.0f

/* q[r] = clamp(round(x[r] / s_r), -127, 127), rounding ties to even as torch.round, with
 * s_r = max(max|x[r]|, 1e-12) / 127 written to scales[r] (per token), or s_r = fixed_scale when it is > 0
 * (static; scales untouched). Rows of x lie x_stride apart. */
void raypaged_quantize_int8_f32(const float *x, int64_t x_stride, int64_t rows, int64_t k, float fixed_scale,
                                int8_t *q, float *scales, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * k >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float scale = fixed_scale;
        if (!(scale > 0.0f)) {
            float amax = 0.0f;
#pragma omp simd reduction(max : amax)
            for (int64_t i = 0; i < k; ++i) amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
            scale = (amax > MIN_SCALE ? amax : MIN_SCALE) / INT8_LIMIT;
            scales[r] = scale;
        }
        int8_t *qr = q + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) {
            float v = xr[i] / scale;
            v = v < -128.0f ? -128.0f : (v > 128.0f ? 128.0f : v); /* clamping before rounding changes nothing */
            v = (v + ROUND_MAGIC) - ROUND_MAGIC;                     /* ties to even, as torch.round */
            v = v < -INT8_LIMIT ? -INT8_LIMIT : (v > INT8_LIMIT ? INT8_LIMIT : v);
            qr[i] = (int8_t)v;
        }
    }
}

/* out[r][j] = (float)acc[r][j] * x_scales[r * x_scale_stride] * w_scales[j], rounded after each product */
__attribute__((optimize("fp-contract=off"))) void raypaged_int8_scale_f32(const int32_t *acc, int64_t rows, int64_t n,
                                                                          const float *x_scales,
                                                                          int64_t x_scale_stride,
                                                                          const float *w_scales, float *out,
                                                                          int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const float xs = x_scales[r * x_scale_stride];
        const int32_t *ar = acc + r * n;
        float *o = out + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) o[j] = ((float)ar[j] * xs) * w_scales[j];
    }
}

/* The int8 GEMM itself, where the CPU has VNNI (AVX512-VNNI: 16 lanes, or AVX-VNNI: 8), in place of
 * torch._int_mm: y = ((x_q @ W_q^T) as float * x_scale) * w_scale, the int32 sums exact, so the result is
 * _int_mm's followed by raypaged_int8_scale_f32, bit for bit.
 *
 * VNNI multiplies unsigned by signed bytes, four at a time into each int32 lane: x_q is read as
 * x_q + 128 (its sign bit flipped, 1..255), and 128 * sum_k W[j][k] (colsum, from packing) is taken back.
 * Packed layout: W [n, k] becomes ceil(n / NR) panels, each [ceil(k / 4)][NR][4]: for each group of four
 * inputs, each output column's four weights side by side (missing columns and inputs are zeros). As in
 * cpu_gemm.c, a tile of MR rows and one panel keeps its MR x NV sums in registers; panels are split
 * between the threads and the next one is prefetched, spread over the first tiles' passes. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_silu.h"
#include "cpu_tiles.h"

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define I8_LANES 16
#define I8_MR 8
typedef __m512i i8vec_t;
#define I8_ZERO() _mm512_setzero_si512()
#define I8_SET1(v) _mm512_set1_epi32(v)
#define I8_LOAD(p) _mm512_load_si512((const void *)(p))
#define I8_STORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define I8_DOT(acc, a, b) _mm512_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define I8_LANES 8
#define I8_MR 4
typedef __m256i i8vec_t;
#define I8_ZERO() _mm256_setzero_si256()
#define I8_SET1(v) _mm256_set1_epi32(v)
#define I8_LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define I8_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define I8_DOT(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#endif

#ifdef I8_LANES
#define I8_NV 3
#define I8_NR (I8_NV * I8_LANES) /* output columns per panel */
#define I8_MC 512                /* rows of x per chunk (cpu_tiles.h: chunk_rows) */
#define I8_HALF (I8_NR / 2)      /* gate (and up) columns per panel of the gated layout (as cpu_gemm.c's) */

int raypaged_int8_gemm_panel_width(void) { return I8_NR; }

/* w: [n, k] int8, rows ldw apart -> packed [ceil(n / NR), ceil(k / 4), NR, 4] (64-byte aligned), colsum [n] */
void raypaged_pack_weight_int8(const int8_t *w, int64_t n, int64_t k, int64_t ldw, int8_t *packed, int32_t *colsum,
                               int num_threads) {
    int64_t panels = (n + I8_NR - 1) / I8_NR, groups = (k + 3) / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int8_t *dst = packed + p * groups * I8_NR * 4;
        for (int j = 0; j < I8_NR; j++) {
            int64_t col = p * I8_NR + j;
            int32_t sum = 0;
            for (int64_t g = 0; g < groups; g++)
                for (int t = 0; t < 4; t++) {
                    int8_t v = col < n && 4 * g + t < k ? w[col * ldw + 4 * g + t] : 0;
                    dst[(g * I8_NR + j) * 4 + t] = v;
                    sum += v;
                }
            if (col < n) colsum[col] = sum;
        }
    }
}

/* y[r][j] = ((float)(sums[r][j] - 128 * colsum[j]) * x_scale[r]) * w_scale[j], rounded after each product */
__attribute__((optimize("fp-contract=off"))) static void scale_tile(const int32_t *sums, int rows, int cols,
                                                                     const int32_t *colsum, const float *x_scales,
                                                                     int64_t x_scale_stride, const float *w_scales,
                                                                     float *y, int64_t ldy) {
    for (int r = 0; r < rows; r++) {
        const float xs = x_scales[r * x_scale_stride];
        for (int j = 0; j < cols; j++)
            y[r * ldy + j] = ((float)(sums[r * I8_NR + j] - 128 * colsum[j]) * xs) * w_scales[j];
    }
}

/* ROWS (1..I8_MR, a constant after inlining) rows of x (x_q + 128 as unsigned bytes, rows padded to whole
 * groups of four, ldx apart) against one panel: the int32 sums into sums [I8_MR][I8_NR] */
static inline __attribute__((always_inline)) void int8_tile(const uint8_t *x, int64_t ldx, const int8_t *panel,
                                                            int64_t groups, const int rows, int32_t *sums,
                                                            const char *prefetch, int share) {
    i8vec_t acc[I8_MR][I8_NV];
    for (int r = 0; r < I8_MR; r++)
        for (int v = 0; v < I8_NV; v++) acc[r][v] = I8_ZERO();
    for (int64_t g = 0; g < groups; g++) {
        i8vec_t b[I8_NV];
        for (int v = 0; v < I8_NV; v++) b[v] = I8_LOAD(panel + (g * I8_NR + v * I8_LANES) * 4);
        prefetch_step(prefetch, g, I8_NR * 4, share);
#pragma GCC unroll 8
        for (int r = 0; r < I8_MR; r++) {
            if (r < rows) {
                i8vec_t a = I8_SET1(*(const int32_t *)(x + r * ldx + 4 * g));
                for (int v = 0; v < I8_NV; v++) acc[r][v] = I8_DOT(acc[r][v], a, b[v]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < I8_NV; v++) I8_STORE(sums + r * I8_NR + v * I8_LANES, acc[r][v]);
}

#define INT8_TILE_CASE(R)                                                                                              \
    case R:                                                                                                            \
        int8_tile(x, ldx, panel, groups, R, sums, prefetch, share);                                                    \
        break;

static void int8_tile_rows(const uint8_t *x, int64_t ldx, const int8_t *panel, int64_t groups, int rows,
                           int32_t *sums, const char *prefetch, int share) {
    switch (rows) {
        INT8_TILE_CASE(1)
        INT8_TILE_CASE(2)
        INT8_TILE_CASE(3)
        INT8_TILE_CASE(4)
#if I8_MR == 8
        INT8_TILE_CASE(5)
        INT8_TILE_CASE(6)
        INT8_TILE_CASE(7)
        INT8_TILE_CASE(8)
#endif
    }
}

/* What every (chunk, panel) of one call shares */
struct int8_linear_call {
    const uint8_t *x_u;
    const int8_t *packed;
    const int32_t *colsum;
    const float *x_scales, *w_scales, *bias;
    float *y;
    int64_t ldu, groups, panel_bytes, n, panels, x_scale_stride, ldy;
    int gated;
};

/* One chunk of rows [chunk, chunk_end) of x_u (x_q + 128) against panel p, scaled into y (gated: as
 * raypaged_int8_linear_f32 says) */
static void int8_chunk_panel(const void *call_ptr, int64_t chunk, int64_t chunk_end, int64_t p) {
    const struct int8_linear_call *c = call_ptr;
    const int share = prefetch_share((chunk_end - chunk + I8_MR - 1) / I8_MR);
    int32_t sums[I8_MR * I8_NR] __attribute__((aligned(64)));
    int64_t first;
    const int cols = panel_columns(c->n, c->gated, I8_NR, p, &first);
    const int64_t half = c->n / 2;
    const int8_t *panel = c->packed + p * c->panel_bytes;
    float w_scales[I8_NR], bias[I8_NR]; /* a gated panel's columns of them */
    if (c->gated) panel_values(w_scales, c->w_scales, c->n, 1, I8_NR, first, cols);
    if (c->gated && c->bias) panel_values(bias, c->bias, c->n, 1, I8_NR, first, cols);
    for (int64_t row = chunk; row < chunk_end; row += I8_MR) {
        int rows = chunk_end - row < I8_MR ? (int)(chunk_end - row) : I8_MR;
        const char *prefetch =
            next_panel_part(panel + c->panel_bytes, c->panel_bytes, p + 1 < c->panels, (row - chunk) / I8_MR, share);
        int8_tile_rows(c->x_u + row * c->ldu, c->ldu, panel, c->groups, rows, sums, prefetch, share);
        const float *x_scales = c->x_scales + row * c->x_scale_stride;
        float *y = c->y + row * c->ldy + first;
        if (!c->gated) {
            scale_tile(sums, rows, cols, c->colsum + p * I8_NR, x_scales, c->x_scale_stride, c->w_scales + first, y,
                       c->ldy);
            continue;
        }
        float out[I8_MR * I8_NR];
        scale_tile(sums, rows, I8_NR, c->colsum + p * I8_NR, x_scales, c->x_scale_stride, w_scales, out, I8_NR);
        for (int r = 0; r < rows; r++) {
            float *o = out + r * I8_NR;
            if (c->gated == 1) {
                memcpy(y + r * c->ldy, o, (size_t)cols * 4);
                memcpy(y + r * c->ldy + half, o + I8_HALF, (size_t)cols * 4);
                continue;
            }
            if (c->bias)
                for (int j = 0; j < I8_NR; j++) o[j] += bias[j];
            silu_mul_row(o, o + I8_HALF, y + r * c->ldy, cols);
        }
    }
}

/* y = ((x_q [m, k] @ W^T) * x_scale) * w_scale for W [n, k] packed as above (x_q rows ldx apart, x_scales[r *
 * x_scale_stride], stride 0: one static scale; y's rows ldy apart): gated 0: the plain layout, y [m, n]; 1: the
 * gated layout of cpu_gemm.c (n even; colsum in the packed order), y [m, n] in W's column order; 2: the gated
 * layout, y [m, n / 2] = silu(gate + bias) * (up + bias) (bias [n] or NULL; used only here: the other forms
 * leave the bias to their caller). Returns 0, or -1 when out of memory. */
int raypaged_int8_linear_f32(const int8_t *x_q, int64_t m, int64_t k, int64_t ldx, const int8_t *packed,
                             const int32_t *colsum, int64_t n, const float *x_scales, int64_t x_scale_stride,
                             const float *w_scales, const float *bias, float *y, int64_t ldy, int gated,
                             int num_threads) {
    int64_t panels = panel_count(n, gated, I8_NR);
    int64_t groups = (k + 3) / 4, panel_bytes = groups * I8_NR * 4;
    int64_t ldu = (groups * 4 + 63) / 64 * 64; /* x_q + 128 as unsigned, rows whole cache lines */
    if (m == 0) return 0;
    uint8_t *x_u = aligned_alloc(64, (size_t)(m * ldu));
    if (!x_u) return -1;
#pragma omp parallel for num_threads(num_threads) if (m * k >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < m; r++) {
        for (int64_t i = 0; i < k; i++) x_u[r * ldu + i] = (uint8_t)x_q[r * ldx + i] ^ 0x80;
        for (int64_t i = k; i < groups * 4; i++) x_u[r * ldu + i] = 0; /* times the packed zeros */
    }
    const struct int8_linear_call call = {
        .x_u = x_u, .packed = packed, .colsum = colsum, .x_scales = x_scales, .w_scales = w_scales, .bias = bias,
        .y = y, .ldu = ldu, .groups = groups, .panel_bytes = panel_bytes, .n = n, .panels = panels,
        .x_scale_stride = x_scale_stride, .ldy = ldy, .gated = gated};
    for_chunk_panels(m, panels, num_threads, I8_MR, I8_MC, int8_chunk_panel, &call);
    free(x_u);
    return 0;
}
#else /* no VNNI: torch._int_mm runs instead (raypaged_int8_gemm_panel_width() == 0) */
int raypaged_int8_gemm_panel_width(void) { return 0; }
void raypaged_pack_weight_int8(const int8_t *w, int64_t n, int64_t k, int64_t ldw, int8_t *packed, int32_t *colsum,
                               int num_threads) {}
int raypaged_int8_linear_f32(const int8_t *x_q, int64_t m, int64_t k, int64_t ldx, const int8_t *packed,
                             const int32_t *colsum, int64_t n, const float *x_scales, int64_t x_scale_stride,
                             const float *w_scales, const float *bias, float *y, int64_t ldy, int gated,
                             int num_threads) {
    return -2;
}
#endif
