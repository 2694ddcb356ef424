/* fp8 e4m3fn (1 sign, 4 exponent, 3 mantissa bits, bias 7, no infinities, NaN 0x7f/0xff) to and from
 * float32, bit for bit as torch's .to(torch.float8_e4m3fn) and back: rounding to nearest even,
 * magnitudes beyond 448 (infinities too) saturating to 448, NaN to NaN, subnormals down to 2^-9.
 * Written so that loops over them vectorize (no branches GCC cannot turn into selects).
 * Shared by the CPU kernels that read or write an fp8 KV cache (cpu_decode.c, cpu_prefill.c, cpu_fused.c). */
#ifndef RAYPAGED_CPU_FP8_H
#define RAYPAGED_CPU_FP8_H

#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
#include <immintrin.h>
#endif

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

/* rows[i] = fp8_e4m3_to_f32(fp8[i]) for i < n */
static inline void widen_fp8_e4m3(const uint8_t *fp8, int64_t n, float *rows) {
    int64_t i = 0;
#if defined(__AVX512F__)
    /* e4m3 as half-precision bits (sign to bit 15, exponent and mantissa to bits 13..7: the value / 2^8, subnormals
     * included), widened by the hardware (F16C) and scaled back by 2^8, exactly; the NaN codes (magnitude 0x7f)
     * set apart. 16 at a time with AVX-512, 8 with AVX2; the rest as fp8_e4m3_to_f32. */
    const __m512i magnitude_mask = _mm512_set1_epi32(0x7f), nan_code = _mm512_set1_epi32(0x7f);
    const __m512 scale = _mm512_set1_ps(256.0f), nan = _mm512_set1_ps(__builtin_nanf(""));
    for (; i + 16 <= n; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(fp8 + i)));
        const __m512i magnitude = _mm512_and_si512(b, magnitude_mask);
        const __m512i half = _mm512_or_si512(_mm512_slli_epi32(magnitude, 7),
                                             _mm512_slli_epi32(_mm512_andnot_si512(magnitude_mask, b), 8));
        __m512 value = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(half)), scale);
        const __mmask16 is_nan = _mm512_cmpeq_epi32_mask(magnitude, nan_code);
        value = _mm512_mask_mov_ps(value, is_nan, nan);
        _mm512_storeu_ps(rows + i, value);
    }
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256i magnitude_mask = _mm256_set1_epi32(0x7f), nan_code = _mm256_set1_epi32(0x7f);
    const __m256 scale = _mm256_set1_ps(256.0f), nan = _mm256_set1_ps(__builtin_nanf(""));
    for (; i + 8 <= n; i += 8) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(fp8 + i)));
        const __m256i magnitude = _mm256_and_si256(b, magnitude_mask);
        const __m256i half = _mm256_or_si256(_mm256_slli_epi32(magnitude, 7),
                                             _mm256_slli_epi32(_mm256_andnot_si256(magnitude_mask, b), 8));
        const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
        const __m256 value = _mm256_mul_ps(_mm256_cvtph_ps(halves), scale);
        const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(magnitude, nan_code));
        _mm256_storeu_ps(rows + i, _mm256_blendv_ps(value, nan, is_nan));
    }
#endif
    for (; i < n; ++i) rows[i] = fp8_e4m3_to_f32(fp8[i]);
}

#endif
