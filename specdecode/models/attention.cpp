// Attention for decoding and verification passes (a few new rows over the KV cache), bf16.
//
// Why not torch's kernel: speculative decoding needs each row's result to depend only on
// the keys that row may see, in their order, not on where they sit in the cache or on
// what other rows the call has. Torch's CPU kernel sums keys in vector blocks by slot,
// so a tree node whose ancestors are not in the slots just before it rounds differently
// from plain decoding of the same tokens (path_attention.py works around that with one
// call per root-to-leaf path). Here every row gathers its allowed keys densely, in slot
// order, and all sums run over that dense list in a fixed pattern, so a node's output is
// bitwise that of plain decoding along its path, for any tree, row count or thread count.
// It also reads only the keys a row sees, writes the new keys and values into the cache
// itself, and reads q from the fused qkv product and writes the o-projection's input
// layout, which saves a handful of tensor operations per layer.
//
// Per row: s_i = (q . k_i) / sqrt(hd), bf16 products summed in fp32, then
// p_i = exp(s_i - max s), out = sum p_i v_i / sum p_i in fp32, rounded to bf16 once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#include "attention_host.h"
#include "simd_math.h"

using bf16 = c10::BFloat16;

namespace {

using simd::exp_nonpositive;
using simd::load_bf16;

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
    // p_i = exp(s_i - top) in place; their sum in 16 lanes over the dense list, then the lanes
    __m512 lanes = _mm512_setzero_ps();
    for (int64_t i = 0; i < m; i += 16) {
      const __mmask16 live = simd::live_lanes(m - i);
      const __m512 s = _mm512_maskz_loadu_ps(live, scores + i);
      const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(top))));
      _mm512_mask_storeu_ps(scores + i, live, p);
      lanes = _mm512_add_ps(lanes, p);
    }
    const float inv_sum = 1.0f / _mm512_reduce_add_ps(lanes);
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
