/* exp(x) for x <= 0 by range reduction and the Cephes single-precision polynomial (about 1 ulp),
 * written so that a loop over it vectorizes (no floorf, no union: GCC vectorizes neither).
 * Shared by the CPU kernels (cpu_decode.c, and cpu_silu.h for cpu_fused.c and cpu_gemm.c). */
#ifndef RAYPAGED_CPU_EXP_H
#define RAYPAGED_CPU_EXP_H

#include <stdint.h>

static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    /* n = x log2(e) rounded to the nearest integer: adding and taking back 1.5 * 2^23 rounds (|n| <= 126) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof(scale));
    return y * scale;
}

#endif
