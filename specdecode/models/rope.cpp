// The rotary embedding of a fused qkv product, in plain C++: the AMX and the AVX2 builds
// (kernels.py) both compile it, since it needs no vector instructions to keep up.
#include <torch/extension.h>
#include <c10/util/BFloat16.h>

#include "kernels.h"

using bf16 = c10::BFloat16;

namespace {

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

}  // namespace

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
