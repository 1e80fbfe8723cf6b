// The bf16 decoder layers of a decoding or verify pass, all in one call.
//
// native.py's fused path calls these very kernels one by one, nine calls a layer, each
// through Python and torch's argument handling. On a small model that round trip is a
// tenth of a step (SmolLM2-135M: 30 layers, a step of 12-15 ms, of which about 1.5 ms
// is calls between kernels). Here every layer runs them in the same order on the same
// tensors, so the result is bitwise the step-by-step one.
#include <torch/extension.h>

#include "kernels.h"

namespace {

// y = x @ W.T (+ b) for x (B, T, K): (B, T, N). W is one bf16 weight packed for this
// build's kernel, or quantized parts (uint8 blocks, quant_linear.cpp) stacked by output.
torch::Tensor project(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                      const c10::optional<torch::Tensor>& bias, int64_t N) {
  const int64_t B = x.size(0), T = x.size(1);
  const auto rows = x.reshape({B * T, x.size(2)});
  const bool quantized = parts[0].scalar_type() == torch::kUInt8;
  return (quantized ? quant_linear(rows, parts, bias, N) : linear(rows, parts[0], bias, N)).view({B, T, N});
}

}  // namespace

// x: the residual stream (B, T, H); h: its norm for this layer. cos, sin: (B or 1, T, hd);
// keys, values: this layer's cache buffers (B, nkv, max_len, hd), written at slots start, ...;
// allowed: (B or 1, T, start + T) bool, or empty for causal by slot. weights: the qkv, o,
// gate_up and down matrices, each as `project` takes it; biases: theirs (or None); out:
// their output widths.
// Returns (x + attention + mlp, the norm `next_norm` of it): the next layer's x and h.
std::vector<torch::Tensor> decoder_layer(torch::Tensor x, torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                                         torch::Tensor keys, torch::Tensor values, int64_t start,
                                         torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads,
                                         std::vector<std::vector<torch::Tensor>> weights,
                                         std::vector<c10::optional<torch::Tensor>> biases, std::vector<int64_t> out,
                                         torch::Tensor mlp_norm, torch::Tensor next_norm, double eps) {
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && out.size() == 4, "four matrices: qkv, o, gate_up, down");
  const int64_t hd = keys.size(3);
  auto qkv = project(h, weights[0], biases[0], out[0]);
  auto roped = rope_qkv(qkv, cos, sin, num_heads + num_kv_heads, hd);
  auto attended = cache_attention(roped, keys, values, start, allowed, num_heads, num_kv_heads);
  auto mid = add_rms_norm(x, project(attended, weights[1], biases[1], out[1]), mlp_norm, eps);
  auto act = silu_mul(project(mid[1], weights[2], biases[2], out[2]));
  return add_rms_norm(mid[0], project(act, weights[3], biases[3], out[3]), next_norm, eps);
}

// Every layer of a pass in one call: decoder_layer for layers 0..L-1 in order, so the result
// is bitwise the layer-by-layer one. Python's loop and the argument handling of 30 calls
// cost about half a millisecond of a SmolLM2 step. keys, values: the whole cache
// (L, B, nkv, max_len, hd); weights, biases: four per layer; mlp_norms, next_norms: one per
// layer. Returns (x, h) after the last layer, then x after each layer listed in `keep`
// (1-based counts of layers done, below L), in that order.
std::vector<torch::Tensor> decoder_stack(torch::Tensor x, torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                                         torch::Tensor keys, torch::Tensor values, int64_t start,
                                         torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads,
                                         std::vector<std::vector<torch::Tensor>> weights,
                                         std::vector<c10::optional<torch::Tensor>> biases, std::vector<int64_t> out,
                                         std::vector<torch::Tensor> mlp_norms, std::vector<torch::Tensor> next_norms,
                                         double eps, std::vector<int64_t> keep) {
  const int64_t L = static_cast<int64_t>(mlp_norms.size());
  TORCH_CHECK(keys.size(0) == L && values.size(0) == L && next_norms.size() == static_cast<size_t>(L) &&
              weights.size() == static_cast<size_t>(4 * L) && biases.size() == weights.size() && out.size() == 4,
              "decoder_stack: one cache slice, four matrices and two norms per layer");
  std::vector<torch::Tensor> kept;
  size_t next_keep = 0;
  for (int64_t i = 0; i < L; ++i) {
    std::vector<std::vector<torch::Tensor>> w(weights.begin() + 4 * i, weights.begin() + 4 * i + 4);
    std::vector<c10::optional<torch::Tensor>> b(biases.begin() + 4 * i, biases.begin() + 4 * i + 4);
    auto xh = decoder_layer(x, h, cos, sin, keys[i], values[i], start, allowed, num_heads, num_kv_heads, w, b, out,
                            mlp_norms[i], next_norms[i], eps);
    x = xh[0];
    h = xh[1];
    if (next_keep < keep.size() && keep[next_keep] == i + 1) {
      kept.push_back(x);
      ++next_keep;
    }
  }
  std::vector<torch::Tensor> result{x, h};
  result.insert(result.end(), kept.begin(), kept.end());
  return result;
}
