/* The element formats of a KV cache the CPU kernels read and write (the `format` argument of cpu_decode.c,
 * cpu_prefill.c and cpu_fused.c's rotary_and_cache; raypaged.attention.cpu_ops.cache_format): float32; fp8 e4m3
 * (cpu_fp8.h), holding K / k_scale and V / v_scale; bf16, a bf16 model's (round to nearest even when written,
 * widened exactly when read). Also the bf16 rounding of cpu_gemm.c's bf16 weights. */
#ifndef RAYPAGED_CPU_CACHE_H
#define RAYPAGED_CPU_CACHE_H

#include <stdint.h>

#include "cpu_fp8.h"

enum cache_format { CACHE_F32 = 0, CACHE_FP8_E4M3 = 1, CACHE_BF16 = 2 };

/* bytes of one cache element */
static inline int64_t cache_element_bytes(int format) {
    return format == CACHE_FP8_E4M3 ? 1 : format == CACHE_BF16 ? 2 : 4;
}

/* float32 -> bf16 rounded to nearest even, any NaN the quiet NaN 0x7fc0: torch's .to(torch.bfloat16) */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t bits = f32_to_bits(f);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

/* rows[i] = the float32 value of bf16 values[i], for i < n */
static inline void widen_bf16(const uint16_t *values, int64_t n, float *rows) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) rows[i] = bits_to_f32((uint32_t)values[i] << 16);
}

/* rows[i] = element `first + i` of a cache of `format` (fp8 e4m3 or bf16), widened to float32, for i < n */
static inline void widen_cache(const void *cache, int format, int64_t first, int64_t n, float *rows) {
    if (format == CACHE_FP8_E4M3)
        widen_fp8_e4m3((const uint8_t *)cache + first, n, rows);
    else
        widen_bf16((const uint16_t *)cache + first, n, rows);
}

#endif
