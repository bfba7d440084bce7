// 4-bit weight-only matmul on CPU for decode-sized batches: y = x @ W.T (+ bias), W dequantized
// inside the K loop in registers, fp32 accumulation. The full-precision weight is never written.
//
//   x      [M, K]   fp32 / bf16 / fp16, rows x_stride apart;  perm (nullable) int64 [K]: the
//                   kernel reads x[m, perm[k]] (act-order GPTQ: channels sorted by group)
//   qw     uint32 [N/8, K/8, 8]: block b of 8 output channels, word kw, lane l holds the codes
//          q[8kw + j, 8b + l] in bits 4j..4j+3 (GPTQ's packing along K, blocked over N)
//   scales fp32 [N/8, G, 8]   zs = scale * zero  fp32 [N/8, G, 8]   (groups of group_size
//                   consecutive input channels; W[n, k] = scale * q - zs)
//   bias   fp32 [N] (nullable)
//   y      [M, N]   x's dtype, rows y_stride apart
//
// Per group g, with xs[m, g] = sum of x over the group, computed once per call:
//   y[m, n] += scale[g, n] * (sum_{k in g} x[m, k] * q[k, n])  -  zs[g, n] * xs[m, g]
// so the inner loop per 8 codes is shift, mask, int->float convert and one FMA per row.
// Register tile: MB rows x NB blocks of 8 outputs; OpenMP over blocks of outputs.
//
// qserve_w4_dequantize writes W.T fp32 or bf16 [K, N] (input channels in the stored order) for
// large M, where a dense GEMM beats this loop. A plain C entry point called through ctypes, as
// paged_attention_cpu.cpp; GCC/Clang vector extensions, lowered by -march=native.

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_dtypes.h"
#include "cpu_vec.h"

namespace {

using namespace qserve_cpu;

enum Status : int { kOk = 0, kBadDType = 1, kBadShape = 2 };

constexpr int kMaxRows = 4;  // MB
using uvec8 = uint32_t __attribute__((vector_size(32)));

// Code j of a word, isolated by a mask alone: (word & 15 << 4j) = q * 16^j, exact in fp32,
// multiplied by x * 16^-j (see kInvPow16); j = 7 is shifted down instead (AVX2 has no unsigned
// int -> float convert, and its top bit is the sign).
constexpr float kInvPow16[8] = {1.f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.f};

inline uvec8 load8u(const uint32_t* p) {
  uvec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vec8 decode(uvec8 word, int j) {
  const uvec8 bits = j == 7 ? word >> 28 : word & (15u << (4 * j));
  return __builtin_convertvector(reinterpret_cast<ivec8>(bits), vec8);
}

struct Weights {
  const uint32_t* qw;
  const float* scales;
  const float* zs;
  int64_t K, N, group_size, num_groups;
};

// y[m0 : m0 + MB, 8 * b0 : 8 * (b0 + NB)] += the tile's product, for MB > 1 rows sharing each
// decoded code vector. xf holds x pre-scaled by 16^-j (see `row_tile`); accumulators stay in
// `out` [MB][NB * 8] between groups so the per-group partial sums keep the registers.
template <int MB, int NB>
void tile(const Weights& w, const float* xf, const float* xs, int64_t m0, int64_t b0,
          float* out) {
  const int64_t words_per_block = w.K / 8, words_per_group = w.group_size / 8;
  for (int i = 0; i < MB * NB * kLanes; ++i) out[i] = 0.f;
  for (int64_t g = 0; g < w.num_groups; ++g) {
    vec8 part[MB][NB] = {};
    for (int64_t kw = g * words_per_group; kw < (g + 1) * words_per_group; ++kw) {
      uvec8 q[NB];
      for (int nb = 0; nb < NB; ++nb) q[nb] = load8u(w.qw + ((b0 + nb) * words_per_block + kw) * 8);
      const float* xk = xf + m0 * w.K + kw * 8;
      for (int j = 0; j < 8; ++j) {
        vec8 code[NB];
        for (int nb = 0; nb < NB; ++nb) code[nb] = decode(q[nb], j);
        for (int m = 0; m < MB; ++m) {
          const vec8 xv = vec8{} + xk[m * w.K + j];
          for (int nb = 0; nb < NB; ++nb) part[m][nb] += code[nb] * xv;
        }
      }
    }
    for (int nb = 0; nb < NB; ++nb) {
      const int64_t off = ((b0 + nb) * w.num_groups + g) * kLanes;
      const vec8 s = load8(w.scales + off), z = load8(w.zs + off);
      for (int m = 0; m < MB; ++m) {
        float* o = out + (m * NB + nb) * kLanes;
        store8(o, load8(o) + s * part[m][nb] - z * xs[(m0 + m) * w.num_groups + g]);
      }
    }
  }
}

// The single-row case (decode at batch 1), y[0, 8 * b0 : 8 * (b0 + NB)]: for each code j of
// a word, one broadcast x value meets the NB blocks' words, so NB independent FMA chains hide
// the FMA latency (the words are re-read from L1 for each j). Per 8 weights: and, convert, FMA.
template <int NB>
void row_tile(const Weights& w, const float* xf, const float* xs, int64_t b0, float* out) {
  const int64_t words_per_block = w.K / 8, words_per_group = w.group_size / 8;
  const uint32_t* qb = w.qw + b0 * words_per_block * kLanes;
  vec8 acc[NB] = {};
  for (int64_t g = 0; g < w.num_groups; ++g) {
    vec8 part[NB] = {};
    for (int64_t kw = g * words_per_group; kw < (g + 1) * words_per_group; ++kw) {
      for (int j = 0; j < 8; ++j) {
        const vec8 xv = vec8{} + xf[kw * 8 + j];
        for (int nb = 0; nb < NB; ++nb) {
          part[nb] += decode(load8u(qb + (nb * words_per_block + kw) * kLanes), j) * xv;
        }
      }
    }
    for (int nb = 0; nb < NB; ++nb) {
      const int64_t off = ((b0 + nb) * w.num_groups + g) * kLanes;
      acc[nb] += load8(w.scales + off) * part[nb] - load8(w.zs + off) * xs[g];
    }
  }
  for (int nb = 0; nb < NB; ++nb) store8(out + nb * kLanes, acc[nb]);
}

template <int MB>
void blocks_tile(int nb, const Weights& w, const float* xf, const float* xs, int64_t m0,
                 int64_t b0, float* out) {
  switch (nb) {
    case 1:
      return tile<MB, 1>(w, xf, xs, m0, b0, out);
    case 2:
      return tile<MB, 2>(w, xf, xs, m0, b0, out);
    case 3:
      return tile<MB, 3>(w, xf, xs, m0, b0, out);
    default:
      return tile<MB, 4>(w, xf, xs, m0, b0, out);
  }
}

// One tile of mb <= kMaxRows rows and nb <= 4 blocks (nb <= 2 when mb > 1: registers).
void any_tile(int mb, int nb, const Weights& w, const float* xf, const float* xs, int64_t m0,
              int64_t b0, float* out) {
  switch (mb) {
    case 1:
      switch (nb) {
        case 1:
          return row_tile<1>(w, xf + m0 * w.K, xs + m0 * w.num_groups, b0, out);
        case 2:
          return row_tile<2>(w, xf + m0 * w.K, xs + m0 * w.num_groups, b0, out);
        case 3:
          return row_tile<3>(w, xf + m0 * w.K, xs + m0 * w.num_groups, b0, out);
        default:
          return row_tile<4>(w, xf + m0 * w.K, xs + m0 * w.num_groups, b0, out);
      }
    case 2:
      return blocks_tile<2>(nb < 2 ? nb : 2, w, xf, xs, m0, b0, out);
    case 3:
      return blocks_tile<3>(nb < 2 ? nb : 2, w, xf, xs, m0, b0, out);
    default:
      return blocks_tile<4>(nb < 2 ? nb : 2, w, xf, xs, m0, b0, out);
  }
}

// Rows [m0, m0 + mb) x blocks [b0, b0 + nb) of a tile's fp32 sums (row-major, nb * kLanes
// wide), plus the bias, into y in its dtype.
inline void store_tile(const float* out, int mb, int nb, int64_t m0, int64_t b0,
                       const float* bias, void* y, int y_dtype, int64_t y_stride) {
  for (int m = 0; m < mb; ++m) {
    for (int i = 0; i < nb * kLanes; ++i) {
      const int64_t n = b0 * kLanes + i;
      const float v = out[m * nb * kLanes + i] + (bias ? bias[n] : 0.f);
      store(y, y_dtype, (m0 + m) * y_stride + n, v);
    }
  }
}

}  // namespace

// Returns a Status; y must not alias x.
extern "C" int qserve_w4_gemm(const void* x, int x_dtype, int64_t x_stride, const int64_t* perm,
                              const uint32_t* qw, const float* scales, const float* zs,
                              const float* bias, int64_t M, int64_t K, int64_t N,
                              int64_t group_size, void* y, int64_t y_stride, int num_threads) {
  if (x_dtype < kF32 || x_dtype > kF16) return kBadDType;
  if (M < 0 || K <= 0 || N <= 0 || K % 8 || N % 8 || group_size <= 0 || group_size % 8 ||
      K % group_size) {
    return kBadShape;
  }
  if (M == 0) return kOk;
  const Weights w{qw, scales, zs, K, N, group_size, K / group_size};
  std::vector<float> xf(M * K), xs(M * w.num_groups, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t src = perm ? perm[k] : k;
      const float v = load(x, x_dtype, m * x_stride + src);
      xf[m * K + k] = v * kInvPow16[k % 8];
      xs[m * w.num_groups + k / group_size] += v;
    }
  }
  // Blocks of outputs per work item: 4 for a single row, 2 when rows share the codes.
  const int64_t step = M == 1 ? 4 : 2;
  const int64_t num_blocks = N / kLanes, num_items = (num_blocks + step - 1) / step;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t b0 = item * step;
    const int nb = static_cast<int>(num_blocks - b0 < step ? num_blocks - b0 : step);
    alignas(32) float out[kMaxRows * 4 * kLanes];
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mb = static_cast<int>(M - m0 < kMaxRows ? M - m0 : kMaxRows);
      any_tile(mb, nb, w, xf.data(), xs.data(), m0, b0, out);
      store_tile(out, mb, nb, m0, b0, bias, y, x_dtype, y_stride);
    }
  }
  return kOk;
}

// W.T [K, N] in fp32 or bf16 (out_dtype kF32 | kBF16; bf16 rounded to nearest even, as torch
// rounds): W[n, k] = scale[g, n] * q[k, n] - zs[g, n], g = k / group_size (input channels in
// the stored order). Row k of W.T takes 8 lanes from each block: one vector each. bf16 serves
// CPUs with native bf16 matmuls, where a bf16 GEMM on it beats the fp32 one (and it is half
// the bytes to write).
using u16vec8 = uint16_t __attribute__((vector_size(16)));

inline void store8_bf16(uint16_t* p, vec8 v) {
  uvec8 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7fffu + ((bits >> 16) & 1u);  // finite values only: codes times finite scales
  const u16vec8 h = __builtin_convertvector(bits >> 16, u16vec8);
  std::memcpy(p, &h, sizeof(h));
}

extern "C" int qserve_w4_dequantize(const uint32_t* qw, const float* scales, const float* zs,
                                    int64_t K, int64_t N, int64_t group_size, void* out,
                                    int out_dtype, int num_threads) {
  if (out_dtype != kF32 && out_dtype != kBF16) return kBadDType;
  if (K <= 0 || N <= 0 || K % 8 || N % 8 || group_size <= 0 || group_size % 8 ||
      K % group_size) {
    return kBadShape;
  }
  const int64_t num_blocks = N / kLanes, words = K / 8, num_groups = K / group_size;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t kw = 0; kw < words; ++kw) {
    const int64_t g = kw * 8 / group_size;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uvec8 q = load8u(qw + (b * words + kw) * kLanes);
      const vec8 s = load8(scales + (b * num_groups + g) * kLanes);
      const vec8 z = load8(zs + (b * num_groups + g) * kLanes);
      for (int j = 0; j < 8; ++j) {
        const vec8 code = __builtin_convertvector(reinterpret_cast<ivec8>((q >> (4 * j)) & 15u), vec8);
        const int64_t at = (kw * 8 + j) * N + b * kLanes;
        if (out_dtype == kBF16) {
          store8_bf16(static_cast<uint16_t*>(out) + at, s * code - z);
        } else {
          store8(static_cast<float*>(out) + at, s * code - z);
        }
      }
    }
  }
  return kOk;
}

// ---------------------------------------------------------------------------------------------
// qserve_w4a8_gemm: the same y = x @ W.T for 16-bit x at decode sizes, with x quantized per
// group to int8 (llama.cpp's Q8 activations: xi = round(x / dx), dx = max |x| / 127 over the
// group) and int8 dot products: y[m, n] += scale[g, n] * dx[m, g] * sum_k xi[m, k] q[k, n]
// - zs[g, n] * xs[m, g], xs = dx * sum_k xi: exactly x rounded to dx's grid, then the exact
// loop's math (w4a16_ref.quantize_activations_ref is that rounding). In a word, codes j = 0, 2, 4, 6 are the
// bytes of (word & 0x0f0f0f0f) and j = 1, 3, 5, 7 those of (word >> 4 & 0x0f0f0f0f), so one
// u8 x s8 dot product of 4-byte lanes (VNNI vpdpbusd; AVX2: vpmaddubsw + vpmaddwd) takes four
// codes of each of 8 outputs against 4 broadcast activations: per 64 weights, three bit ops
// and two dot products instead of 24 converts and FMAs. x86 with AVX2 only: elsewhere
// qserve_w4a8_supported() is 0 and callers keep qserve_w4_gemm.
#if defined(__AVX2__)
#include "w4a8_tiles.h"

extern "C" int qserve_w4a8_supported() { return 1; }

// Arguments as qserve_w4_gemm's; x bf16 or fp16 (fp32 x keeps the exact loop).
extern "C" int qserve_w4a8_gemm(const void* x, int x_dtype, int64_t x_stride, const int64_t* perm,
                                const uint32_t* qw, const float* scales, const float* zs,
                                const float* bias, int64_t M, int64_t K, int64_t N,
                                int64_t group_size, void* y, int64_t y_stride, int num_threads) {
  if (x_dtype != kBF16 && x_dtype != kF16) return kBadDType;
  if (M < 0 || K <= 0 || N <= 0 || K % 8 || N % 8 || group_size <= 0 || group_size % 8 ||
      K % group_size) {
    return kBadShape;
  }
  if (M == 0) return kOk;
  const Weights w{qw, scales, zs, K, N, group_size, K / group_size};
  std::vector<int32_t> xq(M * K / 4);
  std::vector<float> dx(M * w.num_groups), xs(M * w.num_groups);
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(x, x_dtype, m * x_stride, perm, w, xq.data() + m * K / 4,
                 dx.data() + m * w.num_groups, xs.data() + m * w.num_groups);
  }
  constexpr int64_t step = 4;  // blocks of 8 outputs per work item: 8 independent dot chains
  const int64_t num_blocks = N / kLanes, num_items = (num_blocks + step - 1) / step;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t b0 = item * step;
    const int nb = static_cast<int>(num_blocks - b0 < step ? num_blocks - b0 : step);
    alignas(32) float out[kMaxRows * step * kLanes];
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {  // later rows find the codes in L1/L2
      const int mb = static_cast<int>(M - m0 < kMaxRows ? M - m0 : kMaxRows);
      RowQ8 rows[kMaxRows];
      for (int m = 0; m < mb; ++m) {
        const int64_t r = m0 + m;
        rows[m] = {xq.data() + r * K / 4, dx.data() + r * w.num_groups,
                   xs.data() + r * w.num_groups};
      }
      any_tile_q8(mb, nb, w, rows, b0, out);
      store_tile(out, mb, nb, m0, b0, bias, y, x_dtype, y_stride);
    }
  }
  return kOk;
}
#else
extern "C" int qserve_w4a8_supported() { return 0; }
#endif
