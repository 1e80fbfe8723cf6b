// bf16 linear layers on Intel AMX: y = x @ W.T + b, for decoding on CPU.
//
// Why: a decoding step streams every weight once, so its speed is the rate weights
// stream; oneDNN's packed bf16 product reaches about 22 GB/s here, this kernel about 25.
// And every row of x is computed by the same tile instructions in the same order whatever
// the number of rows, so a verify pass over any number of tokens gives each token bitwise
// the logits of a one-token pass (oneDNN's result for a row changes past 11 rows).
//
// Layout: W (N, K) is packed once into (N/64, K/32, 4, 16, 16, 2): groups of 64 outputs;
// per step of 32 along K, four 1 KB tiles of 16 pair-rows x 16 outputs x 2 (the VNNI
// layout TDPBF16PS reads), so each thread streams its groups front to back. Built at first
// use by models/kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

#include "amx_tiles.h"
#include "bindings.h"
#include "kernels.h"
#include "vec.h"

namespace {

constexpr int64_t G = 4;      // 16-output blocks per group: one weight stream feeds 4 C tiles
constexpr int64_t TK = 32;    // bf16 elements of K per tile step
constexpr int64_t MT = 16;    // rows of x per tile
constexpr int64_t TILE = 512; // bf16 elements per weight tile: 16 pair-rows x 16 outputs x 2
// Bytes ahead of the tiles being multiplied that are prefetched into L1: tile loads alone
// leave the hardware prefetcher behind; one K step (4 KB) ahead streamed 3-8% faster here
// (SmolLM2's layers 20.5-21.8 -> 22.2-23.1 GB/s, Qwen's 26.3-26.8 -> 26.9-27.8; 2 KB and
// 6 KB ahead were within the noise of it, L2-only prefetches were slower).
constexpr int64_t PREFETCH_AHEAD = 4096;
constexpr int64_t SPLIT_K_BELOW_GROUPS = 16;  // see linear()


void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.tile(t, rows, 64);  // C: rows x 16 fp32
  cfg.tile(4, rows, 64);                               // A: rows x 32 bf16
  for (int t = 5; t < 8; ++t) cfg.tile(t, 16, 64);     // B: 16 x (16 outputs x 2)
  cfg.load();
}

// One group of 64 outputs for rows [m0, m0 + rows): C tiles accumulate over all of K in order.
inline void group_tile(const uint16_t* wg, int64_t KS, const uint16_t* x, int64_t ldx, float* c) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t ks = 0; ks < KS; ++ks) {
    const uint16_t* wk = wg + ks * G * TILE;
    const char* ahead = reinterpret_cast<const char*>(wk) + PREFETCH_AHEAD;
    for (int64_t b = 0; b < G * TILE * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    _tile_loadd(4, x + ks * TK, ldx * 2);
    _tile_loadd(5, wk, 64);            _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + TILE, 64);     _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wk + 2 * TILE, 64); _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wk + 3 * TILE, 64); _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c, G * 16 * 4); _tile_stored(1, c + 16, G * 16 * 4);
  _tile_stored(2, c + 32, G * 16 * 4); _tile_stored(3, c + 48, G * 16 * 4);
}

}  // namespace

bool request_amx() {
  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux hands out AMX state on request.
  return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

// x (M, Kp) bf16; wp (NG, Kp/32, G, 16, 16, 2) bf16; bias (N,) bf16 or empty -> (M, N) bf16
torch::Tensor linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous (M, K) bf16");
  const int64_t M = x.size(0), Kp = x.size(1), NG = wp.size(0), KS = Kp / TK;
  TORCH_CHECK(Kp % TK == 0 && wp.size(1) == KS, "x's K does not match the packed weight");
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xp = (const uint16_t*)x.data_ptr();
  const uint16_t* w = (const uint16_t*)wp.data_ptr();
  const c10::BFloat16* b = bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // A matrix of few groups (a small model's 576 x 1536) splits unevenly across threads by
  // group (9 groups: 5 and 4), so it also splits K in two halves, summed in order after.
  // The split depends on the shape only, so every call rounds a row alike.
  const int64_t parts = (NG < SPLIT_K_BELOW_GROUPS && KS >= 8) ? 2 : 1;
  std::vector<float> partial(parts > 1 ? parts * M * N : 0);
  at::parallel_for(0, NG * parts, 1, [&](int64_t u0, int64_t u1) {
    alignas(64) float c[MT * G * 16];
    int configured = -1;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t g = u / parts, part = u % parts;
      const int64_t k0 = KS * part / parts, k1 = KS * (part + 1) / parts;
      const uint16_t* wg = w + (g * KS + k0) * G * TILE;
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int rows = (int)std::min(MT, M - m0);
        if (rows != configured) { configure(rows); configured = rows; }
        group_tile(wg, k1 - k0, xp + m0 * Kp + k0 * TK, Kp, c);
        const int64_t n0 = g * G * 16, n1 = std::min(N, n0 + G * 16);
        for (int r = 0; r < rows; ++r)
          for (int64_t n = n0; n < n1; n += 16) {
            const __mmask16 live = vec::live_lanes(n1 - n);
            const __m512 v = _mm512_loadu_ps(c + r * G * 16 + (n - n0));
            if (parts > 1) {
              _mm512_mask_storeu_ps(partial.data() + (part * M + m0 + r) * N + n, live, v);
            } else {
              vec::store_bf16(yp + (m0 + r) * N + n, b ? _mm512_add_ps(v, vec::load_bf16(b + n, live)) : v, live);
            }
          }
      }
    }
    if (configured >= 0) _tile_release();
  });
  if (parts > 1)  // the halves summed in order, as the scalar sum v0 + v1 (+ bias) rounds
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; n += 16) {
        const __mmask16 live = vec::live_lanes(N - n);
        __m512 v = _mm512_maskz_loadu_ps(live, partial.data() + m * N + n);
        for (int64_t part = 1; part < parts; ++part)
          v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, partial.data() + (part * M + m) * N + n));
        vec::store_bf16(yp + m * N + n, b ? _mm512_add_ps(v, vec::load_bf16(b + n, live)) : v, live);
      }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("request_amx", &request_amx);
  define_shared_kernels(m);
}
