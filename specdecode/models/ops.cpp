// The small per-layer operations of a bf16 decoder layer, fused: fewer calls per layer.
//
// A decoding step on CPU spends most of its time streaming weights, but some 15 small
// operations per layer (norms, rotary embedding, activation, residual adds) each pay a
// dispatch and a pass over tiny tensors. These do the same arithmetic in one loop each,
// rounding to bf16 wherever the torch ops they replace round (transformers' Llama
// numerics), so results stay within bf16 rounding of the torch path. Each row is computed
// alone, so a row's result never depends on how many rows a call has. Written once over
// vec.h: every build compiles this file at its own lane width.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "vec.h"

using bf16 = c10::BFloat16;

namespace {

using vec::F;
using vec::LANES;
using vec::live_lanes;

// y = w * bf16(x * rsqrt(mean(x^2) + eps)), one row of H; the squares summed in LANES lanes
inline void rms_row(const bf16* x, const bf16* w, bf16* y, int64_t H, float eps) {
  F squares = vec::zero();
  for (int64_t j = 0; j < H; j += LANES) {
    const F v = vec::load_bf16(x + j, live_lanes(H - j));
    squares = vec::fmadd(v, v, squares);
  }
  const float inv = 1.f / std::sqrt(vec::reduce_add(squares) / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; j += LANES) {
    const vec::Live live = live_lanes(H - j);
    const F normed = vec::round_bf16(vec::mul(vec::load_bf16(x + j, live), vec::set1(inv)));
    vec::store_bf16(y + j, vec::mul(vec::load_bf16(w + j, live), normed), live);
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
  const int64_t H = x.size(-1), rows = x.numel() / H, n = rows * H;
  auto sum = torch::empty_like(x);
  auto y = torch::empty_like(x);
  const bf16 *xp = x.data_ptr<bf16>(), *dp = delta.data_ptr<bf16>();
  bf16 *sp = sum.data_ptr<bf16>(), *yp = y.data_ptr<bf16>();
  for (int64_t i = 0; i < n; i += LANES) {
    const vec::Live live = live_lanes(n - i);
    vec::store_bf16(sp + i, vec::add(vec::load_bf16(xp + i, live), vec::load_bf16(dp + i, live)), live);
  }
  for (int64_t r = 0; r < rows; ++r) rms_row(sp + r * H, weight.data_ptr<bf16>(), yp + r * H, H, (float)eps);
  return {sum, y};
}

// silu(gate) * up for a fused gate_up product (..., 2 I) -> (..., I), LANES values a step:
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
  const F one = vec::set1(1.f);
  // rows split between the threads from four rows of a 1.5B model's width (a verify pass's
  // exps and divisions take longer than waking a thread); a decoding step's one row stays here
  at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 15) / I), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < I; j += LANES) {
        const vec::Live live = live_lanes(I - j);
        const F gate = vec::load_bf16(g + r * 2 * I + j, live);
        const F up = vec::load_bf16(g + r * 2 * I + I + j, live);
        const F e = vec::exp_nonpositive(vec::negative_abs(gate));
        const F numerator = vec::where_negative(gate, vec::mul(gate, e), gate);
        const F silu = vec::round_bf16(vec::div(numerator, vec::add(one, e)));
        vec::store_bf16(yp + r * I + j, vec::mul(silu, up), live);
      }
  });
  return y;
}
