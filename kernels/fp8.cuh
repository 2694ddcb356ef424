// fp8 e4m3fn (1 sign, 4 exponent, 3 mantissa bits, bias 7, no infinities, NaN 0x7f/0xff) to and from float32,
// bit for bit as torch's .to(torch.float8_e4m3fn) and back, by the rules of raypaged/attention/cpu_fp8.h (the CPU
// kernels'): round to nearest even, magnitudes beyond 448 (infinities too) saturate to 448, NaN stays NaN (its sign
// kept), subnormals down to 2^-9. An fp8 KV cache holds K/V with scale 1.0.
//
// Integer and bit operations only (and, in the narrowing, the one float add torch's own conversion makes); no CUDA
// headers: the same text compiles as device code under nvcc and NVRTC (inlined by raypaged/kernels/loader.py) and
// as host C/C++ (tests/kernels/test_fp8_conversions.py builds it with the host compiler and checks every byte and a
// sweep of floats against torch). Only fp8x4_to_f16x4 and to_float below are device-only.
#ifndef RAYPAGED_FP8_CUH
#define RAYPAGED_FP8_CUH

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define RP_FP8_FN __host__ __device__ __forceinline__
#else
#define RP_FP8_FN static inline
#endif

struct fp8_e4m3_t { unsigned char bits; };  // an fp8 e4m3fn cache element (torch.float8_e4m3fn's storage)

RP_FP8_FN float fp8_bits_to_f32(unsigned bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

RP_FP8_FN unsigned fp8_f32_to_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  unsigned bits;
  __builtin_memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// e4m3 -> float32, exact (every e4m3 value is a float32 one).
RP_FP8_FN float fp8_e4m3_to_f32(unsigned char b) {
  const unsigned magnitude = b & 0x7fu, sign = (unsigned)(b & 0x80u) << 24;
  // normal: exponent and mantissa move to float32's places, the exponent rebased from 7 to 127
  const unsigned normal = (magnitude << 20) + (120u << 23);
  // subnormal m * 2^-9 (m = 1..7) in float32 bits
  const unsigned subnormal = magnitude >= 4   ? (120u << 23) | ((magnitude & 3u) << 21)
                             : magnitude >= 2 ? (119u << 23) | ((magnitude & 1u) << 22)
                             : magnitude == 1 ? 118u << 23
                                              : 0u;
  unsigned bits = magnitude >= 8 ? normal : subnormal;
  bits = magnitude == 0x7fu ? 0x7fc00000u : bits;  // NaN
  return fp8_bits_to_f32(bits | sign);
}

// float32 -> e4m3 (the narrowing torch makes; a float16 or bfloat16 value widens to float32 exactly first).
RP_FP8_FN unsigned char f32_to_fp8_e4m3(float f) {
  unsigned bits = fp8_f32_to_bits(f);
  const unsigned sign = bits & 0x80000000u;
  bits ^= sign;
  // below 2^-6 (fp8's smallest normal): adding 2^14 (bits 141 << 23), whose float32 spacing is 2^-9 (fp8's
  // subnormal step), rounds to a multiple of 2^-9, ties to even, and leaves the multiple in the low bits. (A float32
  // subnormal input flushed to zero by the add gives 0, its right answer either way.)
  const unsigned denormal_magic = 141u << 23;
  const unsigned small = fp8_f32_to_bits(fp8_bits_to_f32(bits) + fp8_bits_to_f32(denormal_magic)) - denormal_magic;
  // normal: round the 23-bit mantissa to 3 bits, ties to even, and rebase the exponent
  const unsigned odd = (bits >> 20) & 1u;
  const unsigned normal = ((bits + ((unsigned)(7 - 127) << 23) + 0x7ffffu + odd) >> 20) & 0xffu;
  unsigned result = bits < (121u << 23) ? small : normal;
  result = bits >= 0x43e80000u ? 0x7eu : result;  // from 464 up (infinity too) saturates to 448, the largest
  result = bits > 0x7f800000u ? 0x7fu : result;   // NaN
  return (unsigned char)(result | (sign >> 24));
}

// The four e4m3 bytes of `w` (element i in bits 8i..8i+7) as two fp16x2 words of their values / 256: `even` holds
// elements 0 (low half) and 2 (high half), `odd` elements 1 and 3. Each half is the byte's sign at bit 15 and its
// exponent and mantissa at bits 13..7: the fp16 of value / 2^8, exactly (a subnormal m * 2^-9 becomes the fp16
// subnormal m * 2^-17); a NaN code (magnitude 0x7f) gets bit 14 too, which makes it an fp16 NaN. Multiplied by 256
// in fp16 (fp8x4_to_f16x4) every element is its e4m3 value exactly: all of them are fp16 values.
RP_FP8_FN void fp8x4_to_f16x4_div256(unsigned w, unsigned* even, unsigned* odd) {
  const unsigned magnitude = w & 0x7f7f7f7fu;
  // a byte's bit 7: set where its magnitude is 0x7f (adding 1 carries into it; no carry crosses bytes)
  const unsigned nan = (magnitude + 0x01010101u) & 0x80808080u;
  const unsigned bits = magnitude | nan;  // per byte: exponent and mantissa, and the NaN flag above them
  *even = ((bits & 0x00ff00ffu) << 7) | ((w & 0x00800080u) << 8);
  *odd = ((bits & 0xff00ff00u) >> 1) | (w & 0x80008000u);
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// fp8x4_to_f16x4_div256 scaled back by 256 with one exact fp16x2 multiply each (no .ftz: the fp16 subnormals are
// kept): `even` = elements 0 and 2, `odd` = elements 1 and 3, each its e4m3 value as fp16 (NaN as an fp16 NaN).
__device__ __forceinline__ void fp8x4_to_f16x4(unsigned w, unsigned& even, unsigned& odd) {
  fp8x4_to_f16x4_div256(w, &even, &odd);
  const unsigned scale = 0x5c005c00u;  // 256.0 in both fp16 halves
#ifdef RP_HOST_EMULATION
  even = rp_host::mul_f16x2(even, scale);
  odd = rp_host::mul_f16x2(odd, scale);
#else
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(even) : "r"(scale));
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(odd) : "r"(scale));
#endif
}

__device__ __forceinline__ float to_float(fp8_e4m3_t x) { return fp8_e4m3_to_f32(x.bits); }
#endif

#endif  // RAYPAGED_FP8_CUH
