// The CUDA device functions and PTX operations kernels/*.cu call, on the host: number formats, the tensor-core
// fragments of mma.sync m16n8k16 and ldmatrix .trans, barriers, warp shuffles and the math built-ins. Included
// by host_runtime.h, whose fibers, barriers and warp exchange they use.
#ifndef RAYPAGED_HOST_DEVICE_H
#define RAYPAGED_HOST_DEVICE_H

namespace rp_host {

// ---- number formats ----
inline float bits_to_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline unsigned float_to_bits(float f) {
  unsigned bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}
inline float half_to_float(unsigned short bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return (float)h;
}
inline unsigned short float_to_half(float x) {  // round to nearest even, as cvt.rn.f16.f32
  const _Float16 h = (_Float16)x;
  unsigned short bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}
inline float bf16_to_float(unsigned short bits) { return bits_to_float((unsigned)bits << 16); }
inline unsigned short float_to_bf16(float x) {  // round to nearest even, as cvt.rn.bf16.f32; NaN stays NaN
  const unsigned bits = float_to_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x40u);
  return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
// each fp16 half of `a` times that of `b`, rounded once (mul.rn.f16x2; fp16 subnormals kept)
inline unsigned mul_f16x2(unsigned a, unsigned b) {
  const unsigned lo = float_to_half(half_to_float((unsigned short)a) * half_to_float((unsigned short)b));
  const unsigned hi = float_to_half(half_to_float((unsigned short)(a >> 16)) * half_to_float((unsigned short)(b >> 16)));
  return lo | (hi << 16);
}

// ---- tensor-core fragments (PTX ISA, mma.m16n8k16 with 16-bit inputs and ldmatrix) ----
// A 16x16 (row): register r of lane l holds rows g, g+8 (r odd) and columns 2c, 2c+1 (+8 for r >= 2), g = l/4,
// c = l%4; B 16x8 (col): register r holds k rows 2c, 2c+1 (+8 for r = 1) of column g; C 16x8: c[i] is row g
// (+8 for i >= 2), column 2c + (i & 1).
template <bool BF16> inline float b16(unsigned word, int high) {
  const unsigned short bits = (unsigned short)(word >> (16 * high));
  return BF16 ? bf16_to_float(bits) : half_to_float(bits);
}

template <bool BF16> inline void mma_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  unsigned words[6] = {a[0], a[1], a[2], a[3], b0, b1};
  std::memcpy(slot(current->lane), words, sizeof words);
  warp_sync(0xffffffffu);
  auto a_at = [](int row, int col) {  // A[row][col] from the lane holding it
    const int lane = (row % 8) * 4 + (col % 8) / 2, reg = (row >= 8) + 2 * (col >= 8);
    unsigned word;
    std::memcpy(&word, slot(lane) + 4 * reg, 4);
    return b16<BF16>(word, col & 1);
  };
  auto b_at = [](int k, int col) {  // B[k][col]
    const int lane = col * 4 + (k % 8) / 2, reg = 4 + (k >= 8);
    unsigned word;
    std::memcpy(&word, slot(lane) + 4 * reg, 4);
    return b16<BF16>(word, k & 1);
  };
  const int g = current->lane / 4, q = current->lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >= 2), col = 2 * q + (i & 1);
    float sum = c[i];
    for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
    out[i] = sum;
  }
  warp_sync(0xffffffffu);
  for (int i = 0; i < 4; ++i) c[i] = out[i];
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lanes 8i..8i+7 give the 8 row addresses (16 bytes each) of
// matrix i; register i of lane l gets matrix i's elements (2(l%4), l/4) and (2(l%4)+1, l/4).
inline void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* row) {
  std::memcpy(slot(current->lane), &row, sizeof row);
  warp_sync(0xffffffffu);
  unsigned out[4];
  const int l = current->lane;
  for (int i = 0; i < 4; ++i) {
    unsigned short halves[2];
    for (int j = 0; j < 2; ++j) {
      const unsigned char* address;
      std::memcpy(&address, slot(8 * i + 2 * (l % 4) + j), sizeof address);
      std::memcpy(&halves[j], address + 2 * (l / 4), 2);
    }
    out[i] = halves[0] | ((unsigned)halves[1] << 16);
  }
  warp_sync(0xffffffffu);
  r0 = out[0], r1 = out[1], r2 = out[2], r3 = out[3];
}

inline void* dynamic_shared() { return launch->dynamic_shared.data(); }

}  // namespace rp_host

// ---- device functions the kernels call ----
#define threadIdx (rp_host::current->thread_idx)
#define blockIdx (rp_host::launch->block_idx)
#define blockDim (rp_host::launch->block)
#define gridDim (rp_host::launch->grid)

inline void __syncthreads() { rp_host::arrive(rp_host::launch->block_barrier, rp_host::launch->alive); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { rp_host::warp_sync(mask); }
template <typename T> inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  return rp_host::shuffle(mask, value, rp_host::current->lane ^ lane_mask, width);
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int source = rp_host::current->lane + int(delta);
  const int end = (rp_host::current->lane & ~(width - 1)) + width;
  return rp_host::shuffle(mask, value, source < end ? source : rp_host::current->lane, width);
}
template <typename T> inline T __shfl_sync(unsigned mask, T value, int source, int width = 32) {
  return rp_host::shuffle(mask, value, (rp_host::current->lane & ~(width - 1)) + (source & (width - 1)), width);
}
template <typename T> inline T atomicAdd(T* address, T value) {  // one fiber runs at a time
  const T old = *address;
  *address = old + value;
  return old;
}
inline float __uint_as_float(unsigned x) { return rp_host::bits_to_float(x); }
inline unsigned __float_as_uint(float x) { return rp_host::float_to_bits(x); }
inline float __int_as_float(int x) { return rp_host::bits_to_float((unsigned)x); }
inline int __float_as_int(float x) { return (int)rp_host::float_to_bits(x); }
// one rounding each, never contracted into an FMA with a neighbouring operation (the empty asm hides the value)
inline float __fmul_rn(float a, float b) {
  float r = a * b;
  asm("" : "+x"(r));
  return r;
}
inline float __fadd_rn(float a, float b) {
  float r = a + b;
  asm("" : "+x"(r));
  return r;
}
inline float __fsub_rn(float a, float b) {
  float r = a - b;
  asm("" : "+x"(r));
  return r;
}
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long bytes = ((unsigned long long)y << 32) | x;
  unsigned result = 0;
  for (int i = 0; i < 4; ++i) result |= (unsigned)((bytes >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return result;
}
template <typename A, typename B> inline auto min(A a, B b) -> std::common_type_t<A, B> {
  return b < a ? b : a;
}
template <typename A, typename B> inline auto max(A a, B b) -> std::common_type_t<A, B> {
  return a < b ? b : a;
}

#endif  // RAYPAGED_HOST_DEVICE_H
