// Prefetching the next tile of weights while a call's passes over rows reuse the current one.
//
// Why: a linear kernel that takes its rows a few at a time passes over each tile of
// weights once per group of rows. The first pass reads the tile from memory; the later
// ones read it from cache and would leave memory idle. Each pass instead prefetches its
// share of the next tile (the bytes that follow: the next block's first tile after a
// block's last), so memory stays busy for the whole call and a pass over several rows
// costs little more than one row's stream of the weights.
#pragma once
#include <cstdint>

#include <immintrin.h>

// `burst` lines into L2 every `every` steps of a pass, from `at` on; nothing where `at` is null.
struct TilePrefetch {
  const char* at = nullptr;
  int64_t every = 1, burst = 0, countdown = 1;

  // One step of the pass (a k or a pair of k): prefetch when this step's turn comes.
  inline void step() {
    if (at && --countdown == 0) {
      countdown = every;
      for (int64_t l = 0; l < burst; ++l) _mm_prefetch(at + 64 * l, _MM_HINT_T1);
      at += 64 * burst;
    }
  }
};

// Pass `pass` of `passes` over a tile of `steps` steps, `lines` cache lines each, whose next
// tile starts at `next`: its share of the next tile's lines, spread evenly over its steps.
// A single pass gets none (it streams, and the kernel's line prefetch runs ahead of it).
inline TilePrefetch next_tile_share(const void* next, int64_t steps, int64_t lines, int64_t pass, int64_t passes) {
  if (passes < 2 || steps < 1) return {};
  const int64_t per_pass = (steps * lines + passes - 1) / passes;
  TilePrefetch share;
  share.at = static_cast<const char*>(next) + pass * per_pass * 64;
  share.burst = per_pass >= steps ? (per_pass + steps - 1) / steps : 1;
  share.every = share.countdown = per_pass >= steps ? 1 : steps / per_pass;
  return share;
}
