// The functions every build of the kernels exports (kernels.py): one declaration each,
// defined by the AMX files or by their AVX2 counterparts, and by rope.cpp and
// decoder_layer.cpp in both.
#pragma once
#include <torch/extension.h>
#include <vector>

// The argument check of every bf16 op: one message for all of them.
inline void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous(), name, ": contiguous bf16 expected");
}

torch::Tensor linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N);
torch::Tensor quant_linear(torch::Tensor x, std::vector<torch::Tensor> parts, c10::optional<torch::Tensor> bias,
                           int64_t N);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_rotated, int64_t hd);
torch::Tensor silu_mul(torch::Tensor gate_up);
int64_t read_streams(torch::Tensor buffer, int64_t streams);
std::vector<double> multiply_add_peak(bool quantized, int64_t iterations);
torch::Tensor cache_attention(torch::Tensor qkv, torch::Tensor keys, torch::Tensor values, int64_t start,
                              torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads);
std::vector<torch::Tensor> decoder_stack(torch::Tensor x, torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                                         torch::Tensor keys, torch::Tensor values, int64_t start,
                                         torch::Tensor allowed, int64_t num_heads, int64_t num_kv_heads,
                                         std::vector<std::vector<torch::Tensor>> weights,
                                         std::vector<c10::optional<torch::Tensor>> biases, std::vector<int64_t> out,
                                         std::vector<torch::Tensor> mlp_norms, std::vector<torch::Tensor> next_norms,
                                         double eps, std::vector<int64_t> keep);
