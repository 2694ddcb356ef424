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
 */
#include <stdint.h>
#include <string.h>

#include "cpu_api.h"
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

enum store { PLAIN, GATED, GATED_SILU }; /* the layout's columns as they are; gate | up back in W's order; silu */

typedef float vec_t __attribute__((vector_size(VEC * 4)));
typedef float vec_unaligned_t __attribute__((vector_size(VEC * 4), aligned(4)));

int raypaged_gemm_panel_width(void) { return NR; }

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

/* ROWS (1..MR, a constant after inlining) rows of x against one panel, plus its bias (NULL: none; the panel's
 * columns, zero-padded): y's COLS (<= NR) columns as `store` says (GATED, GATED_SILU: cols <= HALF of each half,
 * the up half `half` columns right of y for GATED).
 * prefetch: the part of the next panel to bring into cache meanwhile, 2^-share of a panel (NULL: none). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *panel, int64_t k,
                                                       const float *bias, float *y, int64_t ldy, const int rows,
                                                       int cols, enum store store, int64_t half,
                                                       const char *prefetch, int share) {
    vec_t acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = (vec_t){0};
    for (int64_t kk = 0; kk < k; kk++) {
        vec_t b[NV];
        for (int v = 0; v < NV; v++) b[v] = *(const vec_t *)(panel + kk * NR + v * VEC);
        prefetch_step(prefetch, kk, NR * 4, share);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < rows) {
                float a = x[r * ldx + kk];
                for (int v = 0; v < NV; v++) acc[r][v] += a * b[v];
            }
        }
    }
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

#define TILE_CASE(R)                                                                                                   \
    case R:                                                                                                            \
        tile(x, ldx, panel, k, bias, y, ldy, R, cols, store, half, prefetch, share);                                   \
        break;

/* the tile of `rows` rows, each count its own unrolled copy */
static void tile_rows(const float *x, int64_t ldx, const float *panel, int64_t k, const float *bias, float *y,
                      int64_t ldy, int rows, int cols, enum store store, int64_t half, const char *prefetch,
                      int share) {
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

/* What every (chunk, panel) of one call shares; then: the call's next weight (NULL: none), whose first panel of
 * its share each thread asks for during its last panel here */
struct linear_call {
    const float *x, *packed, *bias;
    float *y;
    int64_t ldx, k, n, panels, ldy;
    enum store store;
    const struct linear_next *then;
};

/* One chunk of rows [chunk, chunk_end) against panel p */
static void chunk_panel(const void *call_ptr, int64_t chunk, int64_t chunk_end, int64_t p) {
    const struct linear_call *c = call_ptr;
    const int share = prefetch_share((chunk_end - chunk + MR - 1) / MR);
    int64_t first;
    const int gated = c->store != PLAIN, cols = panel_columns(c->n, gated, NR, p, &first);
    const int64_t half = c->n / 2;
    const float *panel = c->packed + p * c->k * NR;
    const float *next_first = NULL; /* this thread's last panel: the next weight's first panel for it */
    if (c->then) {
        const int team = omp_get_num_threads(), t = omp_get_thread_num();
        if (p + 1 == share_start(c->panels, team, t + 1))
            next_first = c->then->packed +
                         share_start(panel_count(c->then->n, c->then->gated, NR), team, t) * c->then->k * NR;
    }
    float bias[NR] __attribute__((aligned(64))); /* the panel's columns of it */
    if (c->bias) panel_values(bias, c->bias, c->n, gated, NR, first, cols);
    for (int64_t row = chunk; row < chunk_end; row += MR) {
        int rows = chunk_end - row < MR ? (int)(chunk_end - row) : MR;
        const char *prefetch =
            next_panel_part(panel + c->k * NR, c->k * NR * 4, p + 1 < c->panels, (row - chunk) / MR, share);
        if (next_first) prefetch = next_panel_part(next_first, c->then->k * NR * 4, 1, (row - chunk) / MR, share);
        tile_rows(c->x + row * c->ldx, c->ldx, panel, c->k, c->bias ? bias : NULL, c->y + row * c->ldy + first, c->ldy,
                  rows, cols, c->store, half, prefetch, share);
    }
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
    const enum store store = gated == 2 ? GATED_SILU : gated == 1 ? GATED : PLAIN;
    const int64_t panels = panel_count(n, store != PLAIN, NR);
    if (then && (m > MC || panels < threads || panel_count(then->n, then->gated, NR) < threads)) then = NULL;
    const struct linear_call call = {
        .x = x, .packed = packed, .bias = bias, .y = y, .ldx = ldx, .k = k, .n = n, .panels = panels, .ldy = ldy,
        .store = store, .then = then};
    for_chunk_panels(m, panels, threads, MR, MC, chunk_panel, &call);
}

void raypaged_linear_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                         const float *bias, float *y, int64_t ldy, int gated, int threads) {
    raypaged_linear_f32_then(x, m, k, ldx, packed, n, bias, y, ldy, gated, threads, NULL);
}
