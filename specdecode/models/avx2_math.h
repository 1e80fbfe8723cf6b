// Vector helpers for the AVX2 kernels (CPUs without AVX-512, such as AMD Zen 3): bf16
// loads and stores, exp, and a lane sum, eight fp32 lanes at a time. The AVX-512 kernels'
// simd_math.h has the same helpers sixteen wide. Elementwise, so a value's result never
// depends on its neighbours or on how many rows a call has.
#pragma once
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace avx2 {

// 8 bf16 -> 8 fp32, exact
inline __m256 load_bf16(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// the first `left` (< 8) of 8 bf16, zeros after
inline __m256 load_bf16(const c10::BFloat16* p, int64_t left) {
  if (left >= 8) return load_bf16(p);
  alignas(16) uint16_t buffer[8] = {0};
  std::memcpy(buffer, p, left * sizeof(uint16_t));
  return load_bf16(reinterpret_cast<const c10::BFloat16*>(buffer));
}

// 8 fp32 -> bf16 bits in the low 16 of each 32-bit lane, rounded to nearest even as
// c10::BFloat16(float) rounds (NaN stays NaN: 0x7FC0)
inline __m256i bf16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

inline __m256 round_bf16(__m256 x) {  // to the nearest bf16, kept in fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16));
}

// the first `left` (all if >= 8) of 8 fp32, rounded to bf16, stored at p
inline void store_bf16(c10::BFloat16* p, __m256 x, int64_t left = 8) {
  const __m256i bits = bf16_bits(x);
  // 32-bit lanes -> 16-bit: pack within each 128-bit half, then gather the two halves
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  if (left >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    alignas(16) uint16_t buffer[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buffer), packed);
    std::memcpy(p, buffer, left * sizeof(uint16_t));
  }
}

// the sum of the 8 lanes, in a fixed pattern: (0+4, 1+5, 2+6, 3+7), then pairs
inline float reduce_add(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], the same degree-6
// polynomial as simd_math.h; 2^n built in the exponent bits (n >= -126 after the clamp)
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

}  // namespace avx2
