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

// qkv (B, T, (nh + 2 nkv) hd) bf16, rotated; keys, values (B, nkv, max_len, hd) bf16, the
// layer's cache buffers, into which the T new keys and values go at slots start, ...;
// allowed: (B or 1, T, start + T) bool, or empty for causal by slot.
// Returns (B, T, nh hd) bf16, the o-projection's input.
torch::Tensor cache_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, int64_t start,
                              torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16 && qkv.is_contiguous() && qkv.dim() == 3, "qkv: (B, T, W) bf16");
  TORCH_CHECK(keys.scalar_type() == torch::kBFloat16 && keys.is_contiguous() && values.is_contiguous()
              && keys.sizes() == values.sizes() && keys.dim() == 4, "keys, values: contiguous (B, nkv, max_len, hd) bf16");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2);
  const int64_t max_len = keys.size(2), hd = keys.size(3), group = num_heads / num_kv_heads;
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == num_kv_heads, "the cache's batch or heads differ from qkv's");
  TORCH_CHECK(W == (num_heads + 2 * num_kv_heads) * hd && hd % 16 == 0, "qkv's width does not match the heads");
  TORCH_CHECK(start + T <= max_len, "the cache is full");
  const int64_t S = start + T;
  const bool causal = allowed.numel() == 0;
  if (!causal)
    TORCH_CHECK(allowed.scalar_type() == torch::kBool && allowed.is_contiguous() && allowed.dim() == 3
                && (allowed.size(0) == B || allowed.size(0) == 1) && allowed.size(1) == T && allowed.size(2) == S,
                "allowed: contiguous (B or 1, T, start + T) bool");
  const bf16* in = qkv.data_ptr<bf16>();
  bf16* kp = keys.data_ptr<bf16>();
  bf16* vp = values.data_ptr<bf16>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const bf16* row = in + (b * T + t) * W;
        const int64_t slot = ((b * num_kv_heads + h) * max_len + start + t) * hd;
        std::copy(row + (num_heads + h) * hd, row + (num_heads + h + 1) * hd, kp + slot);
        std::copy(row + (num_heads + num_kv_heads + h) * hd, row + (num_heads + num_kv_heads + h + 1) * hd, vp + slot);
      }
  auto out = torch::empty({B, T, num_heads * hd}, qkv.options());
  bf16* op = out.data_ptr<bf16>();
  const bool* ap = causal ? nullptr : allowed.data_ptr<bool>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // one unit = one (batch row, token, kv head): the query heads of a group share its keys
  at::parallel_for(0, B * T * num_kv_heads, 1, [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> slots;
    std::vector<float> scores(S), acc(hd);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (T * num_kv_heads), t = u / num_kv_heads % T, kv_head = u % num_kv_heads;
      slots.clear();
      if (causal) {
        for (int64_t s = 0; s <= start + t; ++s) slots.push_back(s);
      } else {
        const bool* a = ap + ((allowed.size(0) == 1 ? 0 : b) * T + t) * S;
        for (int64_t s = 0; s < S; ++s)
          if (a[s]) slots.push_back(s);
      }
      bf16* o = op + (b * T + t) * num_heads * hd + kv_head * group * hd;
      if (slots.empty()) {  // a row that may see nothing: zeros (callers' masks never ask it)
        std::fill(o, o + group * hd, bf16(0.0f));
        continue;
      }
      const int64_t kv = (b * num_kv_heads + kv_head) * max_len * hd;
      attend_group(in + (b * T + t) * W + kv_head * group * hd, hd, group, kp + kv, vp + kv, slots, hd, scale,
                   scores.data(), acc.data(), o, hd);
    }
  });
  return out;
}
