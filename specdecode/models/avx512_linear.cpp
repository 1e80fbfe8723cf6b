// bf16 linear layers on AVX-512 with AVX512_BF16 (AMD Zen 4, Intel Ice Lake and later
// without AMX): y = x @ W.T + b.
//
// Why: the AVX2 kernel widens every bf16 weight to fp32 and multiplies with FMA, 8 products
// an instruction; past a few rows a verify pass or a prefill is bound by those FMAs. The
// VDPBF16PS instruction takes pairs of bf16 along K straight from the packed weight and adds
// both products to an fp32 lane, 32 products an instruction, with no conversion.
// Every output is one chain of VDPBF16PS over the pairs of K in order, whatever the number
// of rows or the tiling, so a verify pass gives each token bitwise the logits of a
// one-token pass.
//
// Layout: W (N, K) is packed once into (N/64, K/2, 64, 2): blocks of 64 outputs, and for
// each pair of K the block's 64 outputs x 2 bf16 in four 64-byte lines (the pair layout
// VDPBF16PS reads), streamed front to back. K is padded to even. kernels.py packs it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <vector>

#include "bindings.h"
#include "kernels.h"
#include "vec.h"
#include "tile_prefetch.h"

namespace {

constexpr int64_t BLOCK = 64;  // outputs per packed block: four vectors of 16
constexpr int64_t MAX_ROWS = 6;  // rows sharing one pass over a tile: 24 accumulators + 4 weight vectors
// Bytes ahead of the weights being multiplied that are prefetched into L1: one line per
// pair of K is loaded, four are consumed, so the prefetch runs a kilobyte ahead as the AVX2
// kernel's does.
constexpr int64_t PREFETCH_AHEAD = 1024;
// Pairs of K per tile when a call has more rows than one pass takes: the tile's weights
// (256 x 256 B = 64 KB) stay in L2 while every group of rows passes over them, and each
// group's sums go to memory and back once per tile. On Zen 4, 256 pairs ran Qwen's
// products over 16 and 512 rows 5-18% faster than 64 (an L1-sized tile); 512 the same.
constexpr int64_t PAIR_TILE = 256;
constexpr int64_t LINES_PER_PAIR = BLOCK * 4 / 64;  // a pair of K: 64 outputs x 2 bf16
// Passes over a tile after its first prefetch the next tile (tile_prefetch.h). Streaming
// Qwen2.5-1.5B's matrices on Zen 4, that and six rows a pass (four before) took 8 rows from
// 1.4-1.6 to 1.1-1.2 one-row passes and 16 rows from 2.4 to 1.9-2.0.

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// Rows [0, R) of x (pairs of bf16 as uint32, K2 apart) times one block over pairs [p0, p1):
// sums[r][16q .. 16q + 15] carry the block's outputs from the previous tile to the next, so
// each output stays one chain of VDPBF16PS over K in order.
template <int R>
inline void block_rows(const uint32_t* wb, const uint32_t* x, int64_t K2, int64_t p0, int64_t p1, float* sums,
                       TilePrefetch next) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_loadu_ps(sums + r * BLOCK + 16 * q);
  for (int64_t p = p0; p < p1; ++p) {
    const uint32_t* line = wb + p * BLOCK;
    _mm_prefetch(reinterpret_cast<const char*>(line) + PREFETCH_AHEAD, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(line) + PREFETCH_AHEAD + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(line) + PREFETCH_AHEAD + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(line) + PREFETCH_AHEAD + 192, _MM_HINT_T0);
    next.step();
    __m512i w[4];
    for (int q = 0; q < 4; ++q) w[q] = _mm512_loadu_si512(line + 16 * q);
    for (int r = 0; r < R; ++r) {
      const __m512bh xp = as_bh(_mm512_set1_epi32(static_cast<int>(x[r * K2 + p])));
      for (int q = 0; q < 4; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], as_bh(w[q]), xp);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) _mm512_storeu_ps(sums + r * BLOCK + 16 * q, acc[r][q]);
}

void rows_pass(int64_t rows, const uint32_t* wb, const uint32_t* x, int64_t K2, int64_t p0, int64_t p1,
               float* sums, TilePrefetch next) {
  switch (rows) {
    case 1: return block_rows<1>(wb, x, K2, p0, p1, sums, next);
    case 2: return block_rows<2>(wb, x, K2, p0, p1, sums, next);
    case 3: return block_rows<3>(wb, x, K2, p0, p1, sums, next);
    case 4: return block_rows<4>(wb, x, K2, p0, p1, sums, next);
    case 5: return block_rows<5>(wb, x, K2, p0, p1, sums, next);
    default: return block_rows<6>(wb, x, K2, p0, p1, sums, next);
  }
}

}  // namespace

// x (M, K) bf16, K even; wp (N/64, K/2, 128) bf16; bias (N,) bf16 or empty -> (M, N) bf16
torch::Tensor linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous (M, K) bf16");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), K2 = K / 2;
  TORCH_CHECK(K % 2 == 0 && wp.dim() == 3 && wp.size(1) == K2 && wp.size(2) == 2 * BLOCK && NB * BLOCK >= N,
              "x's K does not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wp.data_ptr());
  const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t tile = M > MAX_ROWS ? PAIR_TILE : K2;  // one pass: nothing to keep in L1
  const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> sums(M * BLOCK);
    for (int64_t nb = b0; nb < b1; ++nb) {
      const uint32_t* wb = w + nb * K2 * BLOCK;
      std::fill(sums.begin(), sums.end(), 0.0f);
      for (int64_t p0 = 0; p0 < K2; p0 += tile) {
        const int64_t p1 = std::min(K2, p0 + tile);
        for (int64_t pass = 0, m0 = 0; pass < passes; ++pass) {
          const int64_t rows = M / passes + (pass < M % passes);  // passes of equal length
          rows_pass(rows, wb, xp + m0 * K2, K2, p0, p1, sums.data() + m0 * BLOCK,
                    next_tile_share(wb + p1 * BLOCK, p1 - p0, LINES_PER_PAIR, pass, passes));
          m0 += rows;
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int q = 0; q < 4; ++q) {
          const int64_t n = nb * BLOCK + 16 * q;
          if (n >= N) break;
          const __mmask16 live = vec::live_lanes(N - n);
          const __m512 v = _mm512_loadu_ps(sums.data() + m * BLOCK + 16 * q);
          vec::store_bf16(yp + m * N + n, b ? _mm512_add_ps(v, vec::load_bf16(b + n, live)) : v, live);
        }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  define_shared_kernels(m);
}
