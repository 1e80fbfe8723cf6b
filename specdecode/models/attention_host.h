// Attention for decoding and verification passes (a few new rows over the KV cache), bf16:
// the host side, shared by the AVX-512 (avx512_attention.cpp) and AVX2
// (avx2_attention.cpp) kernels: checks, the new keys and values written into the cache,
// each row's allowed slots gathered densely in slot order, and the rows spread over
// threads.
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
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <vector>

using bf16 = c10::BFloat16;

// qkv (B, T, (nh + 2 nkv) hd) bf16, rotated; keys, values (B, nkv, max_len, hd) bf16, the
// layer's cache buffers, into which the T new keys and values go at slots start, ...;
// allowed: (B or 1, T, start + T) bool, or empty for causal by slot.
// Returns (B, T, nh hd) bf16, the o-projection's input.
//
// attend_group: the kernel's per-group attention (avx512_attention.cpp, avx2_attention.cpp), whose
// vectors need hd to be a multiple of `lanes`.
template <typename AttendGroup>
torch::Tensor cache_attention_with(AttendGroup attend_group, int64_t lanes, torch::Tensor qkv, torch::Tensor keys,
                                   torch::Tensor values, int64_t start, torch::Tensor allowed, int64_t num_heads,
                                   int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16 && qkv.is_contiguous() && qkv.dim() == 3, "qkv: (B, T, W) bf16");
  TORCH_CHECK(keys.scalar_type() == torch::kBFloat16 && keys.is_contiguous() && values.is_contiguous()
              && keys.sizes() == values.sizes() && keys.dim() == 4, "keys, values: contiguous (B, nkv, max_len, hd) bf16");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2);
  const int64_t max_len = keys.size(2), hd = keys.size(3), group = num_heads / num_kv_heads;
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == num_kv_heads, "the cache's batch or heads differ from qkv's");
  TORCH_CHECK(W == (num_heads + 2 * num_kv_heads) * hd, "qkv's width does not match the heads");
  TORCH_CHECK(hd % lanes == 0, "head_dim must be a multiple of ", lanes);
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
    std::vector<float> scores(group * S), acc(2 * group * hd);  // room for every head of the group
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
