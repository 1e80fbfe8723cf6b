// Attention for decoding and verification passes (a few new rows over the KV cache), bf16,
// in AVX-512 (the amx and avx512 builds). Why this kernel and not torch's, and the numerics:
// attention_host.h. Here q . k multiplies bf16 pairs straight (VDPBF16PS), one query head
// at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "attention_host.h"
#include "vec.h"

using bf16 = c10::BFloat16;

namespace {

using vec::load_bf16;

// q . k over hd (a multiple of 16) for bf16 rows: products of bf16 pairs summed in fp32
// (VDPBF16PS), 32 elements a step, then the 16 lanes; the same instructions for every key.
inline float dot_bf16(const bf16* q, const bf16* k, int64_t hd) {
  __m512 sum = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 32 <= hd; d += 32)
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  if (d < hd)  // 16 left
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, q + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, k + d));
  return _mm512_reduce_add_ps(sum);
}

// For H heads of a group at once: acc_h[16 c0 .. 16 (c0 + C)) = inv_sum_h * sum_j p_hj v_{slots[j]},
// each dimension summed over j in order with one FMA a key, as a head alone sums it; each
// value row's chunks are widened from bf16 once for all H heads. p: the heads'
// probabilities, `p_stride` apart; acc: their outputs, `acc_stride` apart. H x C <= 24
// accumulators and C widened chunks stay in registers.
template <int H, int C>
inline void weighted_sums(const float* p, int64_t p_stride, const bf16* values, const std::vector<int64_t>& slots,
                          int64_t hd, int64_t c0, const float* inv_sum, float* acc, int64_t acc_stride) {
  __m512 a[H][C];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c) a[h][c] = _mm512_setzero_ps();
  const int64_t m = static_cast<int64_t>(slots.size());
  for (int64_t j = 0; j < m; ++j) {
    const bf16* v = values + slots[j] * hd + 16 * c0;
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = load_bf16(v + 16 * c);
    for (int h = 0; h < H; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h * p_stride + j]);
      for (int c = 0; c < C; ++c) a[h][c] = _mm512_fmadd_ps(pj, vc[c], a[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(acc + h * acc_stride + 16 * (c0 + c), _mm512_mul_ps(a[h][c], _mm512_set1_ps(inv_sum[h])));
}

template <int H>
inline void weighted_sums_chunks(const float* p, int64_t p_stride, const bf16* values,
                                 const std::vector<int64_t>& slots, int64_t hd, int64_t c0, int64_t n,
                                 const float* inv_sum, float* acc, int64_t acc_stride) {
  switch (n) {
    case 1: return weighted_sums<H, 1>(p, p_stride, values, slots, hd, c0, inv_sum, acc, acc_stride);
    case 2: return weighted_sums<H, 2>(p, p_stride, values, slots, hd, c0, inv_sum, acc, acc_stride);
    case 3: return weighted_sums<H, 3>(p, p_stride, values, slots, hd, c0, inv_sum, acc, acc_stride);
    default: return weighted_sums<H, 4>(p, p_stride, values, slots, hd, c0, inv_sum, acc, acc_stride);
  }
}

// weighted_sums for heads [0, n) of a group (n <= 6), the chunks four at a time.
inline void weighted_sums_heads(const float* p, int64_t p_stride, const bf16* values,
                                const std::vector<int64_t>& slots, int64_t hd, int64_t chunks, int64_t n,
                                const float* inv_sum, float* acc, int64_t acc_stride) {
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    const int64_t cn = std::min<int64_t>(4, chunks - c0);
    switch (n) {
      case 1: weighted_sums_chunks<1>(p, p_stride, values, slots, hd, c0, cn, inv_sum, acc, acc_stride); break;
      case 2: weighted_sums_chunks<2>(p, p_stride, values, slots, hd, c0, cn, inv_sum, acc, acc_stride); break;
      case 3: weighted_sums_chunks<3>(p, p_stride, values, slots, hd, c0, cn, inv_sum, acc, acc_stride); break;
      case 4: weighted_sums_chunks<4>(p, p_stride, values, slots, hd, c0, cn, inv_sum, acc, acc_stride); break;
      case 5: weighted_sums_chunks<5>(p, p_stride, values, slots, hd, c0, cn, inv_sum, acc, acc_stride); break;
      default: weighted_sums_chunks<6>(p, p_stride, values, slots, hd, c0, cn, inv_sum, acc, acc_stride); break;
    }
  }
}

// The query heads of one group, for one token, over its allowed keys `slots` (ascending).
// q: group rows of hd bf16, `stride` apart; keys, values (max_len, hd) bf16; out: group
// rows of hd bf16, `stride_out` apart. scratch: scores (group x m), acc (group x hd). Each
// head's scores, softmax and weighted sum are its own; heads share only the widening of
// each value row, so a head's output is bitwise what it alone gives.
void attend_group(const bf16* q, int64_t stride, int64_t group, const bf16* keys, const bf16* values,
                  const std::vector<int64_t>& slots, int64_t hd, float scale, float* scores, float* acc,
                  bf16* out, int64_t stride_out) {
  const int64_t m = static_cast<int64_t>(slots.size()), chunks = hd / 16;
  constexpr int64_t MAX_HEADS = 6;  // 6 heads x 4 chunks of accumulators in registers
  float inv_sum[MAX_HEADS];
  for (int64_t g0 = 0; g0 < group; g0 += MAX_HEADS) {
    const int64_t n = std::min(MAX_HEADS, group - g0);
    for (int64_t h = 0; h < n; ++h) {
      const bf16* qg = q + (g0 + h) * stride;
      float* s = scores + h * m;
      float top = -INFINITY;
      for (int64_t i = 0; i < m; ++i) {
        s[i] = dot_bf16(qg, keys + slots[i] * hd, hd) * scale;
        top = std::max(top, s[i]);
      }
      inv_sum[h] = vec::exp_shifted_in_place(s, m, top);  // p_i = exp(s_i - top) in place
    }
    weighted_sums_heads(scores, m, values, slots, hd, chunks, n, inv_sum, acc, hd);
    for (int64_t h = 0; h < n; ++h) {
      bf16* o = out + (g0 + h) * stride_out;
      for (int64_t d = 0; d < hd; ++d) o[d] = bf16(acc[h * hd + d]);
    }
  }
}

}  // namespace

torch::Tensor cache_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, int64_t start,
                              torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads) {
  return cache_attention_with(attend_group, 16, qkv, keys, values, start, allowed, num_heads, num_kv_heads);
}
