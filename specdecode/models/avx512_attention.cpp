// Attention for decoding and verification passes (a few new rows over the KV cache), bf16,
// in AVX-512 (the amx and avx512 builds). Why this kernel and not torch's, and the numerics:
// attention_host.h. Here q . k multiplies bf16 pairs straight (VDPBF16PS), one query head
// at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
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

// acc[16 c0 .. 16 (c0 + n)) = inv_sum * sum_j p_j v_{slots[j]}, n <= 8 chunks of 16, each
// dimension summed over j in order; the accumulators stay in registers.
template <int N>
inline void weighted_sum_n(const float* p, const bf16* values, const std::vector<int64_t>& slots, int64_t hd,
                           int64_t c0, float inv_sum, float* acc) {
  __m512 a[N];
  for (int c = 0; c < N; ++c) a[c] = _mm512_setzero_ps();
  const int64_t m = static_cast<int64_t>(slots.size());
  for (int64_t j = 0; j < m; ++j) {
    const bf16* v = values + slots[j] * hd + 16 * c0;
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int c = 0; c < N; ++c) a[c] = _mm512_fmadd_ps(pj, load_bf16(v + 16 * c), a[c]);
  }
  for (int c = 0; c < N; ++c) _mm512_storeu_ps(acc + 16 * (c0 + c), _mm512_mul_ps(a[c], _mm512_set1_ps(inv_sum)));
}

inline void weighted_sum(const float* p, const bf16* values, const std::vector<int64_t>& slots, int64_t hd,
                         int64_t c0, int64_t n, float inv_sum, float* acc) {
  switch (n) {
    case 1: return weighted_sum_n<1>(p, values, slots, hd, c0, inv_sum, acc);
    case 2: return weighted_sum_n<2>(p, values, slots, hd, c0, inv_sum, acc);
    case 3: return weighted_sum_n<3>(p, values, slots, hd, c0, inv_sum, acc);
    case 4: return weighted_sum_n<4>(p, values, slots, hd, c0, inv_sum, acc);
    case 5: return weighted_sum_n<5>(p, values, slots, hd, c0, inv_sum, acc);
    case 6: return weighted_sum_n<6>(p, values, slots, hd, c0, inv_sum, acc);
    case 7: return weighted_sum_n<7>(p, values, slots, hd, c0, inv_sum, acc);
    default: return weighted_sum_n<8>(p, values, slots, hd, c0, inv_sum, acc);
  }
}

// The query heads of one group, for one token, over its allowed keys `slots` (ascending).
// q: group rows of hd bf16, `stride` apart; keys, values (max_len, hd) bf16; out: group
// rows of hd bf16, `stride_out` apart. scratch: scores (m), acc (hd).
void attend_group(const bf16* q, int64_t stride, int64_t group, const bf16* keys, const bf16* values,
                  const std::vector<int64_t>& slots, int64_t hd, float scale, float* scores, float* acc,
                  bf16* out, int64_t stride_out) {
  const int64_t m = static_cast<int64_t>(slots.size()), chunks = hd / 16;
  for (int64_t g = 0; g < group; ++g) {
    const bf16* qg = q + g * stride;
    float top = -INFINITY;
    for (int64_t i = 0; i < m; ++i) {
      scores[i] = dot_bf16(qg, keys + slots[i] * hd, hd) * scale;
      top = std::max(top, scores[i]);
    }
    const float inv_sum = vec::exp_shifted_in_place(scores, m, top);  // p_i = exp(s_i - top) in place
    // out = sum p_j v_j over j in order, hd / 16 dimensions at a time in registers
    for (int64_t c0 = 0; c0 < chunks; c0 += 8)
      weighted_sum(scores, values, slots, hd, c0, std::min<int64_t>(8, chunks - c0), inv_sum, acc);
    bf16* o = out + g * stride_out;
    for (int64_t d = 0; d < hd; ++d) o[d] = bf16(acc[d]);
  }
}

}  // namespace

torch::Tensor cache_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, int64_t start,
                              torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads) {
  return cache_attention_with(attend_group, 16, qkv, keys, values, start, allowed, num_heads, num_kv_heads);
}
