// The fused small operations of a bf16 decoder layer (cpu_ops.cpp), eight lanes wide for
// CPUs with AVX2 and no AVX-512. The same arithmetic and roundings as cpu_ops.cpp
// (transformers' Llama numerics); only the lane count of the sums differs. Each row is
// computed alone, so a row's result never depends on how many rows a call has.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <cmath>

#include "avx2_math.h"
#include "kernels.h"

using bf16 = c10::BFloat16;

namespace {

// y = w * bf16(x * rsqrt(mean(x^2) + eps)), one row of H; the squares summed in 8 lanes
inline void rms_row(const bf16* x, const bf16* w, bf16* y, int64_t H, float eps) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t j = 0; j < H; j += 8) {
    const __m256 v = avx2::load_bf16(x + j, H - j);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const float inv = 1.f / std::sqrt(avx2::reduce_add(squares) / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; j += 8) {
    const __m256 normed = avx2::round_bf16(_mm256_mul_ps(avx2::load_bf16(x + j, H - j), _mm256_set1_ps(inv)));
    avx2::store_bf16(y + j, _mm256_mul_ps(avx2::load_bf16(w + j, H - j), normed), H - j);
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
  for (int64_t i = 0; i < n; i += 8)
    avx2::store_bf16(sp + i, _mm256_add_ps(avx2::load_bf16(xp + i, n - i), avx2::load_bf16(dp + i, n - i)), n - i);
  for (int64_t r = 0; r < rows; ++r) rms_row(sp + r * H, weight.data_ptr<bf16>(), yp + r * H, H, (float)eps);
  return {sum, y};
}

// silu(gate) * up for a fused gate_up product (..., 2 I) -> (..., I), 8 values a step:
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
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < I; j += 8) {
      const __m256 gate = avx2::load_bf16(g + r * 2 * I + j, I - j);
      const __m256 up = avx2::load_bf16(g + r * 2 * I + I + j, I - j);
      const __m256 e = avx2::exp_nonpositive(_mm256_or_ps(gate, sign));  // -|g|
      const __m256 negative = _mm256_cmp_ps(gate, zero, _CMP_LT_OQ);
      const __m256 numerator = _mm256_blendv_ps(gate, _mm256_mul_ps(gate, e), negative);
      const __m256 silu = avx2::round_bf16(_mm256_div_ps(numerator, _mm256_add_ps(one, e)));
      avx2::store_bf16(yp + r * I + j, _mm256_mul_ps(silu, up), I - j);
    }
  return y;
}
