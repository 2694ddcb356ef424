/* One row of an online (flash) softmax, for the CPU prefill kernel (cpu_prefill.c). */
#ifndef RAYPAGED_CPU_SOFTMAX_H
#define RAYPAGED_CPU_SOFTMAX_H

#include <stdint.h>

#include "cpu_exp.h"

/* The row's first `visible` (>= 1) of `width` scores s become the weights exp(s - max), the rest 0, with
 * max_sum[0] the running max and max_sum[1] the running sum of the weights so far; the row's unnormalized
 * output acc[0 .. D) is rescaled when this chunk raises the max. */
static inline void online_softmax_row(float *s, int64_t visible, int64_t width, float *acc, int64_t D,
                                      float *max_sum) {
    float max = max_sum[0], sum = 0.0f;
    for (int64_t j = 0; j < visible; ++j) max = s[j] > max ? s[j] : max;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < width; ++j) {
        const float w = j < visible ? exp_nonpositive(s[j] - max) : 0.0f;
        s[j] = w;
        sum += w;
    }
    if (max != max_sum[0]) {
        const float c = exp_nonpositive(max_sum[0] - max);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] *= c;
        max_sum[1] *= c;
        max_sum[0] = max;
    }
    max_sum[1] += sum;
}

#endif
