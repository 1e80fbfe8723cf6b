// The vector type the bf16 kernels are written over: sixteen fp32 lanes in the builds with
// AVX-512 (amx, avx512), eight in the AVX2 build. ops.cpp and the shared steps of attention
// are written once over these helpers; a build changes how many values a step takes and
// the pattern of a lane sum, nothing else. Every helper is elementwise (but reduce_add),
// so a value's result never depends on its neighbours or on how many rows a call has.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace vec {

using bf16 = c10::BFloat16;

#ifdef __AVX512F__

using F = __m512;
constexpr int LANES = 16;
using Live = __mmask16;  // the lanes a step still fills

inline Live live_lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

inline F zero() { return _mm512_setzero_ps(); }
inline F set1(float x) { return _mm512_set1_ps(x); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F max(F a, F b) { return _mm512_max_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }   // a b + c, rounded once
inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); } // c - a b, rounded once
inline F round_to_int(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline F times_two_to(F p, F n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n a whole number
inline F negative_abs(F x) { return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)); }
// if_negative where a < 0, else otherwise
inline F where_negative(F a, F if_negative, F otherwise) {
  return _mm512_mask_mov_ps(otherwise, _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_LT_OQ), if_negative);
}
inline float reduce_add(F x) { return _mm512_reduce_add_ps(x); }

inline F load(const float* p, Live live) { return _mm512_maskz_loadu_ps(live, p); }  // 0 in dead lanes
inline void store(float* p, F x, Live live) { _mm512_mask_storeu_ps(p, live, x); }
inline F keep(F x, Live live) { return _mm512_maskz_mov_ps(live, x); }  // 0 in dead lanes

// 16 bf16 -> 16 fp32, exact
inline F load_bf16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline F load_bf16(const bf16* p, Live live) {  // 0 in dead lanes
  const __m256i raw = _mm256_maskz_loadu_epi16(live, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> bf16, rounded to nearest even as c10::BFloat16(float) rounds finite values
inline void store_bf16(bf16* p, F x, Live live) { _mm256_mask_storeu_epi16(p, live, (__m256i)_mm512_cvtneps_pbh(x)); }

inline F round_bf16(F x) {  // to the nearest bf16, kept in fp32
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

#else  // AVX2

using F = __m256;
constexpr int LANES = 8;
using Live = int64_t;  // how many of the 8 lanes a step still fills, from the first

inline Live live_lanes(int64_t left) { return std::min<int64_t>(left, 8); }

inline F zero() { return _mm256_setzero_ps(); }
inline F set1(float x) { return _mm256_set1_ps(x); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F max(F a, F b) { return _mm256_max_ps(a, b); }
inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
inline F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
inline F round_to_int(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p 2^n, n a whole number >= -126: 2^n built in the exponent bits
inline F times_two_to(F p, F n) {
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
inline F negative_abs(F x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.0f)); }  // the sign bit set
inline F where_negative(F a, F if_negative, F otherwise) {
  return _mm256_blendv_ps(otherwise, if_negative, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ));
}

// the sum of the 8 lanes, in a fixed pattern: (0+4, 1+5, 2+6, 3+7), then pairs
inline float reduce_add(F x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i lane_mask(Live live) {  // all ones in the live lanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline F load(const float* p, Live live) { return _mm256_maskload_ps(p, lane_mask(live)); }
inline void store(float* p, F x, Live live) { _mm256_maskstore_ps(p, lane_mask(live), x); }
inline F keep(F x, Live live) { return _mm256_and_ps(x, _mm256_castsi256_ps(lane_mask(live))); }

// 8 bf16 -> 8 fp32, exact
inline F load_bf16(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline F load_bf16(const bf16* p, Live live) {  // 0 in dead lanes
  if (live >= 8) return load_bf16(p);
  alignas(16) uint16_t buffer[8] = {0};
  std::memcpy(buffer, p, live * sizeof(uint16_t));
  return load_bf16(reinterpret_cast<const bf16*>(buffer));
}

// 8 fp32 -> bf16 bits in the low 16 of each 32-bit lane, rounded to nearest even as
// c10::BFloat16(float) rounds (NaN stays NaN: 0x7FC0)
inline __m256i bf16_bits(F x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

inline F round_bf16(F x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }

inline void store_bf16(bf16* p, F x, Live live) {
  const __m256i bits = bf16_bits(x);
  // 32-bit lanes -> 16-bit: pack within each 128-bit half, then gather the two halves
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  if (live >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  } else {
    alignas(16) uint16_t buffer[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(buffer), packed);
    std::memcpy(p, buffer, live * sizeof(uint16_t));
  }
}

#endif

// exp(x) for x <= 0: 2^n p(r), r = x - n ln2 in [-ln2/2, ln2/2] (ln2 in two parts, so r
// is nearly exact), p the degree-6 Taylor polynomial (relative error about 2e-7); the clamp
// keeps n >= -126
inline F exp_nonpositive(F x) {
  x = max(x, set1(-87.0f));
  const F n = round_to_int(mul(x, set1(1.44269504088896341f)));
  F r = fnmadd(n, set1(0.693145751953125f), x);
  r = fnmadd(n, set1(1.428606765330187045e-06f), r);
  F p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return times_two_to(p, n);
}

// s_i <- exp(s_i - top) over m scores (top their maximum, so every exponent is <= 0);
// returns 1 / sum_i of them, summed in LANES lanes over the list in order, then across
inline float exp_shifted_in_place(float* s, int64_t m, float top) {
  F lanes = zero();
  for (int64_t i = 0; i < m; i += LANES) {
    const Live live = live_lanes(m - i);
    const F p = keep(exp_nonpositive(sub(load(s + i, live), set1(top))), live);
    store(s + i, p, live);
    lanes = add(lanes, p);
  }
  return 1.0f / reduce_add(lanes);
}

}  // namespace vec
