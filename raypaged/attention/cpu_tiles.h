/* How the GEMMs of cpu_gemm.c and cpu_int8.c split their work: chunks of rows of x times column panels. */
#ifndef RAYPAGED_CPU_TILES_H
#define RAYPAGED_CPU_TILES_H
#include <stdint.h>

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

/* The next panel is prefetched by the first 1, 2 or 4 tiles of a chunk, each a 2^-share part of it */
static inline int prefetch_share(int64_t chunk_tiles) { return chunk_tiles >= 4 ? 2 : chunk_tiles >= 2 ? 1 : 0; }
#endif
