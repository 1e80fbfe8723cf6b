// Vector helpers shared by the kernels: bf16 loads and stores, and exp, in AVX-512.
// Elementwise, so a value's result never depends on its neighbours or the row count.
#pragma once
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace simd {

// The lanes of a 16-wide step that `left` values still fill
inline __mmask16 live_lanes(int64_t left) {
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}

// 16 bf16 -> 16 fp32, exact
inline __m512 load_bf16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 Taylor
// polynomial (relative error about 2e-7); elementwise, so it is the same for any layout.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 -> 16 fp32 where `live`, 0 elsewhere
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 live) {
  const __m256i raw = _mm256_maskz_loadu_epi16(live, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 fp32 -> bf16, rounded to nearest even as c10::BFloat16(float) rounds finite values
inline void store_bf16(c10::BFloat16* p, __m512 x, __mmask16 live) {
  _mm256_mask_storeu_epi16(p, live, (__m256i)_mm512_cvtneps_pbh(x));
}

inline __m512 round_bf16(__m512 x) {  // to the nearest bf16, kept in fp32
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

}  // namespace simd
