// Scalar dtype conversions shared by the C++ CPU kernels: fp32 / bf16 / fp16 element i of an
// untyped buffer, loaded as fp32 and stored rounded to nearest even, as torch rounds.
// dtype codes: 0 fp32, 1 bf16, 2 fp16 (each kernel's Python launcher uses the same codes).

#pragma once

#include <cstdint>
#include <cstring>

namespace qserve_cpu {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays (quiet) NaN
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float load(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case kF16:
      return static_cast<float>(static_cast<const _Float16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

inline void store(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case kBF16:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
      break;
    case kF16:
      static_cast<_Float16*>(p)[i] = static_cast<_Float16>(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

}  // namespace qserve_cpu
