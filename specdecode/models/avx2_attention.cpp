// Attention for decoding and verification passes, bf16, eight lanes wide for CPUs with
// AVX2 and no AVX-512. Why this kernel and not torch's, and the numerics: attention.cpp;
// the host side (cache writes, each row's allowed slots, threads) is attention_host.h.
// Here q . k multiplies the bf16 values converted to fp32 (no VDPBF16PS), 8 lanes at a time.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#include "attention_host.h"
#include "avx2_math.h"

namespace {

// q . k over hd (a multiple of 8): products in fp32, summed in 8 lanes over d in order, then
// the lanes; the same instructions for every key.
inline float dot_bf16(const float* q, const bf16* k, int64_t hd) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), avx2::load_bf16(k + d), sum);
  return avx2::reduce_add(sum);
}

// acc[8 c0 .. 8 (c0 + n)) = inv_sum * sum_j p_j v_{slots[j]}, n <= 8 chunks of 8, each
// dimension summed over j in order; the accumulators stay in registers.
template <int N>
inline void weighted_sum_n(const float* p, const bf16* values, const std::vector<int64_t>& slots, int64_t hd,
                           int64_t c0, float inv_sum, float* acc) {
  __m256 a[N];
  for (int c = 0; c < N; ++c) a[c] = _mm256_setzero_ps();
  const int64_t m = static_cast<int64_t>(slots.size());
  for (int64_t j = 0; j < m; ++j) {
    const bf16* v = values + slots[j] * hd + 8 * c0;
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int c = 0; c < N; ++c) a[c] = _mm256_fmadd_ps(pj, avx2::load_bf16(v + 8 * c), a[c]);
  }
  for (int c = 0; c < N; ++c) _mm256_storeu_ps(acc + 8 * (c0 + c), _mm256_mul_ps(a[c], _mm256_set1_ps(inv_sum)));
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
// As attention.cpp's attend_group; scores (m) and acc (hd) are scratch.
void attend_group(const bf16* q, int64_t stride, int64_t group, const bf16* keys, const bf16* values,
                  const std::vector<int64_t>& slots, int64_t hd, float scale, float* scores, float* acc,
                  bf16* out, int64_t stride_out) {
  const int64_t m = static_cast<int64_t>(slots.size()), chunks = hd / 8;
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < hd; ++d) acc[d] = static_cast<float>(q[g * stride + d]);  // q in fp32, once
    float top = -INFINITY;
    for (int64_t i = 0; i < m; ++i) {
      scores[i] = dot_bf16(acc, keys + slots[i] * hd, hd) * scale;
      top = std::max(top, scores[i]);
    }
    // p_i = exp(s_i - top) in place; their sum in 8 lanes over the dense list, then the lanes
    __m256 lanes = _mm256_setzero_ps();
    for (int64_t i = 0; i < m; i += 8) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(m - i, 8))),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 s = _mm256_maskload_ps(scores + i, live);
      const __m256 p = _mm256_and_ps(avx2::exp_nonpositive(_mm256_sub_ps(s, _mm256_set1_ps(top))),
                                     _mm256_castsi256_ps(live));
      _mm256_maskstore_ps(scores + i, live, p);
      lanes = _mm256_add_ps(lanes, p);
    }
    const float inv_sum = 1.0f / avx2::reduce_add(lanes);
    // out = sum p_j v_j over j in order, hd / 8 dimensions at a time in registers
    for (int64_t c0 = 0; c0 < chunks; c0 += 8)
      weighted_sum(scores, values, slots, hd, c0, std::min<int64_t>(8, chunks - c0), inv_sum, acc);
    bf16* o = out + g * stride_out;
    for (int64_t d = 0; d < hd; ++d) o[d] = bf16(acc[d]);
  }
}

}  // namespace

torch::Tensor cache_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, int64_t start,
                              torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads) {
  return cache_attention_with(attend_group, 8, qkv, keys, values, start, allowed, num_heads, num_kv_heads);
}
