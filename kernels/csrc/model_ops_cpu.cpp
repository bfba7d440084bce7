// Small per-layer ops of the decoder on CPU, one call each instead of 6-12 torch ops (at decode
// sizes a torch op costs more in dispatch than in arithmetic). Each computes what its torch
// reference (kernels/model_ops_ref.py, attention_ref.reshape_and_cache_ref) computes, rounding
// where torch rounds, so 16-bit results are bit-identical to the reference; compiled with
// -ffp-contract=off so that no multiply-add is fused where torch rounds in between.
//
//   qserve_rms_norm      out = weight * dtype(x32 * rsqrt(mean(x32^2) + eps)), x32 = fp32(src);
//                        with a residual: residual = dtype(x + residual) first, src = residual
//                        (vLLM's fused_add_rms_norm). x, residual, out [M, H] rows with strides.
//   qserve_rope_neox     rotate-half RoPE of q [T, Hq * D] and k [T, Hk * D] in place, cos/sin
//                        from cos_sin_cache fp32 [max_pos, D] (cos | sin halves) at positions
//                        int64 [T], rounded to the activation dtype as the reference does.
//   qserve_reshape_and_cache   K/V [T, Hk, D] rows into their slots of the pages
//                        [2, num_blocks * block_size, Hk, D] (slot -1 = skip); fp8 pages get
//                        x / scale (per tensor or per KV head), clamped to the format's range
//                        and rounded to nearest even, as torch's cast.
//   qserve_silu_and_mul  out [M, D] = silu(x[:, :D]) * x[:, D:] (vLLM's silu_and_mul over the
//                        fused gate/up output); exp8 in place of torch's exp, so up to 1 ulp off.
//
// dtype codes: 0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3fn, 4 fp8 e5m2 (pages only).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_dtypes.h"
#include "cpu_vec.h"

namespace {

using namespace qserve_cpu;

constexpr int kE4M3 = 3, kE5M2 = 4;  // page dtypes beyond cpu_dtypes.h's
enum Status : int { kOk = 0, kBadDType = 1, kBadShape = 2, kBadSlot = 3 };

// v rounded to `dtype` and back: what torch holds after an op in that dtype.
inline float round_to(int dtype, float v) {
  switch (dtype) {
    case kBF16:
      return bf16_to_f32(f32_to_bf16(v));
    case kF16:
      return static_cast<float>(static_cast<_Float16>(v));
    default:
      return v;
  }
}

// fp32 -> fp8 with `mant` mantissa bits and exponent bias `bias`, round to nearest even; |v| must
// already be clamped to the format's max (both formats' max is representable). NaN stays NaN.
inline uint8_t f32_to_fp8(float v, int mant, int bias, uint8_t nan) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return sign | nan;
  float a;
  std::memcpy(&a, &bits, sizeof(a));
  const float min_normal = std::ldexp(1.f, 1 - bias);
  if (a < min_normal) {  // subnormal (or zero): units of 2^(1 - bias - mant), ties to even
    const float q = std::nearbyint(std::ldexp(a, bias - 1 + mant));
    return sign | static_cast<uint8_t>(q);  // q == 2^mant is the smallest normal's code
  }
  const int shift = 23 - mant;
  bits += (1u << (shift - 1)) - 1u + ((bits >> shift) & 1u);
  const uint32_t code = (bits >> shift) - (static_cast<uint32_t>(127 - bias) << mant);
  return sign | static_cast<uint8_t>(code);
}

}  // namespace

extern "C" int qserve_rms_norm(const void* x, int64_t x_stride, void* residual,
                               int64_t res_stride, const void* weight, void* out,
                               int64_t out_stride, int64_t M, int64_t H, float eps, int dtype) {
  if (dtype < kF32 || dtype > kF16) return kBadDType;
  if (M < 0 || H <= 0) return kBadShape;
  for (int64_t m = 0; m < M; ++m) {
    const void* src = x;
    int64_t row = m * x_stride;
    if (residual != nullptr) {  // residual = x + residual, in the activation dtype
      for (int64_t h = 0; h < H; ++h) {
        const float s = load(x, dtype, m * x_stride + h) + load(residual, dtype, m * res_stride + h);
        store(residual, dtype, m * res_stride + h, s);
      }
      src = residual;
      row = m * res_stride;
    }
    float sum = 0.f;
    for (int64_t h = 0; h < H; ++h) {
      const float v = load(src, dtype, row + h);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
    for (int64_t h = 0; h < H; ++h) {
      const float normed = round_to(dtype, load(src, dtype, row + h) * inv);
      store(out, dtype, m * out_stride + h, load(weight, dtype, h) * normed);
    }
  }
  return kOk;
}

extern "C" int qserve_rope_neox(void* q, int64_t q_stride, int64_t num_q_heads, void* k,
                                int64_t k_stride, int64_t num_k_heads, const int64_t* positions,
                                const float* cos_sin_cache, int64_t max_position,
                                int64_t num_tokens, int64_t head_dim, int dtype) {
  if (dtype < kF32 || dtype > kF16) return kBadDType;
  if (head_dim <= 0 || head_dim % 2) return kBadShape;
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t pos = positions[t];
    if (pos < 0 || pos >= max_position) return kBadShape;
    const float* cs = cos_sin_cache + pos * head_dim;
    void* tensors[2] = {q, k};
    const int64_t strides[2] = {q_stride, k_stride}, heads[2] = {num_q_heads, num_k_heads};
    for (int which = 0; which < 2; ++which) {
      for (int64_t h = 0; h < heads[which]; ++h) {
        const int64_t base = t * strides[which] + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_to(dtype, cs[i]), s = round_to(dtype, cs[half + i]);
          const float x1 = load(tensors[which], dtype, base + i);
          const float x2 = load(tensors[which], dtype, base + half + i);
          // x * cos + rotate_half(x) * sin, each product rounded as torch does
          const float a1 = round_to(dtype, x1 * c), b1 = round_to(dtype, -x2 * s);
          const float a2 = round_to(dtype, x2 * c), b2 = round_to(dtype, x1 * s);
          store(tensors[which], dtype, base + i, a1 + b1);
          store(tensors[which], dtype, base + half + i, a2 + b2);
        }
      }
    }
  }
  return kOk;
}

extern "C" int qserve_reshape_and_cache(const void* key, const void* value, int64_t kv_stride_t,
                                        int kv_dtype, void* cache, int cache_dtype,
                                        int64_t num_slots, const int64_t* slot_mapping,
                                        int64_t num_tokens, int64_t num_kv_heads,
                                        int64_t head_dim, const float* k_scale,
                                        const float* v_scale) {
  if (kv_dtype < kF32 || kv_dtype > kF16 || cache_dtype < kF32 || cache_dtype > kE5M2) {
    return kBadDType;
  }
  const bool fp8 = cache_dtype >= kE4M3;
  const float fmax = cache_dtype == kE4M3 ? 448.f : 57344.f;
  const int mant = cache_dtype == kE4M3 ? 3 : 2, bias = cache_dtype == kE4M3 ? 7 : 15;
  const uint8_t nan = cache_dtype == kE4M3 ? 0x7f : 0x7f;
  const int64_t row = num_kv_heads * head_dim;
  const void* src[2] = {key, value};
  const float* scales[2] = {k_scale, v_scale};
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    if (slot >= num_slots) return kBadSlot;
    for (int which = 0; which < 2; ++which) {
      const int64_t dst = (which * num_slots + slot) * row;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          const float v = load(src[which], kv_dtype, t * kv_stride_t + h * head_dim + d);
          const int64_t i = dst + h * head_dim + d;
          if (!fp8) {
            store(cache, cache_dtype, i, v);
            continue;
          }
          float y = v / scales[which][h];
          y = y > fmax ? fmax : (y < -fmax ? -fmax : y);
          static_cast<uint8_t*>(cache)[i] = f32_to_fp8(y, mant, bias, nan);
        }
      }
    }
  }
  return kOk;
}

// out[m, d] = silu(g) * u with g = x[m, d], u = x[m, D + d] (the fused gate_up projection's
// halves), silu(g) = g / (1 + exp(-g)) in fp32 rounded to the dtype, then the product rounded,
// as torch's F.silu(g) * u; exp is exp8 (about 1 ulp), so a result can be one unit off torch's.
extern "C" int qserve_silu_and_mul(const void* x, int64_t x_stride, void* out,
                                   int64_t out_stride, int64_t M, int64_t D, int dtype) {
  if (dtype < kF32 || dtype > kF16) return kBadDType;
  if (M < 0 || D < 0) return kBadShape;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t row = m * x_stride;
    for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
      const int n = D - d0 < kLanes ? static_cast<int>(D - d0) : kLanes;
      vec8 g = {}, u = {};
      for (int i = 0; i < n; ++i) {
        g[i] = load(x, dtype, row + d0 + i);
        u[i] = load(x, dtype, row + D + d0 + i);
      }
      const vec8 silu = g / (1.f + exp8(-g));
      for (int i = 0; i < n; ++i) {
        store(out, dtype, m * out_stride + d0 + i, round_to(dtype, silu[i]) * u[i]);
      }
    }
  }
  return kOk;
}
