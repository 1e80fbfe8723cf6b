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

using bf16 = c10::BFloat16;

namespace {

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

// y = w * bf16(x * rsqrt(mean(x^2) + eps)), one row of H
inline void rms_row(const bf16* x, const bf16* w, bf16* y, int64_t H, float eps) {
  float sum = 0.f;
  for (int64_t j = 0; j < H; ++j) { const float v = static_cast<float>(x[j]); sum += v * v; }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (int64_t j = 0; j < H; ++j)
    y[j] = bf16(static_cast<float>(w[j]) * round_bf16(static_cast<float>(x[j]) * inv));
}

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous(), name, ": contiguous bf16 expected");
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
  for (int64_t i = 0; i < rows * H; ++i) sp[i] = bf16(static_cast<float>(xp[i]) + static_cast<float>(dp[i]));
  for (int64_t r = 0; r < rows; ++r) rms_row(sp + r * H, weight.data_ptr<bf16>(), yp + r * H, H, (float)eps);
  return {sum, y};
}

// Rotary embedding of the q and k heads of a fused qkv product (B, T, (nq + nk + nv) * hd),
// with cos, sin (B or 1, T, hd): x * cos + rotate_half(x) * sin, each product rounded.
torch::Tensor rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_rotated, int64_t hd) {
  check_bf16(qkv, "qkv"); check_bf16(cos, "cos"); check_bf16(sin, "sin");
  const int64_t B = qkv.size(0), T = qkv.size(1), width = qkv.size(2), half = hd / 2;
  const bool per_row = cos.size(0) == B && B > 1;
  auto out = qkv.clone();
  const bf16* in = qkv.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t table = ((per_row ? b : 0) * T + t) * hd;
      const bf16 *c = cos.data_ptr<bf16>() + table, *s = sin.data_ptr<bf16>() + table;
      for (int64_t h = 0; h < num_rotated; ++h) {
        const bf16* x = in + (b * T + t) * width + h * hd;
        bf16* y = o + (b * T + t) * width + h * hd;
        for (int64_t i = 0; i < hd; ++i) {
          const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
          const float a = round_bf16(static_cast<float>(x[i]) * static_cast<float>(c[i]));
          const float r = round_bf16(rotated * static_cast<float>(s[i]));
          y[i] = bf16(a + r);
        }
      }
    }
  return out;
}

// silu(gate) * up for a fused gate_up product (..., 2 I) -> (..., I)
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "gate_up");
  const int64_t I = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gate_up.options());
  const bf16* g = gate_up.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < I; ++j) {
      const float gate = static_cast<float>(g[r * 2 * I + j]);
      const float silu = round_bf16(gate / (1.f + std::exp(-gate)));
      yp[r * I + j] = bf16(silu * static_cast<float>(g[r * 2 * I + I + j]));
    }
  return y;
}
