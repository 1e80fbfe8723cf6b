// The small per-layer operations of a bf16 decoder layer, fused: fewer calls per layer.
//
// A decoding step on CPU spends most of its time streaming weights, but some 15 small
// operations per layer (norms, rotary embedding, activation, residual adds) each pay a
// dispatch and a pass over tiny tensors. These do the same arithmetic in one loop each,
// rounding to bf16 wherever the torch ops they replace round (transformers' Llama
// numerics), so results stay within bf16 rounding of the torch path. Each row is computed
// alone, so a row's result never depends on how many rows a call has.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <cmath>

#include "simd_math.h"
#include "kernels.h"

using bf16 = c10::BFloat16;

namespace {

using simd::live_lanes;

// y = w * bf16(x * rsqrt(mean(x^2) + eps)), one row of H; the squares summed in 16 lanes
inline void rms_row(const bf16* x, const bf16* w, bf16* y, int64_t H, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t j = 0; j < H; j += 16) {
    const __m512 v = simd::load_bf16(x + j, live_lanes(H - j));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; j += 16) {
    const __mmask16 live = live_lanes(H - j);
    const __m512 normed = simd::round_bf16(_mm512_mul_ps(simd::load_bf16(x + j, live), _mm512_set1_ps(inv)));
    simd::store_bf16(y + j, _mm512_mul_ps(simd::load_bf16(w + j, live), normed), live);
  }
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_bf16(x, "x"); check_bf16(weight, "weight");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  auto y = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>(); bf16* yp = y.data_ptr<bf16>();
  for (int64_t r = 0; r < rows; ++r) rms_row(xp + r * H, weight.data_ptr<bf16>(), yp + r * H, H, (float)eps);
  return y;
}

// (x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_bf16(x, "x"); check_bf16(delta, "delta"); check_bf16(weight, "weight");
  TORCH_CHECK(x.sizes() == delta.sizes(), "x and delta differ in shape");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  auto sum = torch::empty_like(x);
  auto y = torch::empty_like(x);
  const bf16 *xp = x.data_ptr<bf16>(), *dp = delta.data_ptr<bf16>();
  bf16 *sp = sum.data_ptr<bf16>(), *yp = y.data_ptr<bf16>();
  for (int64_t i = 0; i < rows * H; i += 16) {
    const __mmask16 live = live_lanes(rows * H - i);
    simd::store_bf16(sp + i, _mm512_add_ps(simd::load_bf16(xp + i, live), simd::load_bf16(dp + i, live)), live);
  }
  for (int64_t r = 0; r < rows; ++r) rms_row(sp + r * H, weight.data_ptr<bf16>(), yp + r * H, H, (float)eps);
  return {sum, y};
}

// silu(gate) * up for a fused gate_up product (..., 2 I) -> (..., I), 16 values a step:
// silu(g) = g / (1 + exp(-g)), from e = exp(-|g|) <= 1 so that nothing overflows
// (g < 0: g e / (1 + e)); rounded to bf16 before the product, as torch rounds it.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "gate_up");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gate_up.options());
  const bf16* g = gate_up.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < I; j += 16) {
      const __mmask16 live = live_lanes(I - j);
      const __m512 gate = simd::load_bf16(g + r * 2 * I + j, live);
      const __m512 up = simd::load_bf16(g + r * 2 * I + I + j, live);
      const __m512 e = simd::exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));
      const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
      const __m512 numerator = _mm512_mask_mul_ps(gate, negative, gate, e);
      const __m512 silu = simd::round_bf16(_mm512_div_ps(numerator, _mm512_add_ps(one, e)));
      simd::store_bf16(yp + r * I + j, _mm512_mul_ps(silu, up), live);
    }
  return y;
}
