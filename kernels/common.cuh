// Shared device helpers for raypaged kernels. No CUDA headers are included, so the
// same text compiles under nvcc (CI) and NVRTC (cupy.RawModule at run time), and, under
// RP_HOST_EMULATION, as host C++ after raypaged/kernels/host_runtime.h (kernels run on the CPU).
#ifndef RAYPAGED_COMMON_CUH
#define RAYPAGED_COMMON_CUH

struct half_t { unsigned short bits; };  // IEEE fp16 storage
struct bf16_t { unsigned short bits; };  // bfloat16 storage

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half_t x) {
#ifdef RP_HOST_EMULATION
  return rp_host::half_to_float(x.bits);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
#endif
}
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((unsigned)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
  half_t h;
#ifdef RP_HOST_EMULATION
  h.bits = rp_host::float_to_half(x);
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#endif
  return h;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
  bf16_t h;
#ifdef RP_HOST_EMULATION
  h.bits = rp_host::float_to_bf16(x);
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
#endif
  return h;
}

// Element i of a 16-byte vector held as four 32-bit words, widened to fp32 (register-only:
// no address is taken, so nothing goes through local memory).
template <typename T> __device__ __forceinline__ float element(const unsigned* words, int i);
template <> __device__ __forceinline__ float element<float>(const unsigned* words, int i) {
  return __uint_as_float(words[i]);
}
template <> __device__ __forceinline__ float element<half_t>(const unsigned* words, int i) {
  return to_float(half_t{(unsigned short)(words[i >> 1] >> ((i & 1) * 16))});
}
template <> __device__ __forceinline__ float element<bf16_t>(const unsigned* words, int i) {
  return to_float(bf16_t{(unsigned short)(words[i >> 1] >> ((i & 1) * 16))});
}

// One 16-byte load, kept raw (four registers) until its elements are used.
template <typename T>
__device__ __forceinline__ uint4 load_raw16(const T* __restrict__ src) {
  return *reinterpret_cast<const uint4*>(src);
}

#endif  // RAYPAGED_COMMON_CUH
