// Attention for decoding and verification passes, bf16, eight lanes wide for CPUs with
// AVX2 and no AVX-512. Why this kernel and not torch's, the numerics, and the host side
// (cache writes, each row's allowed slots, threads): attention_host.h.
// Here q . k multiplies the bf16 values converted to fp32 (no VDPBF16PS), 8 lanes at a time,
// as two halves: a 256-bit load of 16 bf16 gives the even-indexed values by a shift and
// the odd ones by a mask, so converting costs one instruction per 8 values. The query
// heads of a group go together, up to six: each key and value row is read and converted
// once for all of them, which is what decoding over a long cache costs.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_host.h"
#include "vec.h"

namespace {

constexpr int MAX_HEADS = 6;  // query heads of a group handled together (their accumulators fill the registers)

// 16 bf16 (one load) -> fp32 values 2i in `even` and 2i + 1 in `odd` (lane i), exact: each
// 32-bit lane holds the pair, the first in its low half.
inline void load_bf16_pairs(const bf16* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// scores[h * stride + i] = scale * (q_h . k_{slots[i]}) for H heads, each key read and
// converted once for all of them. qs: per head, per 16 values, the 8 even then the 8 odd
// ones in fp32. Each dot: even and odd products summed over the chunks in order, then
// added and summed across lanes, the same instructions for every key and head.
template <int H>
void head_scores(const float* qs, const bf16* keys, const int64_t* slots, int64_t m, int64_t hd, float scale,
                 float* scores, int64_t stride) {
  for (int64_t i = 0; i < m; ++i) {
    const bf16* k = keys + slots[i] * hd;
    __m256 e[H], o[H];
    for (int h = 0; h < H; ++h) e[h] = o[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 16) {
      __m256 ke, ko;
      load_bf16_pairs(k + c, ke, ko);
      for (int h = 0; h < H; ++h) {
        e[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + h * hd + c), ke, e[h]);
        o[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + h * hd + c + 8), ko, o[h]);
      }
    }
    for (int h = 0; h < H; ++h) scores[h * stride + i] = vec::reduce_add(_mm256_add_ps(e[h], o[h])) * scale;
  }
}

// acc[h * hd + ...] = inv_sum[h] * sum_j p[h * stride + j] v_{slots[j]} for H heads, 16
// values at a time (as even and odd lanes, qs's layout), each value summed over j in
// order; a value row is read and converted once for all the heads.
template <int H>
void head_sums(const float* p, int64_t stride, const bf16* values, const int64_t* slots, int64_t m, int64_t hd,
               const float* inv_sum, float* acc) {
  for (int64_t c = 0; c < hd; c += 16) {
    __m256 e[H], o[H];
    for (int h = 0; h < H; ++h) e[h] = o[h] = _mm256_setzero_ps();
    for (int64_t j = 0; j < m; ++j) {
      __m256 ve, vo;
      load_bf16_pairs(values + slots[j] * hd + c, ve, vo);
      for (int h = 0; h < H; ++h) {
        const __m256 pj = _mm256_broadcast_ss(p + h * stride + j);
        e[h] = _mm256_fmadd_ps(pj, ve, e[h]);
        o[h] = _mm256_fmadd_ps(pj, vo, o[h]);
      }
    }
    for (int h = 0; h < H; ++h) {
      _mm256_storeu_ps(acc + h * hd + c, _mm256_mul_ps(e[h], _mm256_set1_ps(inv_sum[h])));
      _mm256_storeu_ps(acc + h * hd + c + 8, _mm256_mul_ps(o[h], _mm256_set1_ps(inv_sum[h])));
    }
  }
}

template <int H>
void attend_heads(const float* qs, const bf16* keys, const bf16* values, const int64_t* slots, int64_t m,
                  int64_t hd, float scale, float* scores, int64_t stride, float* acc) {
  head_scores<H>(qs, keys, slots, m, hd, scale, scores, stride);
  float inv_sum[H];
  for (int h = 0; h < H; ++h) {  // p_i = exp(s_i - max s) in place; their sum in 8 lanes, then the lanes
    float* s = scores + h * stride;
    float top = -INFINITY;
    for (int64_t i = 0; i < m; ++i) top = std::max(top, s[i]);
    inv_sum[h] = vec::exp_shifted_in_place(s, m, top);
  }
  head_sums<H>(scores, stride, values, slots, m, hd, inv_sum, acc);
}

// The query heads of one group, for one token, over its allowed keys `slots` (ascending).
// As avx512_attention.cpp's attend_group, up to MAX_HEADS heads at a time; scores (group x m) and
// acc (2 group x hd) are scratch.
void attend_group(const bf16* q, int64_t stride, int64_t group, const bf16* keys, const bf16* values,
                  const std::vector<int64_t>& slots, int64_t hd, float scale, float* scores, float* acc,
                  bf16* out, int64_t stride_out) {
  const int64_t m = static_cast<int64_t>(slots.size());
  float* qs = acc + group * hd;  // q in fp32, even and odd values apart per 16 (head_scores)
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < hd; c += 16)
      for (int i = 0; i < 8; ++i) {
        qs[g * hd + c + i] = static_cast<float>(q[g * stride + c + 2 * i]);
        qs[g * hd + c + 8 + i] = static_cast<float>(q[g * stride + c + 2 * i + 1]);
      }
  for (int64_t g0 = 0; g0 < group; g0 += MAX_HEADS) {
    const int64_t n = std::min<int64_t>(MAX_HEADS, group - g0);
    auto run = [&](auto heads) {
      attend_heads<decltype(heads)::value>(qs + g0 * hd, keys, values, slots.data(), m, hd, scale, scores, m,
                                           acc + g0 * hd);
    };
    switch (n) {
      case 1: run(std::integral_constant<int, 1>()); break;
      case 2: run(std::integral_constant<int, 2>()); break;
      case 3: run(std::integral_constant<int, 3>()); break;
      case 4: run(std::integral_constant<int, 4>()); break;
      case 5: run(std::integral_constant<int, 5>()); break;
      default: run(std::integral_constant<int, 6>()); break;
    }
  }
  for (int64_t g = 0; g < group; ++g)  // back from even and odd lanes to the values' order, rounded once
    for (int64_t c = 0; c < hd; c += 16)
      for (int i = 0; i < 8; ++i) {
        out[g * stride_out + c + 2 * i] = bf16(acc[g * hd + c + i]);
        out[g * stride_out + c + 2 * i + 1] = bf16(acc[g * hd + c + 8 + i]);
      }
}

}  // namespace

torch::Tensor cache_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, int64_t start,
                              torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads) {
  return cache_attention_with(attend_group, 16, qkv, keys, values, start, allowed, num_heads, num_kv_heads);
}
