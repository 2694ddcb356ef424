/* How the GEMMs of cpu_gemm.c and cpu_int8.c split their work: chunks of rows of x times column panels. */
#ifndef RAYPAGED_CPU_TILES_H
#define RAYPAGED_CPU_TILES_H
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Rows of x per chunk: at most max_rows (one chunk's rows stay in cache while the panels pass), fewer when
 * the panels alone would leave threads idle (a step of few rows on many cores: each thread then takes a
 * share of the rows as well), in whole tiles. Any split gives the same bits: each output is one tile's. */
static inline int64_t chunk_rows(int64_t m, int64_t panels, int threads, int64_t tile_rows, int64_t max_rows) {
    int64_t rows = max_rows;
    if (panels < threads) {
        int64_t splits = (threads + panels - 1) / panels, share = (m + splits - 1) / splits;
        share = (share + tile_rows - 1) / tile_rows * tile_rows;
        if (share < rows) rows = share;
    }
    return rows < tile_rows ? tile_rows : rows;
}

/* The output columns of a layout of `width`-column panels over n outputs; gated (an MLP's gate | up, n = 2h):
 * each panel holds width / 2 gate columns and the same up columns. panel_count: how many panels;
 * panel_columns: where panel p's (gate) columns start in y (*first) and how many it has. */
static inline int64_t panel_count(int64_t n, int gated, int64_t width) {
    const int64_t part = gated ? width / 2 : width, outputs = gated ? n / 2 : n;
    return (outputs + part - 1) / part;
}

static inline int panel_columns(int64_t n, int gated, int64_t width, int64_t p, int64_t *first) {
    const int64_t part = gated ? width / 2 : width, outputs = gated ? n / 2 : n;
    *first = p * part;
    return (int)(*first + part <= outputs ? part : outputs - *first);
}

/* dst [width]: a per-output vector's values (bias, scales) at panel p's columns (first, cols: panel_columns),
 * zeros past them; gated: the gate columns' first, then from width / 2 the up columns' (n / 2 further in src) */
static inline void panel_values(float *dst, const float *src, int64_t n, int gated, int64_t width, int64_t first,
                                int cols) {
    memset(dst, 0, sizeof(float) * (size_t)width);
    memcpy(dst, src + first, sizeof(float) * (size_t)cols);
    if (gated) memcpy(dst + width / 2, src + n / 2 + first, sizeof(float) * (size_t)cols);
}

/* The next panel is prefetched by the first 1, 2 or 4 tiles of a chunk, each a 2^-share part of it, spread
 * over its steps: all of it at once, it arrived too late for the first tile and left the others nothing. */
static inline int prefetch_share(int64_t chunk_tiles) { return chunk_tiles >= 4 ? 2 : chunk_tiles >= 2 ? 1 : 0; }

/* The part of the next panel (NULL: none) that the tile_index-th tile of a chunk prefetches */
static inline const char *next_panel_part(const void *next_panel, int64_t panel_bytes, int has_next,
                                          int64_t tile_index, int share) {
    if (!has_next || tile_index >= (1 << share)) return NULL;
    return (const char *)next_panel + tile_index * (panel_bytes >> share);
}

/* A tile's step `step` (of step_bytes of its own panel) asks for the same share of `part` */
static inline void prefetch_step(const char *part, int64_t step, int64_t step_bytes, int share) {
    if (!part) return;
    for (const char *line = part + ((step * step_bytes) >> share), *end = part + (((step + 1) * step_bytes) >> share);
         line < end; line += 64)
        __builtin_prefetch(line);
}

/* Where a chunk's panels split among `team` threads (panels >= team), thread t takes [share_start(t),
 * share_start(t + 1)): whole runs, the first panels % team threads one panel more. */
static inline int64_t share_start(int64_t panels, int team, int t) {
    const int64_t q = panels / team, r = panels % team;
    return t * q + (t < r ? t : r);
}

/* Runs run(ctx, chunk, chunk_end, panel) for every chunk of rows [chunk, chunk_end) of x (chunk_rows) and
 * every panel, on `threads` threads: chunk by chunk, the threads sharing its panels (and its rows in cache)
 * as share_start says; where there are fewer panels than threads, (chunk, panel) pairs shared. */
typedef void (*chunk_panel_fn)(const void *ctx, int64_t chunk, int64_t chunk_end, int64_t panel);
static inline void for_chunk_panels(int64_t m, int64_t panels, int threads, int64_t tile_rows, int64_t max_rows,
                                    chunk_panel_fn run, const void *ctx) {
    const int64_t rows = chunk_rows(m, panels, threads, tile_rows, max_rows), chunks = (m + rows - 1) / rows;
    if (panels >= threads) {
        for (int64_t c = 0; c < chunks; c++) {
#pragma omp parallel num_threads(threads)
            {
                const int team = omp_get_num_threads(), t = omp_get_thread_num();
                for (int64_t p = share_start(panels, team, t); p < share_start(panels, team, t + 1); p++)
                    run(ctx, c * rows, c * rows + rows < m ? c * rows + rows : m, p);
            }
        }
        return;
    }
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t p = 0; p < panels; p++) run(ctx, c * rows, c * rows + rows < m ? c * rows + rows : m, p);
}
#endif
