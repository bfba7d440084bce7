// The int8-activation tiles of qserve_w4a8_gemm (w4a16_cpu.cpp explains the math), included
// by that file after `Weights`, on x86 with AVX2 only.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else  // pair sums of u8 x s8 <= 2 * 15 * 127: int16 never saturates
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                 _mm256_set1_epi16(1)));
#endif
}

// One row's activations: xq [K / 8][2] int32 (the even and the odd codes' four int8 each),
// dx and xs [num_groups].
struct RowQ8 {
  const int32_t* xq;
  const float* dx;
  const float* xs;
};

template <int NB>
void row_tile_q8(const Weights& w, const RowQ8& x, int64_t b0, float* out) {
  const int64_t words_per_block = w.K / 8, words_per_group = w.group_size / 8;
  const uint32_t* qb = w.qw + b0 * words_per_block * kLanes;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  __m256 acc[NB];
  for (int nb = 0; nb < NB; ++nb) acc[nb] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.num_groups; ++g) {
    __m256i even[NB], odd[NB];
    for (int nb = 0; nb < NB; ++nb) even[nb] = odd[nb] = _mm256_setzero_si256();
    for (int64_t kw = g * words_per_group; kw < (g + 1) * words_per_group; ++kw) {
      const __m256i xe = _mm256_set1_epi32(x.xq[2 * kw]), xo = _mm256_set1_epi32(x.xq[2 * kw + 1]);
      for (int nb = 0; nb < NB; ++nb) {
        const __m256i q = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qb + (nb * words_per_block + kw) * kLanes));
        even[nb] = dot_u8s8(even[nb], _mm256_and_si256(q, mask), xe);
        odd[nb] = dot_u8s8(odd[nb], _mm256_and_si256(_mm256_srli_epi32(q, 4), mask), xo);
      }
    }
    const __m256 dx = _mm256_set1_ps(x.dx[g]), xs = _mm256_set1_ps(x.xs[g]);
    for (int nb = 0; nb < NB; ++nb) {
      const int64_t off = ((b0 + nb) * w.num_groups + g) * kLanes;
      const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(w.scales + off), dx);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(even[nb], odd[nb]));
      acc[nb] = _mm256_fmadd_ps(dot, s, acc[nb]);
      acc[nb] = _mm256_fnmadd_ps(_mm256_loadu_ps(w.zs + off), xs, acc[nb]);
    }
  }
  for (int nb = 0; nb < NB; ++nb) _mm256_storeu_ps(out + nb * kLanes, acc[nb]);
}

void any_row_tile_q8(int nb, const Weights& w, const RowQ8& x, int64_t b0, float* out) {
  switch (nb) {
    case 1:
      return row_tile_q8<1>(w, x, b0, out);
    case 2:
      return row_tile_q8<2>(w, x, b0, out);
    case 3:
      return row_tile_q8<3>(w, x, b0, out);
    default:
      return row_tile_q8<4>(w, x, b0, out);
  }
}

// Rows m < MB (MB > 1) x NB blocks: each block's codes are split into even / odd bytes once
// per word and meet every row's broadcast activations; out [MB][NB * 8].
template <int MB, int NB>
void tile_q8(const Weights& w, const RowQ8* x, int64_t b0, float* out) {
  const int64_t words_per_block = w.K / 8, words_per_group = w.group_size / 8;
  const uint32_t* qb = w.qw + b0 * words_per_block * kLanes;
  const __m256i mask = _mm256_set1_epi8(0x0f);
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int nb = 0; nb < NB; ++nb) acc[m][nb] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.num_groups; ++g) {
    __m256i part[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int nb = 0; nb < NB; ++nb) part[m][nb] = _mm256_setzero_si256();
    for (int64_t kw = g * words_per_group; kw < (g + 1) * words_per_group; ++kw) {
      __m256i lo[NB], hi[NB];
      for (int nb = 0; nb < NB; ++nb) {
        const __m256i q = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qb + (nb * words_per_block + kw) * kLanes));
        lo[nb] = _mm256_and_si256(q, mask);
        hi[nb] = _mm256_and_si256(_mm256_srli_epi32(q, 4), mask);
      }
      for (int m = 0; m < MB; ++m) {
        const __m256i xe = _mm256_set1_epi32(x[m].xq[2 * kw]);
        const __m256i xo = _mm256_set1_epi32(x[m].xq[2 * kw + 1]);
        for (int nb = 0; nb < NB; ++nb) {
          part[m][nb] = dot_u8s8(dot_u8s8(part[m][nb], lo[nb], xe), hi[nb], xo);
        }
      }
    }
    for (int nb = 0; nb < NB; ++nb) {
      const int64_t off = ((b0 + nb) * w.num_groups + g) * kLanes;
      const __m256 s = _mm256_loadu_ps(w.scales + off), z = _mm256_loadu_ps(w.zs + off);
      for (int m = 0; m < MB; ++m) {
        const __m256 dot = _mm256_cvtepi32_ps(part[m][nb]);
        acc[m][nb] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s, _mm256_set1_ps(x[m].dx[g])),
                                     acc[m][nb]);
        acc[m][nb] = _mm256_fnmadd_ps(z, _mm256_set1_ps(x[m].xs[g]), acc[m][nb]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int nb = 0; nb < NB; ++nb) _mm256_storeu_ps(out + (m * NB + nb) * kLanes, acc[m][nb]);
}

template <int MB>
void blocks_tile_q8(int nb, const Weights& w, const RowQ8* x, int64_t b0, float* out) {
  if (nb == 1) return tile_q8<MB, 1>(w, x, b0, out);
  return tile_q8<MB, 2>(w, x, b0, out);
}

// mb <= 4 rows x nb <= 4 blocks (in pairs of blocks when mb > 1: registers); out [mb][nb * 8].
void any_tile_q8(int mb, int nb, const Weights& w, const RowQ8* x, int64_t b0, float* out) {
  if (mb == 1) return any_row_tile_q8(nb, w, x[0], b0, out);
  alignas(32) float part[4 * 2 * kLanes];
  for (int half = 0; half < nb; half += 2) {
    const int nh = nb - half < 2 ? nb - half : 2;
    switch (mb) {
      case 2:
        blocks_tile_q8<2>(nh, w, x, b0 + half, part);
        break;
      case 3:
        blocks_tile_q8<3>(nh, w, x, b0 + half, part);
        break;
      default:
        blocks_tile_q8<4>(nh, w, x, b0 + half, part);
    }
    for (int m = 0; m < mb; ++m) {
      std::memcpy(out + (m * nb + half) * kLanes, part + m * nh * kLanes,
                  nh * kLanes * sizeof(float));
    }
  }
}

// Row m of x (through perm) to int8 per group: xq, dx, xs as RowQ8 describes.
void quantize_row(const void* x, int x_dtype, int64_t offset, const int64_t* perm,
                  const Weights& w, int32_t* xq, float* dx, float* xs) {
  std::vector<float> v(w.group_size);
  for (int64_t g = 0; g < w.num_groups; ++g) {
    float amax = 0.f;
    for (int64_t i = 0; i < w.group_size; ++i) {
      const int64_t k = g * w.group_size + i;
      v[i] = load(x, x_dtype, offset + (perm ? perm[k] : k));
      amax = v[i] > amax ? v[i] : (-v[i] > amax ? -v[i] : amax);
    }
    dx[g] = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < w.group_size; i += 8) {
      uint8_t b[8];
      for (int j = 0; j < 8; ++j) {
        const int32_t xi = static_cast<int32_t>(__builtin_lrintf(v[i + j] * inv));
        sum += xi;
        b[j] = static_cast<uint8_t>(static_cast<int8_t>(xi));
      }
      const uint8_t even[4] = {b[0], b[2], b[4], b[6]}, odd[4] = {b[1], b[3], b[5], b[7]};
      int32_t* dst = xq + 2 * ((g * w.group_size + i) / 8);
      std::memcpy(dst, even, 4);
      std::memcpy(dst + 1, odd, 4);
    }
    xs[g] = dx[g] * static_cast<float>(sum);
  }
}

}  // namespace

