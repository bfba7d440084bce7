// Page and row element conversions of the CPU paged-attention kernel (paged_attention_cpu.cpp):
// fp32 / bf16 / fp16 query and output rows, and fp32 / bf16 / fp16 / fp8 (e4m3fn, e5m2) pages,
// to and from fp32, rounding to nearest even as torch does.

#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace qserve_paged {

// dtype codes shared with cpu_paged_attention.py
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kE4M3 = 3, kE5M2 = 4 };

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__FLT16_MANT_DIG__) && !defined(QSERVE_NO_FLOAT16)  // GCC >= 12, Clang
inline float f16_to_float(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, sizeof(x));
  return static_cast<float>(x);
}

inline uint16_t float_to_f16(float f) {
  const _Float16 x = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &x, sizeof(h));
  return h;
}
#else  // the branch-free conversions c10 uses (FP16 library, M. Dukhan), no denormals needed
inline float f16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u, two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_to_float(sign | float_to_bits(two_w < (1u << 27) ? denormalized : normalized));
}

inline uint16_t float_to_f16(float f) {  // round to nearest even
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = float_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xff000000u, 0x71000000u);
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}
#endif

inline float e4m3fn_to_float(uint8_t b) {
  const float sign = (b & 0x80) ? -1.f : 1.f;
  const int e = (b >> 3) & 0xf, m = b & 7;
  if (e == 0xf && m == 7) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * static_cast<float>(m) * 0.001953125f;  // m * 2^-9
  return sign * bits_to_float(static_cast<uint32_t>(e + 120) << 23 | m << 20);
}

inline float e5m2_to_float(uint8_t b) { return f16_to_float(static_cast<uint16_t>(b) << 8); }

template <int kDType>
const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[b] = kDType == kE4M3 ? e4m3fn_to_float(b) : e5m2_to_float(b);
    }
    return t;
  }();
  return table.data();
}

// n page elements -> fp32
template <int kDType>
void to_float(const void* src, float* dst, int n) {
  if constexpr (kDType == kBF16) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  } else if constexpr (kDType == kF16) {
    const auto* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = f16_to_float(s[i]);
  } else {  // FP8 through a table
    const float* table = fp8_table<kDType>();
    const auto* s = static_cast<const uint8_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = table[s[i]];
  }
}

inline int element_size(int dtype) {
  switch (dtype) {
    case kF32: return 4;
    case kBF16: case kF16: return 2;
    default: return 1;
  }
}

// Query rows in, output rows out (fp32 / bf16 / fp16)
inline void row_to_float(const void* src, int dtype, float* dst, int n, float mul) {
  for (int i = 0; i < n; ++i) {
    float x;
    if (dtype == kF32) x = static_cast<const float*>(src)[i];
    else if (dtype == kBF16) x = bf16_to_float(static_cast<const uint16_t*>(src)[i]);
    else x = f16_to_float(static_cast<const uint16_t*>(src)[i]);
    dst[i] = x * mul;
  }
}

inline void row_from_float(const float* src, void* dst, int dtype, int n, float mul) {
  for (int i = 0; i < n; ++i) {
    const float x = src[i] * mul;
    if (dtype == kF32) static_cast<float*>(dst)[i] = x;
    else if (dtype == kBF16) static_cast<uint16_t*>(dst)[i] = float_to_bf16(x);
    else static_cast<uint16_t*>(dst)[i] = float_to_f16(x);
  }
}

}  // namespace qserve_paged
