// How many multiply-adds a second this machine's products can do at most, for the floor
// `speed` sets under a pass over several tokens.
//
// Every product multiplies each weight by each row's input with one instruction kind:
// quantized blocks with VPMADDUBSW (AVX2: 32 u8 x s8 products, summed into 16-bit pairs)
// or VNNI's VPDPBUSD (64 a 512-bit instruction); bf16 weights with fp32 FMA (AVX2: eight
// an instruction, after widening) or AVX512_BF16's VDPBF16PS (32). However a kernel reads
// its weights, a pass over n tokens performs n times a token's multiply-adds, so it takes at
// least that many at this rate: where that exceeds a one-token pass, verification is
// bound by arithmetic, not by memory.
//
// Each thread runs independent chains of the instruction on values held in registers
// (enough to cover its latency), all threads at once. Returns the rate and a checksum of
// every chain's result: the loop cannot be left out, and a test checks it computed what
// it claims.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <chrono>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

constexpr int CHAINS = 12;
// AVX2's 16 registers hold seven chains of VPMADDUBSW and their seven inputs beside `a`:
// with twelve, GCC kept some in memory and the loop ran at half the instruction's rate.
// Only the VPADDW is chained (one cycle), so seven keep both of a Zen 3 core's ports busy.
constexpr int MADDUBS_CHAINS = 7;
constexpr int64_t MAX_ITERATIONS = int64_t{1} << 24;  // float chains stay exact integers

// The sum of every lane, read as Lane, of the chains' vectors, in double: no int32 or
// float sum of lanes can wrap or round it. Each vector is copied by value before its
// lanes are read: read through the chains' own addresses, GCC kept the chains in memory
// inside the timed loop (fp32 FMAs ran at a third of their rate).
template <typename Lane, typename Vector>
double lane_sum(Vector v) {
  Lane lanes[sizeof(Vector) / sizeof(Lane)];
  std::memcpy(lanes, &v, sizeof(Vector));
  double sum = 0;
  for (Lane x : lanes) sum += x;
  return sum;
}

template <typename Lane, int Chains, typename Vector>
double chains_sum(const Vector (&chains)[Chains]) {
  double sum = 0;
  for (int c = 0; c < Chains; ++c) sum += lane_sum<Lane>(chains[c]);
  return sum;
}

// One thread's chains, `iterations` steps each: the sum of their final lanes.
double int8_chains(int64_t iterations) {
#ifdef __AVX512VNNI__
  __m512i acc[CHAINS], b[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_setzero_si512(), b[c] = _mm512_set1_epi8(c + 1);
  __m512i a = _mm512_set1_epi8(1);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b[c]);
    asm volatile("" : "+v"(a));  // a fresh operand each step: no product is hoisted out of the loop
  }
  return chains_sum<int32_t>(acc);
#else
  __m256i acc[MADDUBS_CHAINS], b[MADDUBS_CHAINS];
  for (int c = 0; c < MADDUBS_CHAINS; ++c) acc[c] = _mm256_setzero_si256(), b[c] = _mm256_set1_epi8(c + 1);
  __m256i a = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 7
    for (int c = 0; c < MADDUBS_CHAINS; ++c) acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(a, b[c]));
    asm volatile("" : "+x"(a));
  }
  return chains_sum<int16_t>(acc);
#endif
}

double bf16_chains(int64_t iterations) {
#ifdef __AVX512BF16__
  const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3F80);  // bf16 1.0 in every half
  __m512 acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_setzero_ps();
  __m512bh a = one;
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, one);
    asm volatile("" : "+v"(a));
  }
  return chains_sum<float>(acc);
#else
  __m256 acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_setzero_ps();
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 a = one;
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = _mm256_fmadd_ps(a, one, acc[c]);
    asm volatile("" : "+x"(a));
  }
  return chains_sum<float>(acc);
#endif
}

// Multiply-adds one step of all of a thread's chains performs.
int64_t per_step(bool quantized) {
#ifdef __AVX512VNNI__
  if (quantized) return CHAINS * 64;
#else
  if (quantized) return MADDUBS_CHAINS * 32;
#endif
#ifdef __AVX512BF16__
  return CHAINS * 32;
#else
  return CHAINS * 8;
#endif
}

}  // namespace

// {multiply-adds a second on all threads, the checksum of every chain of every thread}.
std::vector<double> multiply_add_peak(bool quantized, int64_t iterations) {
  TORCH_CHECK(iterations >= 1 && iterations <= MAX_ITERATIONS, "iterations: 1 to ", MAX_ITERATIONS);
  const int64_t threads = at::get_num_threads();
  std::vector<double> sums(threads, 0);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) sums[t] = quantized ? int8_chains(iterations) : bf16_chains(iterations);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double checksum = 0;
  for (double s : sums) checksum += s;
  const double work = static_cast<double>(threads) * per_step(quantized) * iterations;
  return {work / seconds, checksum};
}
