// 8-float vectors shared by the C++ CPU kernels: GCC/Clang vector extensions, which
// -march=native lowers to AVX2 / AVX-512 / NEON without intrinsics, and a vector exp.

#pragma once

#include <cstdint>
#include <cstring>

namespace qserve_cpu {

constexpr int kLanes = 8;
using vec8 = float __attribute__((vector_size(32)));
using ivec8 = int32_t __attribute__((vector_size(32)));

inline vec8 load8(const float* p) {
  vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, vec8 v) { std::memcpy(p, &v, sizeof(v)); }

inline vec8 splat(float x) { return vec8{} + x; }

// exp(x) (Cephes expf): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial,
// 2^n put in the exponent bits. About 1 ulp for x in [-87, 88]; x is clamped to that range
// (exp(-87) = 1.6e-38, exp(88) = 1.7e38: no denormals, no overflow).
inline vec8 exp8(vec8 x) {
  const vec8 lo = splat(-87.0f), hi = splat(88.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vec8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vec8 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vec8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec8 bits = (__builtin_convertvector(n, ivec8) + 127) << 23;
  vec8 pow2n;
  std::memcpy(&pow2n, &bits, sizeof(pow2n));
  return p * pow2n;
}

}  // namespace qserve_cpu
