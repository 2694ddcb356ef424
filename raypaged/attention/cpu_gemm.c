/* The fp32 linear of every float projection and the LM head on CPU: y = x @ W^T (+ bias), on a weight packed
 * once at load into column panels.
 *
 * Packed layout: W [n, k] becomes ceil(n / NR) panels, each [k][NR]: row kk of a panel holds W[j][kk] for its
 * NR output columns j side by side (the last panel's missing columns are zeros). A tile of MR rows of x and one
 * panel keeps MR x NR accumulators in registers; each step over kk loads NR weights and broadcasts MR inputs.
 * Panels are split among the threads; every panel streams from memory once per chunk of MC rows (decode: once
 * per step), and its x rows come from cache. The next panel is prefetched meanwhile, spread evenly over the
 * first tiles' passes (up to 4): all at once, it arrived too late for the first and not at all for the rest.
 *
 * Every output is one sequential sum over kk, fused multiply-adds from zero, whatever the row count, the row's
 * place in the batch or the thread count: a row's result does not depend on what it is batched with.
 *
 * Gated layout (an MLP's gate | up projection, W [2 * h, k]): panel p holds gate columns [p * NR/2, p * NR/2 +
 * NR/2) in its first half and the same up columns in its second, so a tile holds both halves of its outputs.
 * It is stored back either in W's own column order (the same bits as the plain layout) or as silu(gate) * up
 * (cpu_silu.h, the same bits as cpu_fused.c's silu_and_mul after the plain linear), and the [m, 2h]
 * activations are then never written: SmolLM2's W6 spent 4 % of its time in that separate pass.
 *
 * Measured against oneDNN's packed fp32 linear on 2 AMD EPYC (Zen 5) cores, SmolLM2's decode step (30 layers'
 * four projections and the LM head, weights from memory) at 32 rows: 26 -> 19.6 ms, at 8 rows 12.5 -> 8.4 ms;
 * with both limited to AVX2, 46 -> 35 ms at 32 rows. From 1 to 512 rows it is as fast or faster at each
 * projection's shape; at 4,133 rows within 8%.
 *
 * bf16 weights (a bf16 model on CPU: raypaged_pack_weight_bf16, raypaged_linear_bf16_then), x and y still fp32:
 * - where the CPU has AVX512-BF16, a panel is [ceil(k / 2)][NR][2]: each kk pair of a column side by side, as
 *   vdpbf16ps takes them. x is rounded to bf16 pairs once per call (rounding to nearest even) and each step of a
 *   tile adds x[2i] w[2i] + x[2i+1] w[2i+1] to fp32 accumulators: twice the fp32 FMAs' products per instruction,
 *   from half the weight bytes.
 * - elsewhere (AVX2, AVX-512 without BF16), a panel is [k][NR] bf16, widened to fp32 as the tiles load it (a
 *   chunk of few tiles: decode steps) or once per (chunk, panel) into a buffer of the thread that its fp32 tiles
 *   read (many tiles: prefills): the bits of the fp32 linear on the widened weight, from half its bytes.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_api.h"
#include "cpu_cache.h"
#include "cpu_silu.h"
#include "cpu_tiles.h"

#ifdef __AVX512F__
#define VEC 16 /* floats per vector */
#define MR 8   /* rows of x per tile: MR x NV accumulators, NV weight vectors, one broadcast (of 32 registers) */
#else
#define VEC 8
#define MR 4 /* of 16 registers */
#endif
#define NV 3
#define NR (NV * VEC) /* output columns per panel */
#define MC 512        /* rows of x per chunk (cpu_tiles.h: chunk_rows) */
#define HALF (NR / 2)  /* gate (and up) columns per panel of the gated layout */
#ifdef __AVX512BF16__
#include <immintrin.h>
#define BF16_PAIRS 1 /* bf16 panels hold kk pairs for vdpbf16ps */
#else
#define BF16_PAIRS 0 /* bf16 panels are widened to fp32 */
#endif
#define WIDEN_IN_TILES 2 /* up to this many tiles of rows a chunk widens a bf16 panel as its tiles load it */

enum store { PLAIN, GATED, GATED_SILU }; /* the layout's columns as they are; gate | up back in W's order; silu */

typedef float vec_t __attribute__((vector_size(VEC * 4)));
typedef float vec_unaligned_t __attribute__((vector_size(VEC * 4), aligned(4)));

int raypaged_gemm_panel_width(void) { return NR; }

int raypaged_gemm_bf16_pairs(void) { return BF16_PAIRS; }

/* w: [n, k] with rows ldw apart -> packed: [ceil(n / NR), k, NR] (64-byte aligned by the caller: torch's) */
void raypaged_pack_weight_f32(const float *w, int64_t n, int64_t k, int64_t ldw, float *packed, int threads) {
    int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                int64_t col = p * NR + j;
                dst[kk * NR + j] = col < n ? w[col * ldw + kk] : 0.0f;
            }
    }
}

/* bf16 values per panel of a weight of k input features: k rounded up to pairs, or k, times NR */
static inline int64_t bf16_panel_size(int64_t k) { return (BF16_PAIRS ? (k + 1) / 2 * 2 : k) * NR; }

/* bytes per panel of a packed weight of k input features, bf16 or fp32 */
static inline int64_t panel_bytes(int64_t k, int bf16) { return bf16 ? bf16_panel_size(k) * 2 : k * NR * 4; }

/* w: [n, k] fp32 with rows ldw apart -> its values rounded to bf16 (exact where they are bf16 values) in the
 * layout above: [ceil(n / NR), ceil(k / 2), NR, 2] with BF16_PAIRS (an odd k's last pair ends in a zero), else
 * [ceil(n / NR), k, NR]; the last panel's missing columns zeros */
void raypaged_pack_weight_bf16(const float *w, int64_t n, int64_t k, int64_t ldw, uint16_t *packed, int threads) {
    const int64_t panels = (n + NR - 1) / NR, size = bf16_panel_size(k);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = packed + p * size;
        memset(dst, 0, (size_t)size * 2);
        for (int64_t kk = 0; kk < k; kk++)
            for (int j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                const uint16_t value = col < n ? f32_to_bf16(w[col * ldw + kk]) : 0;
                dst[BF16_PAIRS ? kk / 2 * 2 * NR + 2 * j + (kk & 1) : kk * NR + j] = value;
            }
    }
}

/* A 4-bit layer's weight in the W4A16 layout of raypaged/kernels/quant_ops.py (qweight int32 [kw, n4]: input
 * feature 8r + i of column c in bits 4i .. 4i+3 of word (r, c); scales float32 and zeros uint8 [8 kw / group, n4];
 * perm int32 [8 kw]: the input feature at each layout position, k for padding; NULL: the identity) dequantized
 * straight into the column panels raypaged_linear_f32 reads ([ceil(n / NR), k, NR], columns past n zero):
 * w[feature][c] = float(q - zero) * scale, one rounding, as the layout's torch reference. */
void raypaged_dequantize_w4_packed_f32(const int32_t *qweight, const float *scales, const uint8_t *zeros,
                                       const int32_t *perm, int64_t k, int64_t kw, int64_t n, int64_t n4,
                                       int64_t group, float *packed, int threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * NR;
        const int64_t c0 = p * NR, cols = n - c0 < NR ? n - c0 : NR;
        for (int64_t r = 0; r < kw; r++) {
            const int64_t g = 8 * r / group;
            const int32_t *words = qweight + r * n4 + c0;
            const float *s = scales + g * n4 + c0;
            const uint8_t *z = zeros + g * n4 + c0;
            for (int i = 0; i < 8; i++) {
                const int64_t feature = perm ? perm[8 * r + i] : 8 * r + i;
                if (feature >= k) continue; /* padding */
                float *row = dst + feature * NR;
#pragma omp simd
                for (int64_t j = 0; j < cols; j++) row[j] = (float)(((words[j] >> (4 * i)) & 15) - (int32_t)z[j]) * s[j];
                for (int64_t j = cols; j < NR; j++) row[j] = 0.0f;
            }
        }
    }
}

/* A tile's accumulators plus its bias (NULL: none; the panel's columns, zero-padded) stored into y's COLS (<= NR)
 * columns as `store` says (GATED, GATED_SILU: cols <= HALF of each half, the up half `half` columns right of y for
 * GATED) */
static inline __attribute__((always_inline)) void store_tile(vec_t acc[MR][NV], const float *bias, float *y,
                                                             int64_t ldy, const int rows, int cols, enum store store,
                                                             int64_t half) {
    if (bias)
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < NV; v++) acc[r][v] += *(const vec_t *)(bias + v * VEC);
    for (int r = 0; r < rows; r++) {
        if (store == PLAIN && cols == NR) {
            for (int v = 0; v < NV; v++) *(vec_unaligned_t *)(y + r * ldy + v * VEC) = acc[r][v];
            continue;
        }
        float out[NR] __attribute__((aligned(64)));
        for (int v = 0; v < NV; v++) *(vec_t *)(out + v * VEC) = acc[r][v];
        if (store == PLAIN) {
            memcpy(y + r * ldy, out, (size_t)cols * 4);
        } else if (store == GATED) {
            memcpy(y + r * ldy, out, (size_t)cols * 4);
            memcpy(y + r * ldy + half, out + HALF, (size_t)cols * 4);
        } else {
            silu_mul_row(out, out + HALF, y + r * ldy, cols);
        }
    }
}

/* VEC bf16 values (a panel's, 2-byte aligned) widened to the fp32 values they are */
typedef uint16_t bf16_vec_t __attribute__((vector_size(VEC * 2), aligned(2)));
typedef uint32_t bits_vec_t __attribute__((vector_size(VEC * 4)));
static inline __attribute__((always_inline)) vec_t widen(const uint16_t *values) {
    return (vec_t)(__builtin_convertvector(*(const bf16_vec_t *)values, bits_vec_t) << 16);
}

/* ROWS (1..MR, a constant after inlining) rows of x against one panel, fp32 or (bf16, a constant after inlining)
 * bf16 values widened as they are loaded, stored by store_tile.
 * prefetch: the part of the next panel to bring into cache meanwhile, 2^-share of a panel (NULL: none), step_bytes
 * of it per kk. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const void *panel, int64_t k,
                                                       const float *bias, float *y, int64_t ldy, const int rows,
                                                       int cols, enum store store, int64_t half,
                                                       const char *prefetch, int share, int step_bytes,
                                                       const int bf16) {
    vec_t acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vec_t){0};
    for (int64_t kk = 0; kk < k; kk++) {
        vec_t b[NV];
        for (int v = 0; v < NV; v++)
            b[v] = bf16 ? widen((const uint16_t *)panel + kk * NR + v * VEC)
                        : *(const vec_t *)((const float *)panel + kk * NR + v * VEC);
        prefetch_step(prefetch, kk, step_bytes, share);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < rows) {
                float a = x[r * ldx + kk];
                for (int v = 0; v < NV; v++) acc[r][v] += a * b[v];
            }
        }
    }
    store_tile(acc, bias, y, ldy, rows, cols, store, half);
}

#define TILE_CASE(R)                                                                                                   \
    case R:                                                                                                            \
        tile(x, ldx, panel, k, bias, y, ldy, R, cols, store, half, prefetch, share, step_bytes, bf16);                 \
        break;

/* the tile of `rows` rows, each count its own unrolled copy */
static inline __attribute__((always_inline)) void any_tile_rows(const float *x, int64_t ldx, const void *panel,
                                                                int64_t k, const float *bias, float *y, int64_t ldy,
                                                                int rows, int cols, enum store store, int64_t half,
                                                                const char *prefetch, int share, int step_bytes,
                                                                const int bf16) {
    switch (rows) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
#if MR == 8
        TILE_CASE(5)
        TILE_CASE(6)
        TILE_CASE(7)
        TILE_CASE(8)
#endif
    }
}

/* over an fp32 panel, the next (fp32) panel prefetched */
static void tile_rows(const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias, float *y,
                      int64_t ldy, int rows, int cols, enum store store, int64_t half, const char *prefetch,
                      int share) {
    any_tile_rows(x, ldx, panel, k, bias, y, ldy, rows, cols, store, half, prefetch, share, NR * 4, 0);
}

#if !BF16_PAIRS
/* over a bf16 panel of [k][NR] widened into an fp32 buffer, the next (bf16) panel prefetched */
static void tile_rows_widened(const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias, float *y,
                              int64_t ldy, int rows, int cols, enum store store, int64_t half, const char *prefetch,
                              int share) {
    any_tile_rows(x, ldx, panel, k, bias, y, ldy, rows, cols, store, half, prefetch, share, NR * 2, 0);
}

/* over a bf16 panel of [k][NR], widened as it is loaded: the same bits as over its widened fp32 copy */
static void tile_rows_widening(const float *x, int64_t ldx, const uint16_t *panel, int64_t k, const float *bias,
                               float *y, int64_t ldy, int rows, int cols, enum store store, int64_t half,
                               const char *prefetch, int share) {
    any_tile_rows(x, ldx, panel, k, bias, y, ldy, rows, cols, store, half, prefetch, share, NR * 2, 1);
}
#endif

#if BF16_PAIRS
/* tile's loop over a bf16 panel of `pairs` kk pairs, x's rows as bf16 pairs (one uint32 each, ldx apart) */
static inline __attribute__((always_inline)) void tile_bf16(const uint32_t *x, int64_t ldx, const uint16_t *panel,
                                                            int64_t pairs, const float *bias, float *y, int64_t ldy,
                                                            const int rows, int cols, enum store store, int64_t half,
                                                            const char *prefetch, int share) {
    vec_t acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vec_t){0};
    for (int64_t kk = 0; kk < pairs; kk++) {
        __m512bh b[NV];
        for (int v = 0; v < NV; v++) b[v] = (__m512bh)_mm512_loadu_si512(panel + (kk * NR + v * VEC) * 2);
        prefetch_step(prefetch, kk, NR * 4, share);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < rows) {
                const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[r * ldx + kk]);
                for (int v = 0; v < NV; v++) acc[r][v] = (vec_t)_mm512_dpbf16_ps((__m512)acc[r][v], a, b[v]);
            }
        }
    }
    store_tile(acc, bias, y, ldy, rows, cols, store, half);
}

#define TILE_BF16_CASE(R)                                                                                              \
    case R:                                                                                                            \
        tile_bf16(x, ldx, panel, pairs, bias, y, ldy, R, cols, store, half, prefetch, share);                          \
        break;

static void tile_rows_bf16(const uint32_t *x, int64_t ldx, const uint16_t *panel, int64_t pairs, const float *bias,
                           float *y, int64_t ldy, int rows, int cols, enum store store, int64_t half,
                           const char *prefetch, int share) {
    switch (rows) {
        TILE_BF16_CASE(1)
        TILE_BF16_CASE(2)
        TILE_BF16_CASE(3)
        TILE_BF16_CASE(4)
        TILE_BF16_CASE(5)
        TILE_BF16_CASE(6)
        TILE_BF16_CASE(7)
        TILE_BF16_CASE(8)
    }
}

/* x [m, k] (rows ldx apart) rounded to bf16, each row ceil(k / 2) pairs (an odd k's last pair ends in a zero) */
static void to_bf16_pairs(const float *x, int64_t m, int64_t k, int64_t ldx, uint32_t *pairs, int threads) {
    const int64_t width = (k + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (m * k >= 1 << 15)
    for (int64_t r = 0; r < m; r++) {
        const float *row = x + r * ldx;
        uint16_t *dst = (uint16_t *)(pairs + r * width);
        int64_t kk = 0;
        for (; kk + 32 <= k; kk += 32) /* the same rounding as f32_to_bf16 */
            _mm512_storeu_si512(
                dst + kk, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + kk + 16), _mm512_loadu_ps(row + kk)));
        for (; kk < k; kk++) dst[kk] = f32_to_bf16(row[kk]);
        if (k & 1) dst[k] = 0;
    }
}
#endif

/* The calling thread's scratch of at least `bytes`, 64-byte aligned, kept for its next calls (NULL: no memory) */
static void *scratch(int64_t bytes) {
    static _Thread_local void *buffer;
    static _Thread_local int64_t capacity;
    if (bytes > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
        capacity = buffer ? bytes : 0;
    }
    return buffer;
}

/* What every (chunk, panel) of one call shares; then: the call's next weight (NULL: none), whose first panel of
 * its share each thread asks for during its last panel here. A bf16 weight's call also has x as bf16 pairs
 * (BF16_PAIRS) or a buffer of k x NR floats per thread to widen each panel into. */
struct linear_call {
    const float *x, *bias;
    const void *packed;
    float *y;
    int64_t ldx, k, n, panels, ldy;
    enum store store;
    int bf16;
    const uint32_t *x_pairs;
    float *wide;
    const struct linear_next *then;
};

/* One chunk of rows [chunk, chunk_end) against panel p */
static void chunk_panel(const void *call_ptr, int64_t chunk, int64_t chunk_end, int64_t p) {
    const struct linear_call *c = call_ptr;
    const int share = prefetch_share((chunk_end - chunk + MR - 1) / MR);
    int64_t first;
    const int gated = c->store != PLAIN, cols = panel_columns(c->n, gated, NR, p, &first);
    const int64_t half = c->n / 2, bytes = panel_bytes(c->k, c->bf16);
    const char *panel = (const char *)c->packed + p * bytes;
    const char *next_first = NULL; /* this thread's last panel: the next weight's first panel for it */
    if (c->then) {
        const int team = omp_get_num_threads(), t = omp_get_thread_num();
        if (p + 1 == share_start(c->panels, team, t + 1))
            next_first = (const char *)c->then->packed +
                         share_start(panel_count(c->then->n, c->then->gated, NR), team, t) *
                             panel_bytes(c->then->k, c->then->bf16);
    }
    float bias[NR] __attribute__((aligned(64))); /* the panel's columns of it */
    if (c->bias) panel_values(bias, c->bias, c->n, gated, NR, first, cols);
    const float *fp32_panel = (const float *)panel;
    /* a bf16 panel without BF16 instructions: widened as the tiles load it where the chunk has few tiles, else
     * once into this thread's buffer, its tiles then loading fp32 (the same bits either way) */
    const int widening = c->bf16 && !BF16_PAIRS && chunk_end - chunk <= WIDEN_IN_TILES * MR;
    if (c->bf16 && !BF16_PAIRS && !widening) {
        float *wide = c->wide + omp_get_thread_num() * c->k * NR;
        widen_bf16((const uint16_t *)panel, c->k * NR, wide);
        fp32_panel = wide;
    }
    for (int64_t row = chunk; row < chunk_end; row += MR) {
        int rows = chunk_end - row < MR ? (int)(chunk_end - row) : MR;
        const char *prefetch = next_panel_part(panel + bytes, bytes, p + 1 < c->panels, (row - chunk) / MR, share);
        if (next_first)
            prefetch =
                next_panel_part(next_first, panel_bytes(c->then->k, c->then->bf16), 1, (row - chunk) / MR, share);
        float *y = c->y + row * c->ldy + first;
        const float *b = c->bias ? bias : NULL;
#if BF16_PAIRS
        if (c->bf16) {
            const int64_t pairs = (c->k + 1) / 2;
            tile_rows_bf16(c->x_pairs + row * pairs, pairs, (const uint16_t *)panel, pairs, b, y, c->ldy, rows, cols,
                           c->store, half, prefetch, share);
            continue;
        }
#endif
#if !BF16_PAIRS
        if (widening) {
            tile_rows_widening(c->x + row * c->ldx, c->ldx, (const uint16_t *)panel, c->k, b, y, c->ldy, rows, cols,
                               c->store, half, prefetch, share);
            continue;
        }
        if (c->bf16) {
            tile_rows_widened(c->x + row * c->ldx, c->ldx, fp32_panel, c->k, b, y, c->ldy, rows, cols, c->store, half,
                              prefetch, share);
            continue;
        }
#endif
        tile_rows(c->x + row * c->ldx, c->ldx, fp32_panel, c->k, b, y, c->ldy, rows, cols, c->store, half, prefetch,
                  share);
    }
}

/* The call of either linear below; returns 0, or -1 when the bf16 scratch cannot be had */
static int run_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const void *packed, int bf16, int64_t n,
                      const float *bias, float *y, int64_t ldy, int gated, int threads,
                      const struct linear_next *then) {
    const enum store store = gated == 2 ? GATED_SILU : gated == 1 ? GATED : PLAIN;
    const int64_t panels = panel_count(n, store != PLAIN, NR);
    if (then && (m > MC || panels < threads || panel_count(then->n, then->gated, NR) < threads)) then = NULL;
    struct linear_call call = {
        .x = x, .bias = bias, .packed = packed, .y = y, .ldx = ldx, .k = k, .n = n, .panels = panels, .ldy = ldy,
        .store = store, .bf16 = bf16, .then = then};
    if (bf16) {
#if BF16_PAIRS
        uint32_t *pairs = scratch(m * ((k + 1) / 2) * 4);
        if (!pairs) return -1;
        to_bf16_pairs(x, m, k, ldx, pairs, threads);
        call.x_pairs = pairs;
#else
        if (!(call.wide = scratch((int64_t)threads * k * NR * 4))) return -1;
#endif
    }
    for_chunk_panels(m, panels, threads, MR, MC, chunk_panel, &call);
    return 0;
}

/* y = x [m, k] (rows ldx apart) @ W^T + bias (NULL: none) for W [n, k] packed as above, y's rows ldy apart:
 * gated 0: the plain layout, y [m, n]; 1: the gated layout (n even), y [m, n] in W's column order; 2: the gated
 * layout, y [m, n / 2] = silu(gate) * up. The (chunk, panel) pairs split between the threads as cpu_tiles.h says.
 * then (NULL: none): the weight of the linear that runs next on these threads (a decode step's next projection),
 * whose first panel of each thread's share (cpu_tiles.h: share_start) that thread prefetches during its last
 * panel here, so the next call does not start on a panel from memory. Only where it applies: both calls one
 * chunk of rows with at least a panel a thread. Decode steps of SmolLM2 (32 rows, 30 layers' four projections,
 * weights from memory, 2 EPYC cores): 14.78 -> 14.55 ms, against 13.85 with every weight in cache. */
void raypaged_linear_f32_then(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                              const float *bias, float *y, int64_t ldy, int gated, int threads,
                              const struct linear_next *then) {
    run_linear(x, m, k, ldx, packed, 0, n, bias, y, ldy, gated, threads, then);
}

void raypaged_linear_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                         const float *bias, float *y, int64_t ldy, int gated, int threads) {
    run_linear(x, m, k, ldx, packed, 0, n, bias, y, ldy, gated, threads, NULL);
}

/* The same from a weight packed by raypaged_pack_weight_bf16; returns 0, or -1 when there is no memory for the
 * call's scratch (x's bf16 pairs, or each thread's widened panel) */
int raypaged_linear_bf16_then(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                              const float *bias, float *y, int64_t ldy, int gated, int threads,
                              const struct linear_next *then) {
    return run_linear(x, m, k, ldx, packed, 1, n, bias, y, ldy, gated, threads, then);
}

int raypaged_linear_bf16(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                         const float *bias, float *y, int64_t ldy, int gated, int threads) {
    return run_linear(x, m, k, ldx, packed, 1, n, bias, y, ldy, gated, threads, NULL);
}
