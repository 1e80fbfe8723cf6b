// bf16 linear layers on AVX2 (CPUs without AVX-512, such as AMD Zen 3): y = x @ W.T + b.
//
// Why: there, oneDNN refuses bf16 and torch's F.linear streams a decoding step's weights
// at about 12 GB/s through its own conversions. This kernel converts bf16 to fp32 with a
// shift or a mask (a bf16 is the top half of an fp32) and multiplies with FMA, reading each
// weight once per call for up to two rows at a time. Every output is its products summed
// over K in order, one FMA chain, whatever the number of rows, so a verify pass gives
// each token bitwise the logits of a one-token pass.
//
// Layout: W (N, K) is packed once into (N/32, K, 32): blocks of 32 outputs, and for each k
// the block's 32 weights in one 64-byte line, streamed front to back. Within each half of
// 16, the weight of output i (0-7) sits at 2i and that of output 8 + i at 2i + 1, so one
// 256-bit load gives outputs 0-7 by a shift and 8-15 by a mask. kernels.py packs it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <vector>

#include "bindings.h"
#include "kernels.h"
#include "tile_prefetch.h"
#include "vec.h"

namespace {

constexpr int64_t BLOCK = 32;  // outputs per packed block
// Bytes ahead of the weights being multiplied that are prefetched into L1, one line per k:
// streaming 1 GB on AMD Zen 3, 1 KB ahead gave 20.1-21.1 GB/s against 17.7-18.9 without
// (K = 576 and 1536, one run each; 0.5, 2 and 4 KB were in between).
constexpr int64_t PREFETCH_AHEAD = 1024;

// K steps per tile when a call has more than two rows: the tile's weights (16 KB) stay in
// L1 while every pair of rows passes over them, so they come from memory once. Qwen2.5-1.5B
// on Zen 3, a pass of 3, 5 and 8 rows against one row: 1.28x, 1.55x, 2.03x untiled; 1.15x,
// 1.43x, 1.91x tiled (one run each). Past a few rows the FMAs, not memory, set the pace.
constexpr int64_t K_TILE = 256;

// Rows [0, R) of x (fp32, K apart) times one block over k in [k0, k1): sums[r][8q .. 8q + 7]
// (fp32, 32 per row) carry outputs 8q .. 8q + 7 from the previous tile and take them to the
// next, so each output is still one FMA chain over k in order, whatever the tiling. The
// chains run in local registers (through `sums` the compiler would keep them in memory).
template <int R>
inline void block_rows(const uint16_t* wb, const float* x, int64_t K, int64_t k0, int64_t k1, float* sums,
                       TilePrefetch next) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_loadu_ps(sums + r * BLOCK + 8 * q);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = k0; k < k1; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(wb + k * BLOCK) + PREFETCH_AHEAD, _MM_HINT_T0);
    next.step();
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * BLOCK));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + k * BLOCK + 16));
    const __m256 w[4] = {_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_castsi256_ps(_mm256_and_si256(w0, high)),
                         _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), _mm256_castsi256_ps(_mm256_and_si256(w1, high))};
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(x + r * K + k);
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_fmadd_ps(xk, w[q], acc[r][q]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) _mm256_storeu_ps(sums + r * BLOCK + 8 * q, acc[r][q]);
}

}  // namespace

// x (M, K) bf16; wp (N/32, K, 32) bf16; bias (N,) bf16 or empty -> (M, N) bf16
torch::Tensor linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous (M, K) bf16");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0);
  TORCH_CHECK(wp.dim() == 3 && wp.size(1) == K && wp.size(2) == BLOCK && NB * BLOCK >= N,
              "x's K does not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  std::vector<float> xf(M * K);  // x in fp32, converted once (exact)
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xp[i]);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tile = M > 2 ? K_TILE : K;  // one or two rows: one pass, nothing to keep in L1
  const int64_t passes = (M + 1) / 2;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums(M * BLOCK);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint16_t* wb = w + nb * K * BLOCK;
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += tile) {
        const int64_t k1 = std::min(K, k0 + tile);
        for (int64_t m0 = 0, pass = 0; m0 < M; m0 += 2, ++pass) {
          const TilePrefetch next = next_tile_share(wb + k1 * BLOCK, k1 - k0, 1, pass, passes);
          if (M - m0 >= 2) block_rows<2>(wb, xf.data() + m0 * K, K, k0, k1, sums.data() + m0 * BLOCK, next);
          else block_rows<1>(wb, xf.data() + m0 * K, K, k0, k1, sums.data() + m0 * BLOCK, next);
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int q = 0; q < 4; ++q) {
          const int64_t n = nb * BLOCK + 8 * q;
          if (n >= N) break;
          const vec::Live live = vec::live_lanes(N - n);
          const __m256 v = _mm256_loadu_ps(sums.data() + m * BLOCK + 8 * q);
          vec::store_bf16(yp + m * N + n, b ? _mm256_add_ps(v, vec::load_bf16(b + n, live)) : v, live);
        }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  define_shared_kernels(m);
}
