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
// Per row: s_i = (q . k_i) / sqrt(hd) in fp32 (k_i converted exactly from bf16), then
// p_i = exp(s_i - max s), out = sum p_i v_i / sum p_i, rounded to bf16 once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

using bf16 = c10::BFloat16;

namespace {

// 16 bf16 -> 16 fp32, exact
inline __m512 load_bf16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 Taylor
// polynomial (relative error about 2e-7); elementwise, so it is the same for any layout.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One query row over its allowed keys `slots` (ascending): out (hd) bf16.
// q (hd) fp32, pre-scaled; keys, values (max_len, hd) bf16; scratch >= slots.size() floats.
void attend_row(const float* q, const bf16* keys, const bf16* values, const std::vector<int64_t>& slots,
                int64_t hd, float* scores, float* acc, bf16* out) {
  const int64_t m = static_cast<int64_t>(slots.size());
  const int64_t chunks = hd / 16;
  float top = -INFINITY;
  for (int64_t i = 0; i < m; ++i) {
    const bf16* k = keys + slots[i] * hd;
    __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(q), load_bf16(k));
    for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), load_bf16(k + 16 * c), dot);
    scores[i] = _mm512_reduce_add_ps(dot);
    top = std::max(top, scores[i]);
  }
  // p_i = exp(s_i - top) in place; their sum in 16 lanes over the dense list, then the lanes
  __m512 lanes = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= m; i += 16) {
    const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + i), _mm512_set1_ps(top)));
    _mm512_storeu_ps(scores + i, p);
    lanes = _mm512_add_ps(lanes, p);
  }
  if (i < m) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (m - i)) - 1);
    const __m512 s = _mm512_maskz_loadu_ps(tail, scores + i);
    const __m512 p = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(scores + i, tail, p);
    lanes = _mm512_add_ps(lanes, p);
  }
  const float inv_sum = 1.0f / _mm512_reduce_add_ps(lanes);
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_setzero_ps());
  for (int64_t j = 0; j < m; ++j) {
    const bf16* v = values + slots[j] * hd;
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_ps(acc + 16 * c, _mm512_fmadd_ps(p, load_bf16(v + 16 * c), _mm512_loadu_ps(acc + 16 * c)));
  }
  for (int64_t d = 0; d < hd; ++d) out[d] = bf16(acc[d] * inv_sum);
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
    std::vector<float> q(hd), scores(S), acc(hd);
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
      const int64_t kv = (b * num_kv_heads + kv_head) * max_len * hd;
      for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        bf16* o = op + (b * T + t) * num_heads * hd + h * hd;
        if (slots.empty()) {  // a row that may see nothing: zeros (callers' masks never ask it)
          std::fill(o, o + hd, bf16(0.0f));
          continue;
        }
        const bf16* qh = in + (b * T + t) * W + h * hd;
        for (int64_t d = 0; d < hd; ++d) q[d] = static_cast<float>(qh[d]) * scale;
        attend_row(q.data(), kp + kv, vp + kv, slots, hd, scores.data(), acc.data(), o);
      }
    }
  });
  return out;
}
