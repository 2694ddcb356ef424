/* silu(gate) * up, the one definition of cpu_fused.c's silu_and_mul and of cpu_gemm.c's gate | up linear
 * with it fused, so that the two give the same bits. */
#ifndef RAYPAGED_CPU_SILU_H
#define RAYPAGED_CPU_SILU_H

#include <math.h>
#include <stdint.h>

#include "cpu_exp.h"

/* out = silu(gate) * up over one row of n, silu(g) = g * sigmoid(g) with sigmoid from exp(-|g|) */
static inline void silu_mul_row(const float *gate, const float *up, float *out, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) {
        const float g = gate[d];
        const float e = exp_nonpositive(-fabsf(g));
        const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
        out[d] = g * sigmoid * up[d];
    }
}

#endif
