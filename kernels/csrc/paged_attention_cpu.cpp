// Paged attention for decode on CPU: one query token per sequence, K/V read in place from the
// pages (no gather copy), online softmax and accumulation in fp32.
//
//   query, out   [num_tokens, num_heads, head_dim]      fp32 / bf16 / fp16, last dim contiguous
//   kv_cache     [2, num_blocks, block_size, num_kv_heads, head_dim]   contiguous; 0 = K, 1 = V
//                fp32 / bf16 / fp16, or fp8 (e4m3fn / e5m2) holding x / scale
//   block_tables [num_seqs, max_blocks] int32 (row stride bt_stride), seq_lens [num_seqs] int32
//   query_start_loc [num_seqs + 1] int32: sequence i owns query rows qsl[i]:qsl[i + 1]
//   k_scale, v_scale [num_kv_heads] fp32: the FP8 page scales (ones for other page dtypes)
//
// sliding_window W > 0: the query (at position seq_len - 1) sees keys (seq_len - 1 - W,
// seq_len - 1] only, the last W tokens; the key loop starts at the first of them, in the middle
// of its page if need be, so a decode costs O(W) rather than O(seq_len). 0 = every key.
//
// Only sequences with exactly one query row are computed; the output rows of the others are
// left as they are (the caller runs prompt chunks elsewhere). One work item = (sequence, a
// range of KV heads; all of them unless there are too few sequences to keep the threads busy),
// so a page is read front to back; the GROUP = num_heads / num_kv_heads query heads sharing a
// KV head use each K/V row once it is loaded. Work items go to OpenMP threads dynamically.
//
// Per page of n <= block_size tokens, KV head h and query head g of its group, all in fp32:
//   s[t]  = q[g] . k[t]                 q pre-multiplied by softmax scale * k_scale[h]
//   m'    = max(m, max_t s[t]);         alpha = exp(m - m');   p[t] = exp(s[t] - m')
//   l     = alpha * l + sum_t p[t];     acc[g] = alpha * acc[g] + sum_t p[t] * v[t]
// and at the end out[g] = acc[g] * v_scale[h] / l.
//
// A plain C entry point (called through ctypes) keeps the build to this file, cpu_vec.h (the
// 8-float vectors and exp8) and paged_attention_dtypes.h (element conversions), without torch's
// headers: a few seconds to compile.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_vec.h"
#include "paged_attention_dtypes.h"

namespace {

using namespace qserve_cpu;
using namespace qserve_paged;  // DType, element conversions

enum Status : int {
  kOk = 0, kBadDType = 1, kBadHeadDim = 2, kBadSeqLen = 3, kBadBlockId = 4, kBadQueryStart = 5
};

inline float hsum(vec8 v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

#if defined(__clang__)
#define QSERVE_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define QSERVE_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, ivec8{__VA_ARGS__})
#endif

// {hsum(a[0]), ..., hsum(a[7])}: lanes added pairwise, then in quads, then the two halves
// (unpack / shufps / perm2f128 on AVX2), 21 operations instead of 8 separate reductions.
inline vec8 hsum8(const vec8* a) {
  vec8 s[4];
  for (int i = 0; i < 4; ++i) {
    s[i] = QSERVE_SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13) +
           QSERVE_SHUFFLE(a[2 * i], a[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  const vec8 u0 = QSERVE_SHUFFLE(s[0], s[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                  QSERVE_SHUFFLE(s[0], s[1], 2, 3, 10, 11, 6, 7, 14, 15);
  const vec8 u1 = QSERVE_SHUFFLE(s[2], s[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                  QSERVE_SHUFFLE(s[2], s[3], 2, 3, 10, 11, 6, 7, 14, 15);
  return QSERVE_SHUFFLE(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         QSERVE_SHUFFLE(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

inline float exp1(float x) { return exp8(splat(x))[0]; }

// --------------------------------------------------------------------------- the kernel

struct Problem {
  const char* query;  // byte pointers and element strides
  char* out;
  int q_dtype;
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h;
  const char* kv;
  int kv_dtype;
  int64_t num_blocks, kv_stride_kv, kv_stride_blk, kv_stride_tok;
  const int32_t* block_tables;
  int64_t bt_stride, max_blocks;
  const int32_t* seq_lens;
  const int32_t* qsl;
  const float* k_scale;
  const float* v_scale;
  float scale;
  int num_heads, num_kv_heads, group, block_size;
  int sliding_window;  // 0 = full causal attention
};

// The first key position a decode query of a seq_len-token sequence sees.
inline int first_key(const Problem& pb, int seq_len) {
  return pb.sliding_window > 0 ? std::max(0, seq_len - pb.sliding_window) : 0;
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Per-thread scratch for up to all heads: queries, accumulators and softmax state per query
// head, one page of scores for a group, and fp32 copies of non-fp32 K and V pages.
struct Workspace {
  std::vector<float> q, acc, m, l, scores, kbuf, vbuf;
  Workspace(const Problem& pb, int D)
      : q(pb.num_heads * D), acc(pb.num_heads * D), m(pb.num_heads), l(pb.num_heads),
        scores(pb.group * round_up(pb.block_size, kLanes)),
        kbuf(static_cast<size_t>(pb.block_size) * pb.num_kv_heads * D),
        vbuf(static_cast<size_t>(pb.block_size) * pb.num_kv_heads * D) {}
};

// s[t] = q . k[t] for t < n (n <= block_size), 8 rows at a time; rows past n - 1 repeat row
// n - 1 (always inside the page) and their scores are ignored.
template <int D>
inline void page_scores(const float* q, const float* k, int64_t k_stride, int n, float* s) {
  for (int t0 = 0; t0 < n; t0 += kLanes) {
    const float* rows[kLanes];
    for (int r = 0; r < kLanes; ++r) rows[r] = k + std::min(t0 + r, n - 1) * k_stride;
    vec8 a[kLanes] = {};
    for (int j = 0; j < D; j += kLanes) {
      const vec8 qj = load8(q + j);
      for (int r = 0; r < kLanes; ++r) a[r] += qj * load8(rows[r] + j);
    }
    store8(s + t0, hsum8(a));
  }
}

// acc[0:D] += sum_t p[t] * v[t, 0:D], 64 columns (32 where D is not a multiple of 64) at a
// time held in registers.
template <int D>
inline void accumulate_v(float* acc, const float* p, const float* v, int64_t v_stride, int n) {
  constexpr int kCols = D % 64 == 0 ? 64 : 32;
  static_assert(D % kCols == 0, "head_dim must be a multiple of 32");
  for (int c = 0; c < D; c += kCols) {
    vec8 a[kCols / kLanes];
    for (int j = 0; j < kCols / kLanes; ++j) a[j] = load8(acc + c + j * kLanes);
    for (int t = 0; t < n; ++t) {
      const vec8 pt = splat(p[t]);
      const float* vr = v + t * v_stride + c;
      for (int j = 0; j < kCols / kLanes; ++j) a[j] += pt * load8(vr + j * kLanes);
    }
    for (int j = 0; j < kCols / kLanes; ++j) store8(acc + c + j * kLanes, a[j]);
  }
}

// Online softmax over one page's scores s[0:n] of one query head; leaves p in s.
template <int D>
inline void softmax_update(float* s, int n, float* m, float* l, float* acc) {
  float page_max = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < n; ++t) page_max = std::max(page_max, s[t]);
  const float m_new = std::max(*m, page_max);
  if (m_new > *m) {
    const float alpha = exp1(*m - m_new);  // ~0 on the first page, where l = acc = 0
    *l *= alpha;
    for (int d = 0; d < D; d += kLanes) store8(acc + d, load8(acc + d) * alpha);
    *m = m_new;
  }
  float sum = 0.f;
  for (int t = 0; t < n; t += kLanes) {  // s is padded to a multiple of 8
    const vec8 p = exp8(load8(s + t) - m_new);
    store8(s + t, p);
    for (int i = 0; i < std::min(kLanes, n - t); ++i) sum += p[i];
  }
  *l += sum;
}

// Rows 0..n-1 of KV heads [h0, h1) of one page as fp32: fp32 pages are read where they are,
// others are converted into buf. Returns the pointer to head h0 of row 0; *stride = row stride.
template <int kDType, int D>
inline const float* page_rows(const Problem& pb, const char* page, int n, int h0, int h1,
                              float* buf, int64_t* stride) {
  constexpr int64_t kSize = kDType == kF32 ? 4 : kDType == kBF16 || kDType == kF16 ? 2 : 1;
  const char* first = page + static_cast<int64_t>(h0) * D * kSize;
  if constexpr (kDType == kF32) {
    *stride = pb.kv_stride_tok;
    return reinterpret_cast<const float*>(first);
  } else {
    const int width = (h1 - h0) * D;
    for (int t = 0; t < n; ++t) {
      to_float<kDType>(first + t * pb.kv_stride_tok * kSize, buf + t * width, width);
    }
    *stride = width;
    return buf;
  }
}

void load_queries(const Problem& pb, int64_t row, int h0, int h1, int D, float* q) {
  const int size = element_size(pb.q_dtype);
  for (int h = h0; h < h1; ++h) {
    for (int g = 0; g < pb.group; ++g) {
      const int head = h * pb.group + g;
      row_to_float(pb.query + (row * pb.q_stride_t + head * pb.q_stride_h) * size, pb.q_dtype,
                   q + (head - h0 * pb.group) * D, D, pb.scale * pb.k_scale[h]);
    }
  }
}

void store_outputs(const Problem& pb, int64_t row, int h0, int h1, int D, const Workspace& ws) {
  const int size = element_size(pb.q_dtype);
  for (int h = h0; h < h1; ++h) {
    for (int g = 0; g < pb.group; ++g) {
      const int head = h * pb.group + g, i = head - h0 * pb.group;
      row_from_float(ws.acc.data() + i * D,
                     pb.out + (row * pb.o_stride_t + head * pb.o_stride_h) * size, pb.q_dtype, D,
                     pb.v_scale[h] / ws.l[i]);
    }
  }
}

// One sequence, KV heads [h0, h1): every page in its window once, front to back (the first one
// from the window's first key on).
template <int kDType, int D>
void attend(const Problem& pb, int seq, int h0, int h1, Workspace& ws) {
  constexpr int64_t kSize = kDType == kF32 ? 4 : kDType == kBF16 || kDType == kF16 ? 2 : 1;
  const int G = pb.group, bs = pb.block_size, seq_len = pb.seq_lens[seq];
  const int row = pb.qsl[seq];
  load_queries(pb, row, h0, h1, D, ws.q.data());
  std::fill(ws.acc.begin(), ws.acc.end(), 0.f);
  std::fill(ws.m.begin(), ws.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(ws.l.begin(), ws.l.end(), 0.f);
  const int32_t* table = pb.block_tables + seq * pb.bt_stride;
  const int s_stride = round_up(bs, kLanes);
  for (int start = first_key(pb, seq_len), n = 0; start < seq_len; start += n) {
    const int offset = start % bs;  // 0 except on the window's first page
    n = std::min(bs - offset, seq_len - start);
    const char* k_page =
        pb.kv + (table[start / bs] * pb.kv_stride_blk + offset * pb.kv_stride_tok) * kSize;
    const char* v_page = k_page + pb.kv_stride_kv * kSize;
    int64_t ks, vs;
    const float* k = page_rows<kDType, D>(pb, k_page, n, h0, h1, ws.kbuf.data(), &ks);
    const float* v = page_rows<kDType, D>(pb, v_page, n, h0, h1, ws.vbuf.data(), &vs);
    for (int h = 0; h < h1 - h0; ++h) {
      for (int g = 0; g < G; ++g) {
        const int i = h * G + g;
        float* s = ws.scores.data() + g * s_stride;
        page_scores<D>(ws.q.data() + i * D, k + h * D, ks, n, s);
        softmax_update<D>(s, n, &ws.m[i], &ws.l[i], ws.acc.data() + i * D);
        accumulate_v<D>(ws.acc.data() + i * D, s, v + h * D, vs, n);
      }
    }
  }
  store_outputs(pb, row, h0, h1, D, ws);
}

template <int kDType, int D>
void run(const Problem& pb, const std::vector<int>& seqs, int num_threads) {
  // Split a sequence's KV heads only when sequences alone cannot keep the threads busy.
  const int64_t num_seqs = static_cast<int64_t>(seqs.size());
  const int splits = static_cast<int>(
      std::min<int64_t>(pb.num_kv_heads, (4 * num_threads + num_seqs - 1) / num_seqs));
  const int heads_per_item = (pb.num_kv_heads + splits - 1) / splits;
  const int items_per_seq = (pb.num_kv_heads + heads_per_item - 1) / heads_per_item;
  const int64_t num_items = num_seqs * items_per_seq;
  num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, num_items)));
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    Workspace ws(pb, D);
    for (int64_t item = next++; item < num_items; item = next++) {
      const int h0 = static_cast<int>(item % items_per_seq) * heads_per_item;
      attend<kDType, D>(pb, seqs[item / items_per_seq], h0,
                        std::min(h0 + heads_per_item, pb.num_kv_heads), ws);
    }
  }
}

template <int kDType>
void run_head_dim(const Problem& pb, const std::vector<int>& seqs, int head_dim, int threads) {
  switch (head_dim) {
    case 64: run<kDType, 64>(pb, seqs, threads); break;
    case 96: run<kDType, 96>(pb, seqs, threads); break;  // Phi-3
    case 128: run<kDType, 128>(pb, seqs, threads); break;
    default: run<kDType, 256>(pb, seqs, threads); break;  // Gemma 3
  }
}

// The decode sequences, each checked against its block table (no out-of-bounds page reads),
// and the number of sequences with a longer chunk of queries (left to the caller).
Status decode_sequences(const Problem& pb, int num_seqs, int64_t num_tokens,
                        std::vector<int>* seqs, int* chunks) {
  *chunks = 0;
  if (pb.qsl[0] < 0 || pb.qsl[num_seqs] != num_tokens) return kBadQueryStart;
  for (int i = 0; i < num_seqs; ++i) {
    if (pb.qsl[i + 1] < pb.qsl[i]) return kBadQueryStart;
  }
  for (int i = 0; i < num_seqs; ++i) {
    const int query_len = pb.qsl[i + 1] - pb.qsl[i];
    *chunks += query_len > 1;
    if (query_len != 1) continue;
    const int seq_len = pb.seq_lens[i];
    if (seq_len < 1 || seq_len > pb.max_blocks * pb.block_size) return kBadSeqLen;
    const int32_t* table = pb.block_tables + i * pb.bt_stride;
    // only the pages it reads: those before a window may have been freed
    for (int b = first_key(pb, seq_len) / pb.block_size;
         b < (seq_len + pb.block_size - 1) / pb.block_size; ++b) {
      if (table[b] < 0 || table[b] >= pb.num_blocks) return kBadBlockId;
    }
    seqs->push_back(i);
  }
  return kOk;
}

}  // namespace

// Strides are in elements; kv_cache is contiguous; query_start_loc must rise from >= 0 to
// num_tokens (the query rows); sliding_window <= 0 means none. Returns a Status (0 = ok) and, in
// *num_chunks, how many sequences have more than one query row (not computed here).
extern "C" int qserve_paged_attention_decode(
    const void* query, void* out, int q_dtype, int64_t q_stride_t, int64_t q_stride_h,
    int64_t o_stride_t, int64_t o_stride_h, const void* kv_cache, int kv_dtype,
    int64_t num_blocks, int block_size, int num_kv_heads, int head_dim, int num_heads,
    const int32_t* block_tables, int64_t bt_stride, int64_t max_blocks, const int32_t* seq_lens,
    const int32_t* query_start_loc, int num_seqs, int64_t num_tokens, const float* k_scale,
    const float* v_scale, float scale, int sliding_window, int num_threads,
    int32_t* num_chunks) {
  if (q_dtype < kF32 || q_dtype > kF16 || kv_dtype < kF32 || kv_dtype > kE5M2) return kBadDType;
  if (head_dim != 64 && head_dim != 96 && head_dim != 128 && head_dim != 256) return kBadHeadDim;
  const int64_t tok = static_cast<int64_t>(num_kv_heads) * head_dim;
  const Problem pb{static_cast<const char*>(query), static_cast<char*>(out), q_dtype,
                   q_stride_t, q_stride_h, o_stride_t, o_stride_h,
                   static_cast<const char*>(kv_cache), kv_dtype, num_blocks,
                   num_blocks * block_size * tok, block_size * tok, tok,
                   block_tables, bt_stride, max_blocks, seq_lens, query_start_loc,
                   k_scale, v_scale, scale, num_heads, num_kv_heads, num_heads / num_kv_heads,
                   block_size, std::max(sliding_window, 0)};
  std::vector<int> seqs;
  const Status status = decode_sequences(pb, num_seqs, num_tokens, &seqs, num_chunks);
  if (status != kOk || seqs.empty()) return status;
  switch (kv_dtype) {
    case kF32: run_head_dim<kF32>(pb, seqs, head_dim, num_threads); break;
    case kBF16: run_head_dim<kBF16>(pb, seqs, head_dim, num_threads); break;
    case kF16: run_head_dim<kF16>(pb, seqs, head_dim, num_threads); break;
    case kE4M3: run_head_dim<kE4M3>(pb, seqs, head_dim, num_threads); break;
    default: run_head_dim<kE5M2>(pb, seqs, head_dim, num_threads); break;
  }
  return kOk;
}
