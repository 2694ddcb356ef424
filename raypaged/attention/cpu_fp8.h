/* fp8 e4m3fn (1 sign, 4 exponent, 3 mantissa bits, bias 7, no infinities, NaN 0x7f/0xff) to and from
 * float32, bit for bit as torch's .to(torch.float8_e4m3fn) and back: rounding to nearest even,
 * magnitudes beyond 448 (infinities too) saturating to 448, NaN to NaN, subnormals down to 2^-9.
 * Written so that loops over them vectorize (no branches GCC cannot turn into selects).
 * Shared by the CPU kernels that read or write an fp8 KV cache (cpu_decode.c, cpu_prefill.c, cpu_fused.c). */
#ifndef RAYPAGED_CPU_FP8_H
#define RAYPAGED_CPU_FP8_H

#include <stdint.h>

static inline float bits_to_f32(uint32_t bits) {
    float f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof(bits));
    return bits;
}

static inline float fp8_e4m3_to_f32(uint8_t b) {
    const uint32_t magnitude = b & 0x7f, sign = (uint32_t)(b & 0x80) << 24;
    /* normal: exponent and mantissa move to float32's places, the exponent rebased from 7 to 127 */
    const uint32_t normal = (magnitude << 20) + (120u << 23);
    /* subnormal m * 2^-9 (m = 1..7) in float32 bits, in integers only: GCC will not vectorize a select whose
     * arm holds float arithmetic (it might trap) */
    const uint32_t subnormal = magnitude >= 4   ? (120u << 23) | ((magnitude & 3) << 21)
                               : magnitude >= 2 ? (119u << 23) | ((magnitude & 1) << 22)
                               : magnitude == 1 ? 118u << 23
                                                : 0u;
    uint32_t bits = magnitude >= 8 ? normal : subnormal;
    bits = magnitude == 0x7f ? 0x7fc00000u : bits; /* NaN */
    return bits_to_f32(bits | sign);
}

static inline uint8_t f32_to_fp8_e4m3(float f) {
    uint32_t bits = f32_to_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    /* below 2^-6 (fp8's smallest normal): adding 2^14 (bits 141 << 23), whose float32 spacing is 2^-9 (fp8's
     * subnormal step), rounds to a multiple of 2^-9, ties to even, and leaves the multiple in the low bits */
    const uint32_t denormal_magic = 141u << 23;
    const uint32_t small = f32_to_bits(bits_to_f32(bits) + bits_to_f32(denormal_magic)) - denormal_magic;
    /* normal: round the 23-bit mantissa to 3 bits, ties to even, and rebase the exponent */
    const uint32_t odd = (bits >> 20) & 1;
    const uint32_t normal = ((bits + ((uint32_t)(7 - 127) << 23) + 0x7ffff + odd) >> 20) & 0xff;
    uint32_t result = bits < (121u << 23) ? small : normal;
    result = bits >= 0x43e80000u ? 0x7e : result; /* from 464 up (infinity too) saturates to 448, the largest */
    result = bits > 0x7f800000u ? 0x7f : result;  /* NaN */
    return (uint8_t)(result | (sign >> 24));
}

#endif
