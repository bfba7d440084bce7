// bf16 matrix-vector products on CPU for decode-sized batches: y = x @ W.T (+ bias), x [M, K]
// and W [N, K] bf16 (rows x_stride / K apart), y [M, N] bf16 rounded once from an fp32 sum,
// bias fp32 [N] (nullable). torch's bf16 matmul at M = 1 reads the weight at about half the
// memory's speed; here each output is a dot product over one weight row, four rows at a time
// (independent accumulators), OpenMP over blocks of rows.
//
// With AVX-512 BF16, vdpbf16ps multiplies 32 bf16 pairs and adds them into 16 fp32 lanes (the
// products are exact in fp32); elsewhere bf16 is widened to fp32 by a 16-bit shift and
// multiplied with FMAs (GCC/Clang vector extensions). Either way the sum is fp32, as torch's.
// A plain C entry point called through ctypes, as the other kernels in this folder.

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_dtypes.h"
#include "cpu_vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace qserve_cpu;

enum Status : int { kOk = 0, kBadDType = 1, kBadShape = 2 };

constexpr int kRowsPerItem = 4;

#if defined(__AVX512BF16__) && defined(__AVX512F__)

// sum_k x[k] * w[r][k] for kRowsPerItem rows r (of which `rows` are real).
inline void dot_rows(const uint16_t* x, const uint16_t* const* w, int rows, int64_t K,
                     float* out) {
  __m512 acc[kRowsPerItem];
  for (int r = 0; r < kRowsPerItem; ++r) acc[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
    for (int r = 0; r < rows; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w[r] + k), xv);
    }
  }
  if (k < K) {  // the tail: masked loads read zeros past K
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k);
    for (int r = 0; r < rows; ++r) {
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, w[r] + k), xv);
    }
  }
  for (int r = 0; r < rows; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#else

using u16vec8 = uint16_t __attribute__((vector_size(16)));
using u32vec8 = uint32_t __attribute__((vector_size(32)));

inline vec8 widen8(const uint16_t* p) {
  u16vec8 h;
  std::memcpy(&h, p, sizeof(h));
  const u32vec8 bits = __builtin_convertvector(h, u32vec8) << 16;
  vec8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void dot_rows(const uint16_t* x, const uint16_t* const* w, int rows, int64_t K,
                     float* out) {
  vec8 acc[kRowsPerItem] = {};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const vec8 xv = widen8(x + k);
    for (int r = 0; r < rows; ++r) acc[r] += widen8(w[r] + k) * xv;
  }
  for (int r = 0; r < rows; ++r) {
    float s = 0.f;
    for (int i = 0; i < kLanes; ++i) s += acc[r][i];
    for (int64_t kk = k; kk < K; ++kk) s += bf16_to_f32(x[kk]) * bf16_to_f32(w[r][kk]);
    out[r] = s;
  }
}

#endif

}  // namespace

// 1 with vdpbf16ps, 0 with the widening loop (the launcher reports which).
extern "C" int qserve_bf16_gemv_native() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

// Returns a Status; y must not alias x or W.
extern "C" int qserve_bf16_gemv(const uint16_t* x, int64_t x_stride, const uint16_t* weight,
                                const float* bias, int64_t M, int64_t K, int64_t N, uint16_t* y,
                                int64_t y_stride, int num_threads) {
  if (M < 0 || K <= 0 || N <= 0) return kBadShape;
  if (M == 0) return kOk;
  const int64_t num_items = (N + kRowsPerItem - 1) / kRowsPerItem;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t n0 = item * kRowsPerItem;
    const int rows = static_cast<int>(N - n0 < kRowsPerItem ? N - n0 : kRowsPerItem);
    const uint16_t* w[kRowsPerItem];
    for (int r = 0; r < kRowsPerItem; ++r) w[r] = weight + (n0 + (r < rows ? r : 0)) * K;
    float out[kRowsPerItem];
    for (int64_t m = 0; m < M; ++m) {  // later rows find the item's weight rows in L1/L2
      dot_rows(x + m * x_stride, w, rows, K, out);
      for (int r = 0; r < rows; ++r) {
        const float v = out[r] + (bias ? bias[n0 + r] : 0.f);
        y[m * y_stride + n0 + r] = f32_to_bf16(v);
      }
    }
  }
  return kOk;
}
