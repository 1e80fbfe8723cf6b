// Linear layers over GGUF's quantized blocks, as the file stores them: y = x @ W.T + b.
//
// W is one or more parts stacked along the outputs (a fused q|k|v may mix Q4_K and Q6_K
// rows), each a uint8 tensor (rows, blocks per row, bytes per block) in GGUF's own row
// layout; the bytes per block name the type (quant.py): 144 Q4_K, 210 Q6_K, 34 Q8_0,
// 18 Q4_0, 20 Q4_1, 22 Q5_0, and 1216, 1696, 272 and 176 for Q4_K, Q6_K, Q8_0 and Q5_0
// repacked eight rows at a time (below).
//
// Each row of x is quantized on its own, as llama.cpp does: to 8 bits per 256 values with
// one fp32 scale and the sums of each 16 (Q8_K) for the K-quants, per 32 for the others. A weight
// block is unpacked to bytes once and applied to every row of the call; within a block
// the products are summed in integers (exact), and the blocks' scaled sums are added into
// eight fp32 lanes in block order, then summed across lanes. So every output is the same sequence of operations whatever the
// number of rows: a verify pass gives each token bitwise the output of a one-token pass.
// With AMX, passes over many rows take each block's integer sums from tile products
// instead (amx_scaled, amx_pair): the same integers, finished by the same operations.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"

// VNNI's VPDPBUSD adds four u8 x s8 products into an int32 lane in one instruction, where
// AVX2 takes PMADDUBSW (pairs into int16) and PMADDWD. No int16 sum of AVX2's can saturate
// here (each block type states its bound), so both give the same integers and the same output.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#endif

// AMX's TDPBSUD (TDPBSSD) multiplies a tile of up to 16 rows' signed bytes by 16 columns of
// unsigned (signed) ones, each output an exact int32 sum (see amx_scaled, amx_pair).
#if defined(VNNI) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define AMX_INT8 1
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t QK_K = 256;  // values per K-quant block
constexpr int64_t QK8_0 = 32;  // values per Q8_0 block
constexpr int64_t PREFETCH_BLOCKS = 16;  // blocks ahead of the one multiplied brought into L1
// Repacked blocks (1-2 KB) are prefetched whole; these distances are AMD EPYC Zen 4's (Intel
// Xeon's differ: prefetch_ahead). For up to five rows (a decoding step, a verify pass of up
// to four drafts) just before they are multiplied, so every line's miss is in flight at once
// instead of as the unpacking reaches it; for more rows, whose products take longer, six
// blocks ahead.
// Streaming 137 MB of Q6_K x8 on AMD EPYC Zen 4 (2 threads, three runs each), one row:
// 33-51 GB/s so, 17-20 GB/s one or two blocks ahead, 12-16 GB/s without.
// All of Qwen2.5-1.5B's Q4_K_M matrices (1 GB), same machine, in one run: 2 rows 32 ms so
// against 42 two blocks ahead and 47 six ahead (one row: 23-24); 4 rows 45, 55, 60;
// 6 rows 68-70 any; 8 rows 85, 89, 80; 16 rows 147, 146, 138. Later, after the products
// changed, just before against six ahead, interleaved, median ms: 5 rows 37.6 / 44.9 and
// 42.3 / 51.9; 6 rows 51.0 / 51.2 (4 rows, the same code in both, 36.4 / 35.5).
// The AVX2 build (AMD EPYC Zen 2 measured) does better with three and four rows six ahead.
// Its threads also read WEIGHT_STREAMS groups of weights side by side in a pass over one or
// two rows (x8_streams_rows): there one core's sequential read stops at about 12 GB/s while
// four streams far apart reach 18-21. Qwen2.5-1.5B's layer shapes in random blocks (1.09 GB
// of Q4_K and Q6_K), AMD EPYC Zen 2, 2 threads, variants interleaved, median ms: one stream
// against four, 1 row 58.9 / 50.6, 2 rows 64.3 / 59.6 (3 and 4 rows lost 6-11%); six blocks
// ahead against just before, 3 rows 71.4 / 75.5, 4 rows 76.3 / 85.1.
// There a block's prefetches are spread over its groups' work (PREFETCH_SPREAD: each group
// fetches its share of the lines of the block PREFETCH_X8_* ahead) rather than issued at
// once, which leaves a core fewer misses to queue at a time and keeps them coming while it
// computes: the same shapes (1.02 GB), AMD EPYC Zen 2, 2 threads, interleaved, median ms,
// whole blocks against spread one block ahead: 1 row 35.9-39.0 / 29.0-32.2 (the first is at
// 34.8 GB/s, the bandwidth measured), 2 rows 49.3-51.3 / 38.7-39.5; spread two ahead (six
// ahead the same): 3 rows 51.6 / 47.3, 4 rows 61.8 / 56.3, 8 rows 117.0 / 109.7. Spread
// one ahead, fewer streams: 1 row 36.8 with two, 40.3 with one.
#ifdef __AVX512F__
constexpr int64_t FEW_ROWS = 5, WEIGHT_STREAMS = 1, PREFETCH_X8_FEW_ROWS = 0, PREFETCH_X8_ROWS = 6;
constexpr bool PREFETCH_SPREAD = false;
#else
constexpr int64_t FEW_ROWS = 2, WEIGHT_STREAMS = 4, PREFETCH_X8_FEW_ROWS = 1, PREFETCH_X8_ROWS = 2;
constexpr bool PREFETCH_SPREAD = true;
#endif
constexpr int64_t STREAM_ROWS = 2;
constexpr int64_t TILE_ROWS = 64, TILE_VALUES = 4096;  // a long pass's tile of inputs: 64 rows x 4096 values
constexpr int64_t Q4_K_BYTES = 144, Q6_K_BYTES = 210, Q8_0_BYTES = 34, Q4_0_BYTES = 18, Q4_1_BYTES = 20,
                  Q5_0_BYTES = 22;
constexpr int64_t Q4_K_X8_BYTES = 1216;  // eight rows' Q4_K blocks, repacked (Q4KX8)
constexpr int64_t Q6_K_X8_BYTES = 1696;  // eight rows' Q6_K blocks, repacked (Q6KX8)
constexpr int64_t Q8_0_X8_BYTES = 272;   // eight rows' Q8_0 blocks, repacked (Q80X8)
constexpr int64_t Q5_0_X8_BYTES = 176;   // eight rows' Q5_0 blocks, repacked (Q50X8)

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One row's activations quantized to 8 bits: per block a scale, the values and the sums of
// each 16 and each 32 values, which carry the weights' offsets (Q4_K's mins, Q6_K's -32,
// Q4_x's). A sum of 32 is at most 32 x 127 = 4064: int16.
struct Q8Row {
  std::vector<float> d;
  std::vector<int8_t> q;
  std::vector<int16_t> sums16, sums32;
};

// A run of quantized rows: all of a call's, or a tile of them.
struct Rows {
  const Q8Row* first;
  int64_t count;
  const Q8Row* data() const { return first; }
  size_t size() const { return static_cast<size_t>(count); }
  const Q8Row& operator[](int64_t i) const { return first[i]; }
};

// x (K floats) -> blocks of `block` values (a multiple of 32) scaled to [-127, 127],
// rounded to nearest even (the default rounding of CVTPS2DQ, as std::nearbyint's). The
// maximum is exact in any order, so eight lanes give the scalar loop's scale bitwise.
Q8Row quantize_row(const float* x, int64_t K, int64_t block) {
  Q8Row row;
  const int64_t n = K / block;
  row.d.resize(n);
  row.q.resize(K);
  row.sums16.resize(K / 16);
  row.sums32.resize(K / 32);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t b = 0; b < n; ++b) {
    const float* xb = x + b * block;
    __m256 amax8 = _mm256_setzero_ps();
    for (int64_t i = 0; i < block; i += 8) amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float iscale = amax > 0.f ? 127.f / amax : 0.f;
    row.d[b] = amax / 127.f;
    const __m256 scale8 = _mm256_set1_ps(iscale);
    for (int64_t i = 0; i < block; i += 32) {
      __m256i v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), scale8));
      const __m256i packed = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row.q.data() + b * block + i), packed);
    }
  }
  for (int64_t g = 0; g < K / 16; ++g) {
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += row.q[g * 16 + i];
    row.sums16[g] = static_cast<int16_t>(s);
  }
  for (int64_t g = 0; g < K / 32; ++g) row.sums32[g] = static_cast<int16_t>(row.sums16[2 * g] + row.sums16[2 * g + 1]);
  return row;
}

// Every row of x (M, K; fp32, or bf16 widened a row at a time, exactly) quantized on its
// own (quantize_row), rows in parallel where there are enough values to pay for the threads.
std::vector<Q8Row> quantize_rows(const torch::Tensor& x, int64_t block) {
  const int64_t M = x.size(0), K = x.size(1);
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const float* fp32 = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* narrow = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  std::vector<Q8Row> rows(M);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / K);
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    std::vector<float> wide(bf16 ? K : 0);
    for (int64_t m = m0; m < m1; ++m) {
      if (!bf16) {
        rows[m] = quantize_row(fp32 + m * K, K, block);
        continue;
      }
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(narrow[m * K + k]) << 16;
        std::memcpy(&wide[k], &bits, 4);
      }
      rows[m] = quantize_row(wide.data(), K, block);
    }
  });
  return rows;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Two adjacent int16 sums, p[0] in the low half and p[1] in the high half of every 32-bit
// lane (one broadcast load), to multiply pairs of int16 weights' scales with PMADDWD.
inline __m256i broadcast_pair(const int16_t* p) {
  int32_t two;
  std::memcpy(&two, p, 4);
  return _mm256_set1_epi32(two);
}

// Four int8 inputs at q, repeated in every 32-bit lane.
inline __m256i broadcast4(const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, 4);
  return _mm256_set1_epi32(four);
}

#ifdef VNNI
// acc += v (unsigned bytes) times the four signed bytes at q in every lane, the broadcast
// being the instruction's own memory operand ({1to8}, {1to16}): GCC emits a VPBROADCASTD
// of its own for _mm*_set1_epi32 there, one more instruction beside every VPDPBUSD.
// Qwen2.5-1.5B's layer shapes, AMD EPYC Zen 4, 2 threads, one layer's matrices in cache,
// 64 rows (with the chunks' prefetches below): 15.9 -> 14.4 ms; all 28 layers streamed,
// 3 rows: 34.0 -> 31.6 ms, 1 and 8 rows within 4%.
inline __m256i dpbusd_broadcast(__m256i acc, __m256i v, const int8_t* q) {
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*reinterpret_cast<const int32_t*>(q)));
  return acc;
}
#if defined(__AVX512BW__)
inline __m512i dpbusd_broadcast(__m512i acc, __m512i v, const int8_t* q) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*reinterpret_cast<const int32_t*>(q)));
  return acc;
}
#endif
#endif

// Each block type: `unpack` a block once, then `dot` it with block b of any number of rows,
// adding to that row's eight fp32 lanes (summed once the row of weights is done).

// Q4_K: d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 groups of 32, 128 bytes of
// nibbles (low nibbles of bytes 32j.. are values 64j.., high nibbles values 64j + 32..).
// A value is d * scale[g] * q - dmin * min[g].
struct Q4K {
  static constexpr int64_t BYTES = Q4_K_BYTES, VALUES = QK_K;
  __m256i v[8], scale[8];
  __m128i mins;
  float d, dmin;

  void unpack(const uint8_t* b) {
    d = half_to_float(b);
    dmin = half_to_float(b + 2);
    uint32_t u[4];  // the 12 bytes of scales and mins -> 8 scales, then 8 mins, a byte each
    std::memcpy(u, b + 4, 12);
    constexpr uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
    u[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
    const uint32_t low_mins = u[1] & six;
    u[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
    u[2] = low_mins;
    u[0] &= six;
    const __m256i both = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3], u[2], u[1], u[0]));  // 8 scales, 8 mins
    mins = _mm256_extracti128_si256(both, 1);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(both));
    for (int g = 0; g < 8; ++g) scale[g] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * g)));
    const __m256i low = _mm256_set1_epi8(0xF);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(b + 16 + 32 * j);
      v[2 * j] = _mm256_and_si256(raw, low);
      v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
  }

  void dot(const Q8Row& x, int64_t b, __m256& acc) const {
    const int8_t* q = x.q.data() + b * QK_K;
    __m256i sum = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g)
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(v[g], load32(q + 32 * g)), scale[g]));
    const __m256i s16 = load32(x.sums16.data() + b * 16);  // sums of 16; pairs of them make the groups of 32
    const __m128i groups = _mm_hadd_epi16(_mm256_castsi256_si128(s16), _mm256_extracti128_si256(s16, 1));
    const __m128i offset = _mm_madd_epi16(mins, groups);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(sum), acc);
    acc = _mm256_fnmadd_ps(_mm256_set1_ps(x.d[b] * dmin), _mm256_cvtepi32_ps(_mm256_zextsi128_si256(offset)), acc);
  }
};

// Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
// values), d (fp16). In each half of 128 values, value l (0-31) takes the low nibble of
// ql[l] and bits 0-1 of qh[l]; l + 32: ql[l + 32], bits 2-3; l + 64: the high nibble of
// ql[l], bits 4-5; l + 96: the high nibble of ql[l + 32], bits 6-7. A value is
// d * scale[i / 16] * (q - 32).
struct Q6K {
  static constexpr int64_t BYTES = Q6_K_BYTES, VALUES = QK_K;
  __m256i v[8], scales[8], scale16;
  float d;

  void unpack(const uint8_t* b) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    d = half_to_float(b + 208);
    const __m256i low = _mm256_set1_epi8(0xF), two = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load32(ql + 64 * h), l1 = load32(ql + 64 * h + 32), hi = load32(qh + 32 * h);
      auto bits = [&](int shift) {  // (hi >> shift) & 3, moved to bits 4-5
        return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, shift), two), 4);
      };
      v[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low), bits(0));
      v[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), bits(2));
      v[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), bits(4));
      v[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), bits(6));
    }
    scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    const __m256i halves[2] = {_mm256_broadcastsi128_si256(_mm256_castsi256_si128(scale16)),
                               _mm256_broadcastsi128_si256(_mm256_extracti128_si256(scale16, 1))};
    for (int c = 0; c < 8; ++c) {  // values 32c.. take scale 2c, values 32c + 16.. scale 2c + 1
      const int16_t first = static_cast<int16_t>(0x0100 + 0x0202 * (2 * c % 8));
      scales[c] = _mm256_shuffle_epi8(halves[c / 4], _mm256_set_m128i(_mm_set1_epi16(first + 0x0202), _mm_set1_epi16(first)));
    }
  }

  void dot(const Q8Row& x, int64_t b, __m256& acc) const {
    const int8_t* q = x.q.data() + b * QK_K;
    __m256i sum = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c)
      sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(v[c], load32(q + 32 * c)), scales[c]));
    const __m256i offset = _mm256_madd_epi16(scale16, load32(x.sums16.data() + b * 16));  // the -32, times 1/32
    sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(offset, 5));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(sum), acc);
  }
};

// Q4_0 and Q4_1: d (fp16), for Q4_1 an offset m (fp16), and 16 bytes of nibbles: the low
// nibble of byte j is value j, the high one value j + 16. A value is d * (q - 8) (Q4_0) or
// d * q + m (Q4_1). Rows are quantized per 32, whose sums carry the offset.
template <bool WITH_MIN>
struct Q4Legacy {
  static constexpr int64_t BYTES = WITH_MIN ? Q4_1_BYTES : Q4_0_BYTES, VALUES = QK8_0;
  __m256i v;
  float d, m;

  void unpack(const uint8_t* b) {
    d = half_to_float(b);
    m = WITH_MIN ? half_to_float(b + 2) : 0.f;
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (WITH_MIN ? 4 : 2)));
    const __m128i low = _mm_set1_epi8(0xF);
    v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
  }

  void dot(const Q8Row& x, int64_t b, __m256& acc) const {
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, load32(x.q.data() + b * QK8_0)), _mm256_set1_epi16(1));
    const int32_t sum = x.sums16[2 * b] + x.sums16[2 * b + 1];
    if (WITH_MIN) {
      acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(p), acc);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * m), _mm256_setr_ps(sum, 0, 0, 0, 0, 0, 0, 0), acc);
    } else {
      p = _mm256_sub_epi32(p, _mm256_setr_epi32(8 * sum, 0, 0, 0, 0, 0, 0, 0));
      acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(p), acc);
    }
  }
};

// Q5_0: d (fp16), the fifth bits of 32 values (bit j of a uint32 is value j's), and their
// low four bits as Q4_0 lays them out; a value is d * (q - 16). Values are 0-31, so two
// products fit an int16 (2 x 31 x 127).
struct Q50 {
  static constexpr int64_t BYTES = Q5_0_BYTES, VALUES = QK8_0;
  __m256i v;
  float d;

  void unpack(const uint8_t* b) {
    d = half_to_float(b);
    uint32_t high;
    std::memcpy(&high, b + 2, 4);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6));
    const __m128i low = _mm_set1_epi8(0xF);
    // byte j of `bits` is 0xFF where bit j of `high` is set: byte j takes high's byte j / 8,
    // then every bit but j % 8 is set by the mask, so only a set bit j makes it all ones
    __m256i bits = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(high)),
                                       _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE)), _mm256_set1_epi64x(-1));
    v = _mm256_or_si256(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low)),
                        _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
  }

  void dot(const Q8Row& x, int64_t b, __m256& acc) const {
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(v, load32(x.q.data() + b * QK8_0)), _mm256_set1_epi16(1));
    const int32_t sum = x.sums16[2 * b] + x.sums16[2 * b + 1];
    p = _mm256_sub_epi32(p, _mm256_setr_epi32(16 * sum, 0, 0, 0, 0, 0, 0, 0));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(p), acc);
  }
};

// Q8_0: d (fp16) and 32 int8 values; a value is d * q. Rows are quantized per 32 to match.
struct Q80 {
  static constexpr int64_t BYTES = Q8_0_BYTES, VALUES = QK8_0;
  __m256i magnitude, sign;
  float d;

  void unpack(const uint8_t* b) {
    d = half_to_float(b);
    const __m256i q = load32(b + 2);
    magnitude = _mm256_sign_epi8(q, q);  // |q|, so maddubs may take it as unsigned
    sign = q;
  }

  void dot(const Q8Row& x, int64_t b, __m256& acc) const {
    const __m256i signed_x = _mm256_sign_epi8(load32(x.q.data() + b * QK8_0), sign);
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), _mm256_set1_epi16(1));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(x.d[b] * d), _mm256_cvtepi32_ps(p), acc);
  }
};

// Blocks repacked eight rows at a time (quant.py): one 256-bit vector holds four values
// of each of the eight rows, so a product with four inputs broadcast leaves each row's sum
// in its own lane, and no lane sums are needed. Each type: `load` a block's per-row scales,
// `unpack` its group g of 32 values once, `dot` that group with a row's 32 inputs (int32 per
// output row), and `finish` a row's block sum with its offsets and fp32 scales.

// The vectors a repacked block type's per-row sums live in: one group of eight rows of
// weights in 256-bit vectors or, with AVX-512 (Q4KPair), two groups' sixteen in 512-bit ones.
struct Lanes8 {
  // Rows that share a pass over the weights: eight. With AVX-512's 32 vector registers their
  // sums and lanes fit beside a whole unpacked group (`unpack`, then `dot` per row). AVX2's 16
  // hold them only beside a part of a group, so there each type's `dot_rows` unpacks a group a
  // part at a time for all the rows, from QUARTER_ROWS rows on: with `unpack` and `dot`, four
  // rows' sums already spilled to the stack. All of Qwen2.5-1.5B's Q4_K_M matrices streamed
  // from memory, AMD EPYC Zen 4 with the AVX2 build, 2 threads, interleaved, median of 15: 3
  // rows 37.4 -> 35.8 ms, 4 rows 40.0 -> 37.1 from 5 to 3; one and two rows (x8_streams_rows)
  // gained nothing there, streaming at the memory's rate, and keep `dot`.
  static constexpr int64_t CHUNK_ROWS = 8;
#ifdef VNNI
  static constexpr int QUARTER_ROWS = 0;  // never
#else
  static constexpr int QUARTER_ROWS = 3;
#endif
  using Int = __m256i;
  using Float = __m256;
  static Int zero_int() { return _mm256_setzero_si256(); }
  static Int add(Int a, Int b) { return _mm256_add_epi32(a, b); }
  static Float zero_float() { return _mm256_setzero_ps(); }
  static Float load_out(const float* p) { return _mm256_loadu_ps(p); }
  static void store_out(float* p, Float v) { _mm256_storeu_ps(p, v); }
};

#ifdef VNNI
// A group of 32 unsigned values of eight rows (v[t]: values 4t..4t + 3 of each row) times
// one row's 32 inputs: each row's exact int32 sum, in two chains (half the latency).
inline __m256i dot32(const __m256i v[8], const int8_t* q) {
  __m256i a = _mm256_setzero_si256(), c = _mm256_setzero_si256();
  for (int t = 0; t < 4; ++t) a = dpbusd_broadcast(a, v[t], q + 4 * t);
  for (int t = 4; t < 8; ++t) c = dpbusd_broadcast(c, v[t], q + 4 * t);
  return _mm256_add_epi32(a, c);
}
#endif

inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// Group g's share (of `groups`) of the lines of a repacked block of `bytes` at p, split
// evenly (a line two shares touch is fetched twice): PREFETCH_SPREAD's prefetches.
inline void prefetch_group_share(const uint8_t* p, int64_t bytes, int64_t groups, int g) {
  const int64_t share = bytes / groups;
  const uintptr_t at = reinterpret_cast<uintptr_t>(p) + g * share;
  const uintptr_t end = g + 1 == groups ? reinterpret_cast<uintptr_t>(p) + bytes : at + share;
  for (uintptr_t line = at & ~uintptr_t{63}; line < end; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}

// Q4_K (repack_q4_k_x8): per block, the eight rows' d and dmin (fp32), their 6-bit scales
// by group of 32 (a byte each, [group][row]), their mins by pair of groups
// ([pair][row][2]), then for each group g and j < 4, 32 bytes: byte 4r + i holds row r's
// value 32g + 8j + i in its low nibble and value 32g + 8j + 4 + i in its high one. A
// group's eight products are added as int16 (at most 8 x 2 x 15 x 127 = 30480) before its
// scale applies.
struct Q4KX8 : Lanes8 {
  static constexpr int64_t BYTES = Q4_K_X8_BYTES, VALUES = QK_K, GROUPS = 8;
  void prefetch(const uint8_t* b) const { prefetch_block(b, BYTES); }
  void prefetch_share(const uint8_t* b, int g) const { prefetch_group_share(b, BYTES, GROUPS, g); }
  const uint8_t* blk;
  __m256 d, dmin;
  __m256i v[8], scale, scale32;

  void load(const uint8_t* b) {
    blk = b;
    d = _mm256_loadu_ps(reinterpret_cast<const float*>(b));
    dmin = _mm256_loadu_ps(reinterpret_cast<const float*>(b + 32));
  }

  void unpack(int g) {
    const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 64 + 8 * g)));
    scale32 = s32;
    scale = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));  // (s, s) per row
    const __m256i low = _mm256_set1_epi8(0xF);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(blk + 192 + 32 * (4 * g + j));
      v[2 * j] = _mm256_and_si256(raw, low);
      v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
  }

#ifndef VNNI
  // AVX2 has 16 vector registers: a whole unpacked group (eight) leaves room for four rows'
  // sums (fewer beside their fp32 lanes), so a pass over five to eight rows unpacked every
  // block twice. dot_rows takes a group a quarter at a time (32 bytes, two vectors) into
  // eight rows' int16 sums at once.
  // The sums are the same integers in another order (no int16 partial sum can overflow, see
  // above), so the output is bitwise the unpack-and-dot path's. Qwen2.5-1.5B's Q4_K_M
  // matrices (0.82 GB, all types), AMD EPYC Zen 4 with the AVX2 build, 2 threads, the two
  // builds interleaved 15 times, median ms: 8 rows 96.4 -> 84.6, 64 rows 647 -> 613. The
  // loops are unrolled by pragma: left to GCC, j stayed a loop counter tested against 0 for
  // every row's first sum, a branch and a register move beside each row's four instructions.
  // Eight layers' gate and up projections, 512 rows, same machine and build, interleaved,
  // sum of each matrix's fastest of 5: 664.6 -> 589.9 ms.
  template <int R, typename Inputs>
  void dot_rows(int g, const Inputs& in, int64_t b, __m256i* sum) const {
    const __m256i s32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 64 + 8 * g)));
    const __m256i pair_scale = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
    const __m256i low = _mm256_set1_epi8(0xF);
    __m256i s16[R];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(blk + 192 + 32 * (4 * g + j));
      const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        const int8_t* q = in.at(m, b, g) + 8 * j;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(q)),
                                           _mm256_maddubs_epi16(hi, broadcast4(q + 4)));
        s16[m] = j == 0 ? p : _mm256_add_epi16(s16[m], p);
        // without it GCC sums all of a row's products at the end, and spills them
        asm("" : "+x"(s16[m]));
      }
    }
    for (int m = 0; m < R; ++m) sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(s16[m], pair_scale));
  }
#endif

  __m256i dot(const int8_t* q) const {
#ifdef VNNI
    return _mm256_mullo_epi32(dot32(v, q), scale32);
#else
    __m256i s16 = _mm256_maddubs_epi16(v[0], broadcast4(q));
    for (int t = 1; t < 8; ++t) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[t], broadcast4(q + 4 * t)));
    return _mm256_madd_epi16(s16, scale);
#endif
  }

  void finish(const Q8Row& x, int64_t b, __m256i sum, __m256& acc) const {
    const int16_t* s32 = x.sums32.data() + b * 8;
    __m256i offset = _mm256_setzero_si256();
    for (int pair = 0; pair < 4; ++pair) {  // mins of groups 2p, 2p + 1 times their inputs' sums
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 128 + 16 * pair)));
      offset = _mm256_add_epi32(offset, _mm256_madd_epi16(mins, broadcast_pair(s32 + 2 * pair)));
    }
    const __m256 dx = _mm256_set1_ps(x.d[b]);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), _mm256_cvtepi32_ps(sum), acc);
    acc = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, dx), _mm256_cvtepi32_ps(offset), acc);
  }
};

// Q6_K (repack_q6_k_x8): per block, the eight rows' d (fp32), their int8 scales by pair of
// groups of 16 ([pair][row][2]), then each group of 32 values in 192 bytes: their low four
// bits laid out as Q4KX8's nibbles, then for each half of the group 32 bytes whose byte
// 4r + i holds the top two bits of row r's values 32g + 16h + 4k + i at bits 2k, 2k + 1.
// Values are 0-63, so two products add as int16 (at most 2 x 2 x 63 x 127 = 32004) before
// a scale applies; the -32 of every value is carried by the scales times the inputs' sums
// of 16. A group's bytes lie together so a block is read front to back, as the hardware
// prefetcher follows best: with the top bits in a second run after all the nibbles, AMD
// EPYC Zen 4 (2 threads) streamed Qwen2.5-1.5B's LM head shape (193 MB of random blocks)
// in 8.1 ms for one row and 10.2 for two, where so it takes 6.1 and 6.5 (a plain read 5.5).
struct Q6KX8 : Lanes8 {
  static constexpr int64_t BYTES = Q6_K_X8_BYTES, VALUES = QK_K, GROUPS = 8;
  void prefetch(const uint8_t* b) const { prefetch_block(b, BYTES); }
  void prefetch_share(const uint8_t* b, int g) const { prefetch_group_share(b, BYTES, GROUPS, g); }
  const uint8_t* blk;
  __m256 d;
  __m256i v[8], first, second, first32, second32;

  void load(const uint8_t* b) {
    blk = b;
    d = _mm256_loadu_ps(reinterpret_cast<const float*>(b));
  }

  // Group g's two int8 scales per row as int16 (first half's, second half's), and each
  // repeated in both halves of every 32-bit lane, as PMADDWD takes them.
  __m256i scale_pairs(int g) const {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * g)));
  }
  static __m256i first_of(__m256i pair) {  // group 2g's (s, s)
    return _mm256_or_si256(_mm256_and_si256(pair, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(pair, 16));
  }
  static __m256i second_of(__m256i pair) {  // group 2g + 1's
    return _mm256_or_si256(_mm256_srli_epi32(pair, 16), _mm256_andnot_si256(_mm256_set1_epi32(0xFFFF), pair));
  }

  void unpack(int g) {
    const __m256i pair = scale_pairs(g);
    first = first_of(pair);
    second = second_of(pair);
    first32 = _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16);
    second32 = _mm256_srai_epi32(pair, 16);
    const __m256i low = _mm256_set1_epi8(0xF), top = _mm256_set1_epi8(0x30);
    for (int half = 0; half < 2; ++half) {
      const __m256i raw0 = load32(blk + 160 + 192 * g + 64 * half);
      const __m256i raw1 = load32(blk + 160 + 192 * g + 64 * half + 32);
      const __m256i high = load32(blk + 288 + 192 * g + 32 * half);
      v[4 * half + 0] = _mm256_or_si256(_mm256_and_si256(raw0, low), _mm256_and_si256(_mm256_slli_epi16(high, 4), top));
      v[4 * half + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), low),
                                        _mm256_and_si256(_mm256_slli_epi16(high, 2), top));
      v[4 * half + 2] = _mm256_or_si256(_mm256_and_si256(raw1, low), _mm256_and_si256(high, top));
      v[4 * half + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), low),
                                        _mm256_and_si256(_mm256_srli_epi16(high, 2), top));
    }
  }

#ifndef VNNI
  // As Q4KX8's: a quarter of a group at a time (two vectors unpacked) leaves AVX2's 16
  // registers room for eight rows' sums, so a pass over three to eight rows unpacks each block
  // once instead of twice and keeps its sums out of memory (`dot`'s unpacked group and
  // scales left four rows' sums no registers, so they lived on the stack). The quarter's
  // products are `dot`'s p[u], scaled as there: the same integers added in another order.
  // Eight layers' down projections (Q6_K), AMD EPYC Zen 4 with the AVX2 build, 2 threads,
  // interleaved, sum of each matrix's fastest of 5: 512 rows 379.0 -> 334.4 ms, 64 rows
  // 43.9 -> 38.3, 8 rows 5.6 -> 4.8.
  template <int R, typename Inputs>
  void dot_rows(int g, const Inputs& in, int64_t b, __m256i* sum) const {
    const __m256i pair = scale_pairs(g);
    const __m256i scales[2] = {first_of(pair), second_of(pair)};
    const __m256i low = _mm256_set1_epi8(0xF), top = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m256i high = load32(blk + 288 + 192 * g + 32 * half);
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) {
        const __m256i raw = load32(blk + 160 + 192 * g + 64 * half + 32 * j);
        const __m256i top0 = j == 0 ? _mm256_slli_epi16(high, 4) : high;
        const __m256i top1 = j == 0 ? _mm256_slli_epi16(high, 2) : _mm256_srli_epi16(high, 2);
        const __m256i v0 = _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_and_si256(top0, top));
        const __m256i v1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), _mm256_and_si256(top1, top));
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) {
          const int8_t* q = in.at(m, b, g) + 16 * half + 8 * j;
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v0, broadcast4(q)), _mm256_maddubs_epi16(v1, broadcast4(q + 4)));
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, scales[half]));
        }
      }
    }
  }
#endif

  __m256i dot(const int8_t* q) const {
#ifdef VNNI
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) lo = dpbusd_broadcast(lo, v[t], q + 4 * t);
    for (int t = 4; t < 8; ++t) hi = dpbusd_broadcast(hi, v[t], q + 4 * t);
    return _mm256_add_epi32(_mm256_mullo_epi32(lo, first32), _mm256_mullo_epi32(hi, second32));
#else
    __m256i p[4];
    for (int u = 0; u < 4; ++u)  // values 8u .. 8u + 7 of the group: two products
      p[u] = _mm256_add_epi16(_mm256_maddubs_epi16(v[2 * u], broadcast4(q + 8 * u)),
                              _mm256_maddubs_epi16(v[2 * u + 1], broadcast4(q + 8 * u + 4)));
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], first), _mm256_madd_epi16(p[1], first)),
                            _mm256_add_epi32(_mm256_madd_epi16(p[2], second), _mm256_madd_epi16(p[3], second)));
#endif
  }

  void finish(const Q8Row& x, int64_t b, __m256i sum, __m256& acc) const {
    const int16_t* s16 = x.sums16.data() + b * 16;
    __m256i offset = _mm256_setzero_si256();
    for (int g = 0; g < 8; ++g) {  // scales of groups 2g, 2g + 1 times their inputs' sums
      const __m256i pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * g)));
      offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pair, broadcast_pair(s16 + 2 * g)));
    }
    const __m256i total = _mm256_sub_epi32(sum, _mm256_slli_epi32(offset, 5));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[b])), _mm256_cvtepi32_ps(total), acc);
  }
};

// The 32-value types repacked eight rows at a time (repack_q8_0_x8, repack_q5_0_x8): a
// block is one group of 32 values of eight rows, with their own fp32 scale each, so every
// block is finished on its own (GROUPS = 1). Rows are quantized per 32 to match.
inline __m256 eight_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Q8_0 x8: the eight rows' d (fp16), then for t < 8, 32 bytes whose byte 4r + i is row r's
// value 4t + i plus 128 (so unsigned, as VPDPBUSD takes its first factor). With VNNI the
// products are of those bytes and 128 x the inputs' sum is taken off; AVX2's PMADDUBSW
// would saturate on them, so it multiplies |w| by the inputs carrying w's sign (a pair
// of products is at most 2 x 127 x 127, int16). Both are the exact sum of w x.
struct Q80X8 : Lanes8 {
  static constexpr int64_t BYTES = Q8_0_X8_BYTES, VALUES = QK8_0, GROUPS = 1;
  void prefetch(const uint8_t* b) const { prefetch_block(b, BYTES); }
  void prefetch_share(const uint8_t* b, int g) const { prefetch_group_share(b, BYTES, GROUPS, g); }
  const uint8_t* blk;
  __m256 d;
  __m256i v[8];
#ifndef VNNI
  __m256i magnitude[8];
#endif

  void load(const uint8_t* b) {
    blk = b;
    d = eight_halves(b);
  }

  void unpack(int) {
    for (int t = 0; t < 8; ++t) {
      v[t] = load32(blk + 16 + 32 * t);
#ifndef VNNI
      v[t] = _mm256_xor_si256(v[t], _mm256_set1_epi8(static_cast<char>(0x80)));  // w, signed
      magnitude[t] = _mm256_abs_epi8(v[t]);
#endif
    }
  }

#ifndef VNNI
  // `unpack` fills all 16 of AVX2's registers (the values and their magnitudes), so `dot`
  // reads them back from memory for every row; here each four values of the eight rows are
  // unpacked once for up to eight rows whose sums stay in registers (the same integers).
  template <int R, typename Inputs>
  void dot_rows(int g, const Inputs& in, int64_t b, __m256i* sum) const {
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const __m256i w = _mm256_xor_si256(load32(blk + 16 + 32 * t), _mm256_set1_epi8(static_cast<char>(0x80)));
      const __m256i magnitude = _mm256_abs_epi8(w);
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m)
        sum[m] = _mm256_add_epi32(
            sum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(in.at(m, b, g) + 4 * t), w)),
                                      ones));
    }
  }
#endif

  __m256i dot(const int8_t* q) const {
#ifdef VNNI
    return dot32(v, q);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sum = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t)
      sum = _mm256_add_epi32(
          sum, _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude[t], _mm256_sign_epi8(broadcast4(q + 4 * t), v[t])), ones));
    return sum;
#endif
  }

  void finish(const Q8Row& x, int64_t b, __m256i sum, __m256& acc) const {
#ifdef VNNI
    sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(128 * x.sums32[b]));
#endif
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[b])), _mm256_cvtepi32_ps(sum), acc);
  }
};

// Q5_0 x8: the eight rows' d (fp16), their values' low four bits laid out as one group of
// Q4KX8's nibbles (128 bytes), then 32 bytes whose byte 4r + i holds the fifth bit of row
// r's value 4k + i at bit k. A value is d * (q - 16), q in 0-31: the -16 is taken off with
// the inputs' sum, and four products add as int16 (at most 4 x 2 x 31 x 127 = 31496).
struct Q50X8 : Lanes8 {
  static constexpr int64_t BYTES = Q5_0_X8_BYTES, VALUES = QK8_0, GROUPS = 1;
  void prefetch(const uint8_t* b) const { prefetch_block(b, BYTES); }
  void prefetch_share(const uint8_t* b, int g) const { prefetch_group_share(b, BYTES, GROUPS, g); }
  const uint8_t* blk;
  __m256 d;
  __m256i v[8];

  void load(const uint8_t* b) {
    blk = b;
    d = eight_halves(b);
  }

  void unpack(int) {
    const __m256i low = _mm256_set1_epi8(0xF);
    const __m256i high = load32(blk + 144);
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(blk + 16 + 32 * j);
      v[2 * j] = _mm256_and_si256(raw, low);
      v[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) v[t] = _mm256_or_si256(v[t], fifth_bits(high, t));
  }

  // Bit t of each byte of `high` (values 4t..4t + 3's fifth bits) at bit 4 of the same byte:
  // 16-bit shifts by at most 4 left or 3 right bring no other byte's bit there.
  static __m256i fifth_bits(__m256i high, int t) {
    const int shift = 4 - t;
    const __m256i moved = shift >= 0 ? _mm256_slli_epi16(high, shift) : _mm256_srli_epi16(high, -shift);
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
  }

#ifndef VNNI
  // As Q80X8's: eight values of the eight rows unpacked at a time, for up to eight rows whose
  // sums stay in registers. Their two products add as int16 and widen at once (`dot` adds
  // four before widening; eight rows' int16 sums would not fit beside the int32 ones): the
  // same integers. Eight layers of Qwen2.5-Coder-0.5B's gate and up projections (Q5_0), AMD
  // EPYC Zen 4 with the AVX2 build, 2 threads, interleaved, sum of each matrix's fastest of
  // 5: 8 rows 4.3 -> 3.6 ms, 512 rows 249.5 -> 223.8.
  template <int R, typename Inputs>
  void dot_rows(int g, const Inputs& in, int64_t b, __m256i* sum) const {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0xF);
    const __m256i high = load32(blk + 144);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i raw = load32(blk + 16 + 32 * j);
      const __m256i v0 = _mm256_or_si256(_mm256_and_si256(raw, low), fifth_bits(high, 2 * j));
      const __m256i v1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), fifth_bits(high, 2 * j + 1));
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        const int8_t* q = in.at(m, b, g) + 8 * j;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(v0, broadcast4(q)), _mm256_maddubs_epi16(v1, broadcast4(q + 4)));
        sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p, ones));
      }
    }
  }
#endif

  __m256i dot(const int8_t* q) const {
#ifdef VNNI
    return dot32(v, q);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s16[2];
    for (int h = 0; h < 2; ++h) {
      s16[h] = _mm256_maddubs_epi16(v[4 * h], broadcast4(q + 16 * h));
      for (int t = 1; t < 4; ++t)
        s16[h] = _mm256_add_epi16(s16[h], _mm256_maddubs_epi16(v[4 * h + t], broadcast4(q + 16 * h + 4 * t)));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(s16[0], ones), _mm256_madd_epi16(s16[1], ones));
#endif
  }

  void finish(const Q8Row& x, int64_t b, __m256i sum, __m256& acc) const {
    sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(16 * x.sums32[b]));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d[b])), _mm256_cvtepi32_ps(sum), acc);
  }
};

#if defined(VNNI) && defined(__AVX512BW__)
#define GROUP_PAIRS 1
// Two adjacent groups of eight rows of weights side by side in 512-bit vectors: each
// instruction applies a row's broadcast inputs to sixteen rows of weights, half the
// instructions per product of the one-group types (whose bytes and lanes these read, the
// first group in the low half). Each lane's operations are the one-group type's, so the
// output is bitwise the same. Pairs read two streams of weights, which costs where a pass
// waits on memory: Q4_K takes them from PAIR_MIN_ROWS rows (AMD EPYC Zen 4, 2 threads,
// 8960 x 1536: 8 rows 0.72 -> 0.39 ms, 64 rows 6.2 -> 3.6 ms; streaming 131 MB, 2 and
// 4 rows were 1.4-2.2x slower, 8 rows 1.1x faster). Q6_K pairs gained nothing in cache
// and lost streaming (its two scale products per group bound it, not instructions).
constexpr int64_t PAIR_MIN_ROWS = 8;
struct Lanes16 {
  static constexpr int64_t CHUNK_ROWS = 8;
  static constexpr int QUARTER_ROWS = 0;
  using Int = __m512i;
  using Float = __m512;
  static Int zero_int() { return _mm512_setzero_si512(); }
  static Int add(Int a, Int b) { return _mm512_add_epi32(a, b); }
  static Float zero_float() { return _mm512_setzero_ps(); }
  static Float load_out(const float* p) { return _mm512_loadu_ps(p); }
  static void store_out(float* p, Float v) { _mm512_storeu_ps(p, v); }
};

inline __m512i load_two32(const uint8_t* a, const uint8_t* b) {  // 32 bytes at a, then 32 at b
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(a)), load32(b), 1);
}
inline __m256i load_two16(const uint8_t* a, const uint8_t* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
inline __m128i load_two8(const uint8_t* a, const uint8_t* b) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
}
inline __m512 load_two_ps(const uint8_t* a, const uint8_t* b) {
  return _mm512_castsi512_ps(load_two32(a, b));
}
inline __m512i broadcast_pair_512(const int16_t* p) {
  int32_t two;
  std::memcpy(&two, p, 4);
  return _mm512_set1_epi32(two);
}

struct Q4KPair : Lanes16 {
  static constexpr int64_t BYTES = Q4_K_X8_BYTES, VALUES = QK_K, GROUPS = 8;  // a block of one group
  int64_t stride = 0;  // bytes from a block of the first group to the second's
  const uint8_t* blk;
  __m512 d, dmin;
  __m512i v[8], scale32;

  void prefetch(const uint8_t* b) const {
    prefetch_block(b, BYTES);
    prefetch_block(b + stride, BYTES);
  }
  void prefetch_share(const uint8_t* b, int g) const {
    prefetch_group_share(b, BYTES, GROUPS, g);
    prefetch_group_share(b + stride, BYTES, GROUPS, g);
  }

  void load(const uint8_t* b) {
    blk = b;
    d = load_two_ps(b, b + stride);
    dmin = load_two_ps(b + 32, b + stride + 32);
  }

  void unpack(int g) {
    scale32 = _mm512_cvtepu8_epi32(load_two8(blk + 64 + 8 * g, blk + stride + 64 + 8 * g));
    const __m512i low = _mm512_set1_epi8(0xF);
    for (int j = 0; j < 4; ++j) {
      const int64_t at = 192 + 32 * (4 * g + j);
      const __m512i raw = load_two32(blk + at, blk + stride + at);
      v[2 * j] = _mm512_and_si512(raw, low);
      v[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
  }

  __m512i dot(const int8_t* q) const {
    __m512i a = _mm512_setzero_si512(), c = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) a = dpbusd_broadcast(a, v[t], q + 4 * t);
    for (int t = 4; t < 8; ++t) c = dpbusd_broadcast(c, v[t], q + 4 * t);
    return _mm512_mullo_epi32(_mm512_add_epi32(a, c), scale32);
  }

  void finish(const Q8Row& x, int64_t b, __m512i sum, __m512& acc) const {
    const int16_t* s32 = x.sums32.data() + b * 8;
    __m512i offset = _mm512_setzero_si512();
    for (int pair = 0; pair < 4; ++pair) {
      const __m512i mins = _mm512_cvtepu8_epi16(load_two16(blk + 128 + 16 * pair, blk + stride + 128 + 16 * pair));
      offset = _mm512_add_epi32(offset, _mm512_madd_epi16(mins, broadcast_pair_512(s32 + 2 * pair)));
    }
    const __m512 dx = _mm512_set1_ps(x.d[b]);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sum), acc);
    acc = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(offset), acc);
  }

  // `finish` for rows [0, M) of a block at once (amx_pair), the mins decoded once for all.
  void finish_rows(const Q8Row* x, int64_t b, const __m512i* sum, __m512* acc, int64_t M) const {
    __m512i mins[4];
    for (int pair = 0; pair < 4; ++pair)
      mins[pair] = _mm512_cvtepu8_epi16(load_two16(blk + 128 + 16 * pair, blk + stride + 128 + 16 * pair));
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* s32 = x[m].sums32.data() + b * 8;
      __m512i offset = _mm512_setzero_si512();
      for (int pair = 0; pair < 4; ++pair)
        offset = _mm512_add_epi32(offset, _mm512_madd_epi16(mins[pair], broadcast_pair_512(s32 + 2 * pair)));
      const __m512 dx = _mm512_set1_ps(x[m].d[b]);
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(sum[m]), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, dx), _mm512_cvtepi32_ps(offset), acc[m]);
    }
  }
};

// Q6KX8's two groups side by side, as Q4KPair is Q4KX8's. On AMD EPYC Zen 4 it gained
// nothing (above); on Intel Xeon, whose 512-bit units are whole, eight rows' pass over
// Qwen2.5-1.5B's layer shapes (0.78 GB of Q6_K, 2 threads) took 53.5 ms in eight-row
// groups, 52.7 ms in pairs; the AMX build takes pairs at any number of rows (the down
// projections of those shapes, 0.32 GB, one row, both prefetched as on Zen 4: 14.4 ms in
// eight-row groups, 12.5 in pairs), and amx_scaled unpacks with them (10-15% faster than
// two eight-row groups from 12 rows on).
struct Q6KPair : Lanes16 {
  static constexpr int64_t BYTES = Q6_K_X8_BYTES, VALUES = QK_K, GROUPS = 8;
  int64_t stride = 0;  // bytes from a block of the first group to the second's
  const uint8_t* blk;
  __m512 d;
  __m512i v[8], first32, second32;

  void prefetch(const uint8_t* b) const {
    prefetch_block(b, BYTES);
    prefetch_block(b + stride, BYTES);
  }
  void prefetch_share(const uint8_t* b, int g) const {
    prefetch_group_share(b, BYTES, GROUPS, g);
    prefetch_group_share(b + stride, BYTES, GROUPS, g);
  }

  void load(const uint8_t* b) {
    blk = b;
    d = load_two_ps(b, b + stride);
  }

  __m512i scales(int g) const {  // per row, (first half's, second half's) as int16
    return _mm512_cvtepi8_epi16(load_two16(blk + 32 + 16 * g, blk + stride + 32 + 16 * g));
  }

  void unpack(int g) {
    const __m512i pair = scales(g);
    first32 = _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
    second32 = _mm512_srai_epi32(pair, 16);
    const __m512i low = _mm512_set1_epi8(0xF), top = _mm512_set1_epi8(0x30);
    for (int half = 0; half < 2; ++half) {
      const int64_t at0 = 160 + 192 * g + 64 * half, at1 = at0 + 32, at_high = 288 + 192 * g + 32 * half;
      const __m512i raw0 = load_two32(blk + at0, blk + stride + at0);
      const __m512i raw1 = load_two32(blk + at1, blk + stride + at1);
      const __m512i high = load_two32(blk + at_high, blk + stride + at_high);
      v[4 * half + 0] = _mm512_or_si512(_mm512_and_si512(raw0, low), _mm512_and_si512(_mm512_slli_epi16(high, 4), top));
      v[4 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw0, 4), low),
                                        _mm512_and_si512(_mm512_slli_epi16(high, 2), top));
      v[4 * half + 2] = _mm512_or_si512(_mm512_and_si512(raw1, low), _mm512_and_si512(high, top));
      v[4 * half + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw1, 4), low),
                                        _mm512_and_si512(_mm512_srli_epi16(high, 2), top));
    }
  }

  __m512i dot(const int8_t* q) const {
    __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
    for (int t = 0; t < 4; ++t) lo = dpbusd_broadcast(lo, v[t], q + 4 * t);
    for (int t = 4; t < 8; ++t) hi = dpbusd_broadcast(hi, v[t], q + 4 * t);
    return _mm512_add_epi32(_mm512_mullo_epi32(lo, first32), _mm512_mullo_epi32(hi, second32));
  }

  void finish(const Q8Row& x, int64_t b, __m512i sum, __m512& acc) const { finish_rows(&x, b, &sum, &acc, 1); }

  // Q6KX8's finish for rows [0, M) of a block, its scales decoded once for all.
  void finish_rows(const Q8Row* x, int64_t b, const __m512i* sum, __m512* acc, int64_t M) const {
    __m512i pairs[8];
    for (int g = 0; g < 8; ++g) pairs[g] = scales(g);
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* s16 = x[m].sums16.data() + b * 16;
      __m512i offset = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) offset = _mm512_add_epi32(offset, _mm512_madd_epi16(pairs[g], broadcast_pair_512(s16 + 2 * g)));
      const __m512i total = _mm512_sub_epi32(sum[m], _mm512_slli_epi32(offset, 5));
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[m].d[b])), _mm512_cvtepi32_ps(total), acc[m]);
    }
  }
};
#endif

// Where a row's 32 inputs of group g of block b lie: in the row itself, or in a tile's
// packed copy (pack_rows).
struct RowInputs {
  const Q8Row* x;
  int64_t values;  // per block
  const int8_t* at(int64_t m, int64_t b, int g) const { return x[m].q.data() + b * values + 32 * g; }
  RowInputs from(int64_t m0) const { return {x + m0, values}; }
};
// A tile's inputs packed from block b0 on, in one of two layouts (pack_rows): by group,
// [block - b0][group of 32][row][32], so VNNI's inner loop over rows reads them front to
// back; or by row, [block - b0][row][values], each row's block one row of an AMX tile.
struct PackedInputs {
  const int8_t* packed;  // at row 0 of the tile
  int64_t b0, block_bytes, row_bytes, group_bytes;  // bytes from one block, row, group to the next
  static PackedInputs by_group(const int8_t* packed, int64_t tile_rows, int64_t b0, int64_t values) {
    return {packed, b0, tile_rows * values, 32, tile_rows * 32};
  }
  static PackedInputs by_row(const int8_t* packed, int64_t tile_rows, int64_t b0, int64_t values) {
    return {packed, b0, tile_rows * values, values, 32};
  }
  const int8_t* at(int64_t m, int64_t b, int g) const {
    return packed + (b - b0) * block_bytes + m * row_bytes + g * group_bytes;
  }
  PackedInputs from(int64_t m0) const { return {packed + m0 * row_bytes, b0, block_bytes, row_bytes, group_bytes}; }
};

// Rows [0, R) of x times one group of eight rows of weights (`base`: its blocks) over
// blocks [b0, b1), prefetching each block `prefetch_blocks` ahead of the one multiplied (none when
// negative):
// out[m * ldo + r] (fp32, exact) carries the eight lanes in from the
// previous range of blocks (b0 > 0) and out to the next. R is fixed at compile time so
// the block's unpacked values and every row's sums stay in registers. Each row's sums
// and their finishing are the same operations in the same order for any R, any chunking
// of rows and any range of blocks: a row's output is bitwise what one row alone gives.
template <typename Block, int R, typename Inputs>
void x8_group_rows(const Block& kind, const uint8_t* base, int64_t b0, int64_t b1, const Q8Row* x, Inputs in,
                   float* out, int64_t ldo, int64_t prefetch_blocks) {
  typename Block::Float acc[R];
  typename Block::Int sum[R];
  for (int m = 0; m < R; ++m) acc[m] = b0 == 0 ? Block::zero_float() : Block::load_out(out + m * ldo);
  Block block = kind;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = base + b * Block::BYTES;
    if constexpr (!PREFETCH_SPREAD) if (prefetch_blocks >= 0) block.prefetch(blk + prefetch_blocks * Block::BYTES);
    block.load(blk);
    for (int m = 0; m < R; ++m) sum[m] = Block::zero_int();
    for (int g = 0; g < Block::GROUPS; ++g) {
      if constexpr (PREFETCH_SPREAD) if (prefetch_blocks >= 0) block.prefetch_share(blk + prefetch_blocks * Block::BYTES, g);
      if constexpr (Block::QUARTER_ROWS > 0 && R >= Block::QUARTER_ROWS) {
        block.template dot_rows<R>(g, in, b, sum);
      } else {
        block.unpack(g);
        for (int m = 0; m < R; ++m) sum[m] = Block::add(sum[m], block.dot(in.at(m, b, g)));
      }
    }
    for (int m = 0; m < R; ++m) block.finish(x[m], b, sum[m], acc[m]);
  }
  for (int m = 0; m < R; ++m) Block::store_out(out + m * ldo, acc[m]);
}

// S groups of eight rows of weights (`bases`) times rows [0, R) of x over all `blocks`,
// block by block, the groups in turn: each group's operations are x8_group_rows', in the
// same order, so its outputs are bitwise the same, while the S streams of weights are read
// side by side (WEIGHT_STREAMS).
template <typename Block, int R, int S, typename Inputs>
void x8_streams_rows(const uint8_t* const* bases, int64_t blocks, const Q8Row* x, Inputs in, float* const* outs,
                     int64_t ldo, int64_t prefetch_blocks) {
  typename Block::Float acc[S][R];
  typename Block::Int sum[R];
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < R; ++m) acc[s][m] = Block::zero_float();
  Block block{};
  for (int64_t b = 0; b < blocks; ++b) {
    for (int s = 0; s < S; ++s) {
      const uint8_t* blk = bases[s] + b * Block::BYTES;
      if constexpr (!PREFETCH_SPREAD) block.prefetch(blk + prefetch_blocks * Block::BYTES);
      block.load(blk);
      for (int m = 0; m < R; ++m) sum[m] = Block::zero_int();
      for (int g = 0; g < Block::GROUPS; ++g) {
        if constexpr (PREFETCH_SPREAD) block.prefetch_share(blk + prefetch_blocks * Block::BYTES, g);
        block.unpack(g);
        for (int m = 0; m < R; ++m) sum[m] = Block::add(sum[m], block.dot(in.at(m, b, g)));
      }
      for (int m = 0; m < R; ++m) block.finish(x[m], b, sum[m], acc[s][m]);
    }
  }
  for (int s = 0; s < S; ++s)
    for (int m = 0; m < R; ++m) Block::store_out(outs[s] + m * ldo, acc[s][m]);
}

// Groups [group, g1) of eight rows of weights times rows [0, M <= STREAM_ROWS) of x over all
// `blocks`, WEIGHT_STREAMS at a time: the range is cut into that many runs far apart, read
// side by side. Returns the first group left over (fewer than WEIGHT_STREAMS).
template <typename Block, typename Inputs>
int64_t x8_streams(const uint8_t* w, int64_t blocks, int64_t group, int64_t g1, const Q8Row* x, int64_t M, Inputs in,
                   float* out, int64_t ldo, int64_t prefetch_blocks) {
  constexpr int S = WEIGHT_STREAMS;
  const int64_t group_bytes = blocks * Block::BYTES, run = (g1 - group) / S;
  for (int64_t j = 0; j < run; ++j) {
    const uint8_t* bases[S];
    float* outs[S];
    for (int s = 0; s < S; ++s) {
      bases[s] = w + (group + s * run + j) * group_bytes;
      outs[s] = out + 8 * (group + s * run + j);
    }
    if (M == 1) x8_streams_rows<Block, 1, S>(bases, blocks, x, in, outs, ldo, prefetch_blocks);
    else x8_streams_rows<Block, 2, S>(bases, blocks, x, in, outs, ldo, prefetch_blocks);
  }
  return group + S * run;
}

// Rows [0, M) of x, CHUNK_ROWS at a time, times one group of eight rows of weights over
// blocks [b0, b1) (see x8_group_rows). The group's weights (1-7 KB a block range) stay in
// cache from one chunk of rows to the next.
template <typename Block, typename Inputs>
void x8_group(const Block& kind, const uint8_t* base, int64_t b0, int64_t b1, const Q8Row* x, int64_t M, Inputs in,
              float* out, int64_t ldo, int64_t prefetch_blocks) {
  for (int64_t m0 = 0; m0 < M; m0 += Block::CHUNK_ROWS) {
    const Inputs chunk = in.from(m0);
    const Q8Row* xc = x + m0;
    float* oc = out + m0 * ldo;
    // the first chunk of rows brings the group's weights in; the later ones find them in cache,
    // and their prefetches would only take instructions
    const int64_t ahead = m0 == 0 ? prefetch_blocks : -1;
    switch (std::min(Block::CHUNK_ROWS, M - m0)) {
      case 1: x8_group_rows<Block, 1>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
      case 2: x8_group_rows<Block, 2>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
      case 3: x8_group_rows<Block, 3>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
      case 4: x8_group_rows<Block, 4>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
      case 5: x8_group_rows<Block, 5>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
      case 6: x8_group_rows<Block, 6>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
      case 7: x8_group_rows<Block, 7>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
      case 8: x8_group_rows<Block, 8>(kind, base, b0, b1, xc, chunk, oc, ldo, ahead); break;
    }
  }
}

// Groups [g0, g1) of eight rows of weights (`w`: each group's `blocks` blocks in turn)
// times rows [0, M) of x over blocks [b0, b1): out[m * ldo + 8 * group + r]. With AVX-512,
// two adjacent groups at a time: Q4_K where the call has at least PAIR_MIN_ROWS rows, Q6_K
// on AMX builds at any number; with AVX2, WEIGHT_STREAMS groups side by side for one or two rows.
template <typename Block, typename Inputs>
void x8_groups(const uint8_t* w, int64_t blocks, int64_t g0, int64_t g1, int64_t b0, int64_t b1, const Q8Row* x,
               int64_t M, Inputs in, float* out, int64_t ldo, int64_t prefetch_blocks) {
  const int64_t group_bytes = blocks * Block::BYTES;
  int64_t group = g0;
#ifdef GROUP_PAIRS
  if constexpr (std::is_same_v<Block, Q4KX8>) {
    if (M >= PAIR_MIN_ROWS) {
      Q4KPair pair;
      pair.stride = group_bytes;
      for (; group + 1 < g1; group += 2)
        x8_group(pair, w + group * group_bytes, b0, b1, x, M, in, out + 8 * group, ldo, prefetch_blocks);
    }
  }
#endif
#if defined(GROUP_PAIRS) && defined(__AMX_INT8__)
  if constexpr (std::is_same_v<Block, Q6KX8>) {  // any number of rows (Q6KPair)
    Q6KPair pair;
    pair.stride = group_bytes;
    for (; group + 1 < g1; group += 2)
      x8_group(pair, w + group * group_bytes, b0, b1, x, M, in, out + 8 * group, ldo, prefetch_blocks);
  }
#endif
  if constexpr (WEIGHT_STREAMS > 1) {
    if (M <= STREAM_ROWS && b0 == 0 && b1 == blocks)
      group = x8_streams<Block>(w, blocks, group, g1, x, M, in, out, ldo, prefetch_blocks);
  }
  for (; group < g1; ++group)
    x8_group(Block{}, w + group * group_bytes, b0, b1, x, M, in, out + 8 * group, ldo, prefetch_blocks);
}

#ifdef AMX_INT8
// Fewer rows wait on memory, where unpacking into tiles only adds work. With their scales in
// the weights (amx_scaled) Q4_K pays from four rows and Q6_K from ten, the types whose tile
// products are scaled one by one (amx_pair) from 12. Qwen2.5-1.5B's layer shapes in random
// blocks (0.78 GB of Q4_K, 0.78 of Q6_K), Intel Xeon with AMX, 2 threads, VNNI against AMX,
// ms: Q4_K 2 rows 40.0 / 39.8, 4 rows 45.8 / 41.5, 8 rows 49.3 / 46.4, 16 rows 82.4 / 56.3,
// 64 rows 279 / 148; Q6_K 4 rows 46.6 / 50.0, 8 rows 52.7 / 53.9, 10 rows 67.7 / 55.1,
// 16 rows 90.1 / 63.6, 64 rows 324 / 155. One row: 34.5-37.4 either.
template <typename Block>
constexpr int64_t amx_min_rows() {
  return std::is_same_v<Block, Q4KX8> ? 4 : std::is_same_v<Block, Q6KX8> ? 10 : 12;
}
#endif

// Blocks ahead of the one multiplied that a pass over `rows` rows of repacked blocks
// prefetches. On Intel Xeon with AMX the few-row distance of AMD EPYC Zen 4 (zero, above)
// leaves the stream short of lines in flight: one block ahead serves a pass over few rows
// better, and Q6_K (in pairs of groups there, 3.4 KB a step) at any number of rows.
// Qwen2.5-1.5B's layer shapes in random blocks (28 layers, Q6_K down projections, 0.87 GB),
// 2 threads, zero/six blocks ahead (Q6_K in eight-row groups) against one (Q6_K in pairs),
// interleaved in one run, ms: 1 row 38.7 / 33.3, 2 rows 43.7 / 36.4, 3 rows 47.5 / 40.3;
// Q6_K in pairs, six blocks ahead against one, the down projections alone: 5 rows 18.2 /
// 14.8, 8 rows 21.3 / 19.7, 12 rows (AMX) 24.0 / 20.9, 16 rows 26.1 / 23.1. Q4_K's AMX
// products lose one ahead (gate and up at 12 rows 27.6 / 30.6).
template <typename Block>
int64_t prefetch_ahead(int64_t rows) {
#ifdef AMX_INT8
  if constexpr (std::is_same_v<Block, Q6KX8>) return 1;
  if constexpr (std::is_same_v<Block, Q4KX8>) return rows < amx_min_rows<Block>() ? 1 : PREFETCH_X8_ROWS;
#endif
  return rows <= FEW_ROWS ? PREFETCH_X8_FEW_ROWS : PREFETCH_X8_ROWS;
}

// out[m * ldo + 8 * group + r] for groups [g0, g1) of eight rows of `w` (repacked) times
// activation row m, over all blocks.
template <typename Block>
void x8_rows_times(const uint8_t* w, int64_t blocks, Rows x, int64_t g0, int64_t g1, float* out, int64_t ldo) {
  x8_groups<Block>(w, blocks, g0, g1, 0, blocks, x.data(), x.count, RowInputs{x.data(), Block::VALUES}, out, ldo,
                   prefetch_ahead<Block>(x.count));
}

// out[m * ldo + n] = row n of `w` (rows [n0, n1)) times activation row m, blocks summed in
// order. ROWS > 0 fixes the row count at compile time, so the unpacked block stays in
// registers (a one-row pass is a decoding step: it must run at memory speed); 0 takes any.
template <typename Block, int ROWS>
void rows_times(const uint8_t* w, int64_t blocks, Rows x, int64_t n0, int64_t n1, float* out,
                int64_t ldo) {
  const int64_t M = ROWS > 0 ? ROWS : static_cast<int64_t>(x.size());
  std::vector<__m256> acc(M);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * blocks * Block::BYTES;
    if (ROWS > 0) {
      __m256 fixed[ROWS > 0 ? ROWS : 1];
      for (int m = 0; m < ROWS; ++m) fixed[m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(row + (b + PREFETCH_BLOCKS) * Block::BYTES), _MM_HINT_T0);
        Block block;
        block.unpack(row + b * Block::BYTES);
        for (int m = 0; m < ROWS; ++m) block.dot(x[m], b, fixed[m]);
      }
      for (int m = 0; m < ROWS; ++m) out[m * ldo + n] = hsum(fixed[m]);
      continue;
    }
    std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
    Block block;
    for (int64_t b = 0; b < blocks; ++b) {
      _mm_prefetch(reinterpret_cast<const char*>(row + (b + PREFETCH_BLOCKS) * Block::BYTES), _MM_HINT_T0);
      block.unpack(row + b * Block::BYTES);
      for (int64_t m = 0; m < M; ++m) block.dot(x[m], b, acc[m]);
    }
    for (int64_t m = 0; m < M; ++m) out[m * ldo + n] = hsum(acc[m]);
  }
}

// The inputs of rows x[0, mt) over blocks [b0, b1) copied where `to` reads them; rows
// mt..tile_rows - 1 zero (AMX's tiles read whole tiles of rows).
void pack_rows(const Q8Row* x, int64_t mt, int64_t tile_rows, int64_t values, int64_t b0, int64_t b1,
               const PackedInputs& to) {
  for (int64_t b = b0; b < b1; ++b)
    for (int g = 0; g < values / 32; ++g)
      for (int64_t m = 0; m < tile_rows; ++m) {
        int8_t* at = const_cast<int8_t*>(to.at(m, b, g));
        if (m < mt) std::memcpy(at, x[m].q.data() + b * values + 32 * g, 32);
        else std::memset(at, 0, 32);
      }
}

// A kernel for this many rows: one and two specialized as stored (a decoding step, a short
// draft); repacked blocks take any number in register-sized chunks.
template <typename Block, bool REPACKED>
void rows_times_any(const uint8_t* w, int64_t blocks, Rows x, int64_t n0, int64_t n1, float* out,
                    int64_t ldo) {
  if constexpr (REPACKED) {  // n0, n1 count groups of eight rows
    return x8_rows_times<Block>(w, blocks, x, n0, n1, out, ldo);
  } else {
    switch (x.size()) {
      case 1: return rows_times<Block, 1>(w, blocks, x, n0, n1, out, ldo);
      case 2: return rows_times<Block, 2>(w, blocks, x, n0, n1, out, ldo);
      default: return rows_times<Block, 0>(w, blocks, x, n0, n1, out, ldo);
    }
  }
}

#ifdef AMX_INT8
// Passes over several rows on Intel AMX. Two adjacent groups of eight rows of weights are
// the 16 columns of a tile (Q4KPair's lanes): TDPBSUD multiplies up to 16 rows of inputs by
// all 16 in one instruction, where VNNI takes a VPDPBUSD per row and four values. Each
// column's sum is the exact int32 VNNI's chain gives; the sums take the block type's scales
// in integers and are finished by the eight-row type's fp32 operations, lane for lane, so
// every row's output is bitwise what the one-row product gives.
constexpr int64_t AMX_TILE_ROWS = 16;  // rows of inputs per tile product

// Tiles 0-1: C (rows x 16 int32); 2-3: A (rows x `depth` bytes of inputs); 4-7: B (depth / 4
// rows x 16 columns x 4 bytes of weights). Two of each, so one product's loads overlap
// the previous product.
void amx_configure(int rows, int depth) {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) cfg.tile(t, rows, 64).tile(2 + t, rows, depth);
  for (int t = 4; t < 8; ++t) cfg.tile(t, depth / 4, 64);
  cfg.load();
}

// Rows in a packed tile of inputs for a pass of M rows: M where one tile takes them all,
// else whole tiles of 16 (the rows past M zero).
inline int64_t amx_stride_rows(int64_t M) {
  return M <= AMX_TILE_ROWS ? M : (M + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS * AMX_TILE_ROWS;
}

// Two adjacent groups of eight rows of weights as one of sixteen, for amx_pair: each
// group's block type side by side, each half finished by its own type.
template <typename Block>
struct TwoGroups {
  static constexpr int64_t BYTES = Block::BYTES;
  int64_t stride = 0;  // bytes from a block of the first group to the second's
  Block a{}, b{};
  __m512i v[8];

  void prefetch(const uint8_t* p) const {
    a.prefetch(p);
    b.prefetch(p + stride);
  }
  void load(const uint8_t* p) {
    a.load(p);
    b.load(p + stride);
  }
  void unpack(int g) {
    a.unpack(g);
    b.unpack(g);
    for (int t = 0; t < 8; ++t) v[t] = _mm512_inserti64x4(_mm512_castsi256_si512(a.v[t]), b.v[t], 1);
  }
  void finish(const Q8Row& x, int64_t blk, __m512i sum, __m512& acc) const {
    __m256 lo = _mm512_castps512_ps256(acc), hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    a.finish(x, blk, _mm512_castsi512_si256(sum), lo);
    b.finish(x, blk, _mm512_extracti64x4_epi64(sum, 1), hi);
    acc = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
  }
  void finish_rows(const Q8Row* x, int64_t blk, const __m512i* sum, __m512* acc, int64_t M) const {
    for (int64_t m = 0; m < M; ++m) finish(x[m], blk, sum[m], acc[m]);
  }
};

// Rows [0, M) of x (M <= TILE_ROWS; inputs packed by row) times a pair of groups of weights
// of a type of 32 values a block, finished unscaled (Q8_0, Q5_0; `w`: the first group's
// blocks, pair.stride to the second's) over blocks [b0, b1), into out[m * ldo + r] for the
// 16 rows r, carrying the lanes across ranges of blocks as x8_group_rows does: one tile
// product a block. Tiles configured for min(M, 16) rows, 32 deep.
template <typename Pair>
void amx_pair(Pair pair, const uint8_t* w, int64_t b0, int64_t b1, const Q8Row* x, int64_t M, PackedInputs in,
              float* out, int64_t ldo, int64_t prefetch_blocks) {
  alignas(64) uint8_t weights[8 * 64];  // B: row t, values 4t..4t + 3 of the 16 rows of weights
  alignas(64) int32_t c[AMX_TILE_ROWS * 16];
  __m512 acc[TILE_ROWS];
  __m512i sum[TILE_ROWS];
  for (int64_t m = 0; m < M; ++m) acc[m] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + m * ldo);
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* p = w + blk * Pair::BYTES;
    pair.prefetch(p + prefetch_blocks * Pair::BYTES);
    pair.load(p);
    pair.unpack(0);
    for (int t = 0; t < 8; ++t) _mm512_store_si512(weights + 64 * t, pair.v[t]);
    for (int64_t m0 = 0; m0 < M; m0 += AMX_TILE_ROWS) {
      _tile_loadd(2, in.at(m0, blk, 0), in.row_bytes);
      _tile_loadd(4, weights, 64);
      _tile_zero(0);
      _tile_dpbsud(0, 2, 4);
      _tile_stored(0, c, 64);
      for (int64_t r = 0; r < std::min(AMX_TILE_ROWS, M - m0); ++r) sum[m0 + r] = _mm512_load_si512(c + 16 * r);
    }
    pair.finish_rows(x, blk, sum, acc, M);
  }
  for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

// The types whose scales go into the weights (amx_scaled): each value q of a pair's group
// g times its scale s as two bytes, `low` (unsigned) and `high` (signed), the B tiles of its
// 32 values, with q s = low + high << HIGH_SHIFT.
//
// Q4_K: 6-bit scales, s = l + 16 h (l < 16, h < 4): q l <= 225 and q h <= 45. A VPMULLW
// makes both bytes of a 16-bit lane at once (neither product carries into the other).
inline void scaled_bytes(const Q4KPair& pair, uint8_t* low, uint8_t* high) {
  const __m512i s = _mm512_or_si512(pair.scale32, _mm512_slli_epi32(pair.scale32, 16));  // (s, s) per column
  const __m512i l = _mm512_and_si512(s, _mm512_set1_epi16(0xF)), h = _mm512_srli_epi16(s, 4);
  for (int t = 0; t < 8; ++t) {
    _mm512_store_si512(low + 64 * t, _mm512_mullo_epi16(pair.v[t], l));
    _mm512_store_si512(high + 64 * t, _mm512_mullo_epi16(pair.v[t], h));
  }
}

// Q6_K: int8 scales per 16 values, q < 64: q s fits 16 bits, split into its low byte and
// its (signed) high byte, for even and odd bytes apart.
inline void scaled_bytes(const Q6KPair& pair, uint8_t* low, uint8_t* high) {
  const __m512i byte = _mm512_set1_epi16(0xFF);
  for (int half = 0; half < 2; ++half) {
    const __m512i s32 = half == 0 ? pair.first32 : pair.second32;
    const __m512i s = _mm512_or_si512(_mm512_and_si512(s32, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s32, 16));
    for (int t = 4 * half; t < 4 * half + 4; ++t) {
      const __m512i even = _mm512_mullo_epi16(_mm512_and_si512(pair.v[t], byte), s);
      const __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(pair.v[t], 8), s);
      _mm512_store_si512(low + 64 * t, _mm512_or_si512(_mm512_and_si512(even, byte), _mm512_slli_epi16(odd, 8)));
      _mm512_store_si512(high + 64 * t, _mm512_or_si512(_mm512_srli_epi16(even, 8), _mm512_andnot_si512(byte, odd)));
    }
  }
}

// The shift of the high bytes' products: 4 for Q4_K (s = l + 16 h), 8 for Q6_K (a byte).
template <typename Pair>
constexpr int HIGH_SHIFT = std::is_same_v<Pair, Q4KPair> ? 4 : 8;

// amx_pair for the types whose scales go into the weights (scaled_bytes): a block's 256
// values are four tile products of 64 (two groups), accumulated in two tiles (the low and
// the high bytes) and stored once per block, instead of a product stored and scaled per group.
// C_low + C_high << HIGH_SHIFT is the integer VNNI's chain gives.
template <typename Pair>
void amx_scaled(Pair pair, const uint8_t* w, int64_t b0, int64_t b1, const Q8Row* x, int64_t M, PackedInputs in,
                float* out, int64_t ldo, int64_t prefetch_blocks) {
  constexpr int STEPS = QK_K / 64;
  alignas(64) uint8_t low[STEPS][16 * 64], high[STEPS][16 * 64];  // B tiles: row t, values 4t..4t + 3
  alignas(64) int32_t c[2][AMX_TILE_ROWS * 16];
  __m512 acc[TILE_ROWS];
  __m512i sum[TILE_ROWS];
  const int64_t stride = in.row_bytes;
  for (int64_t m = 0; m < M; ++m) acc[m] = b0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(out + m * ldo);
  for (int64_t blk = b0; blk < b1; ++blk) {
    const uint8_t* p = w + blk * Pair::BYTES;
    pair.prefetch(p + prefetch_blocks * Pair::BYTES);
    pair.load(p);
    for (int g = 0; g < Pair::GROUPS; ++g) {
      pair.unpack(g);
      scaled_bytes(pair, low[g / 2] + (g % 2) * 8 * 64, high[g / 2] + (g % 2) * 8 * 64);
    }
    for (int64_t m0 = 0; m0 < M; m0 += AMX_TILE_ROWS) {
      _tile_zero(0);
      _tile_zero(1);
      for (int j = 0; j < STEPS; j += 2) {  // alternate tiles: a step's loads overlap the last products
        const int8_t* q = in.at(m0, blk, 2 * j);
        _tile_loadd(2, q, stride); _tile_loadd(4, low[j], 64); _tile_loadd(5, high[j], 64);
        _tile_dpbsud(0, 2, 4); _tile_dpbssd(1, 2, 5);
        _tile_loadd(3, q + 64, stride); _tile_loadd(6, low[j + 1], 64); _tile_loadd(7, high[j + 1], 64);
        _tile_dpbsud(0, 3, 6); _tile_dpbssd(1, 3, 7);
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      const int64_t rows = std::min(AMX_TILE_ROWS, M - m0);
      for (int64_t r = 0; r < rows; ++r)
        sum[m0 + r] = _mm512_add_epi32(_mm512_load_si512(c[0] + 16 * r),
                                       _mm512_slli_epi32(_mm512_load_si512(c[1] + 16 * r), HIGH_SHIFT<Pair>));
    }
    pair.finish_rows(x, blk, sum, acc, M);
  }
  for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

// Groups [g0, g1) of eight rows of weights times rows [0, M) over blocks [b0, b1), as
// x8_groups: pairs of groups on AMX, an odd last group on VNNI (the same output).
template <typename Block>
void amx_groups(const uint8_t* w, int64_t blocks, int64_t g0, int64_t g1, int64_t b0, int64_t b1, const Q8Row* x,
                int64_t M, PackedInputs in, float* out, int64_t ldo, int64_t prefetch_blocks) {
  const int64_t group_bytes = blocks * Block::BYTES;
  const int rows = static_cast<int>(std::min(M, AMX_TILE_ROWS));
  int64_t group = g0;
  if (group + 1 < g1) {
    if constexpr (std::is_same_v<Block, Q4KX8> || std::is_same_v<Block, Q6KX8>) {
      std::conditional_t<std::is_same_v<Block, Q4KX8>, Q4KPair, Q6KPair> pair;
      pair.stride = group_bytes;
      amx_configure(rows, 64);
      for (; group + 1 < g1; group += 2)
        amx_scaled(pair, w + group * group_bytes, b0, b1, x, M, in, out + 8 * group, ldo, prefetch_blocks);
    } else {
      TwoGroups<Block> pair;
      pair.stride = group_bytes;
      static_assert(Block::GROUPS == 1, "amx_pair: one group of 32 values a block");
      amx_configure(rows, 32);
      for (; group + 1 < g1; group += 2)
        amx_pair(pair, w + group * group_bytes, b0, b1, x, M, in, out + 8 * group, ldo, prefetch_blocks);
    }
    _tile_release();
  }
  if constexpr (WEIGHT_STREAMS > 1) {
    if (M <= STREAM_ROWS && b0 == 0 && b1 == blocks)
      group = x8_streams<Block>(w, blocks, group, g1, x, M, in, out, ldo, prefetch_blocks);
  }
  for (; group < g1; ++group)
    x8_group(Block{}, w + group * group_bytes, b0, b1, x, M, in, out + 8 * group, ldo, prefetch_blocks);
}

// A repacked part times rows x (amx_min_rows <= M < TILE_ROWS / 2): the rows' inputs packed
// once, pairs of groups split between the threads.
template <typename Block>
void amx_part(const uint8_t* w, int64_t blocks, int64_t groups, Rows x, float* out, int64_t ldo) {
  const int64_t M = x.count, stride = amx_stride_rows(M);
  std::vector<int8_t> packed(stride * blocks * Block::VALUES);
  const PackedInputs in = PackedInputs::by_row(packed.data(), stride, 0, Block::VALUES);
  pack_rows(x.data(), M, stride, Block::VALUES, 0, blocks, in);
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    amx_groups<Block>(w, blocks, 2 * p0, std::min(groups, 2 * p1), 0, blocks, x.data(), M, in, out, ldo,
                      prefetch_ahead<Block>(M));
  });
}
#endif

// A repacked part (groups of eight rows) times every row of x, tiled for passes over many
// rows: TILE_ROWS rows' inputs over TILE_VALUES of their values (256 KB) stay in cache
// while every group of weights goes by, so the weights are read once per TILE_ROWS rows.
template <typename Block>
void x8_tiled(const uint8_t* w, int64_t blocks, int64_t groups, Rows x, float* out, int64_t ldo) {
  const int64_t M = static_cast<int64_t>(x.size()), tile_blocks = TILE_VALUES / Block::VALUES;
#ifdef AMX_INT8
  std::vector<int8_t> packed(amx_stride_rows(std::min(M, TILE_ROWS)) * TILE_VALUES);
#else
  std::vector<int8_t> packed(std::min(M, TILE_ROWS) * TILE_VALUES);
#endif
  for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
    const int64_t mt = std::min(TILE_ROWS, M - m0);
    for (int64_t b0 = 0; b0 < blocks; b0 += tile_blocks) {
      const int64_t b1 = std::min(blocks, b0 + tile_blocks);
#ifdef AMX_INT8
      const int64_t stride = amx_stride_rows(mt);
      const PackedInputs in = PackedInputs::by_row(packed.data(), stride, b0, Block::VALUES);
      pack_rows(x.data() + m0, mt, stride, Block::VALUES, b0, b1, in);
      at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
        amx_groups<Block>(w, blocks, 2 * p0, std::min(groups, 2 * p1), b0, b1, x.data() + m0, mt, in,
                          out + m0 * ldo, ldo, 1);
      });
#else
      const PackedInputs in = PackedInputs::by_group(packed.data(), mt, b0, Block::VALUES);
      pack_rows(x.data() + m0, mt, mt, Block::VALUES, b0, b1, in);
      at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
        x8_groups<Block>(w, blocks, g0, g1, b0, b1, x.data() + m0, mt, in, out + m0 * ldo, ldo, 1);
      });
#endif
    }
  }
}

int64_t block_values(int64_t bytes) {
  switch (bytes) {
    case Q4_K_BYTES:
    case Q4_K_X8_BYTES:
    case Q6_K_X8_BYTES:
    case Q6_K_BYTES: return QK_K;
    case Q8_0_X8_BYTES:
    case Q5_0_X8_BYTES:
    case Q8_0_BYTES:
    case Q4_0_BYTES:
    case Q4_1_BYTES:
    case Q5_0_BYTES: return QK8_0;
  }
  TORCH_CHECK(false, "quant_linear: unknown block of ", bytes,
              " bytes (Q4_K 144, Q6_K 210, Q8_0 34, Q4_0 18, Q4_1 20, Q5_0 22)");
}

bool repacked(int64_t bytes) {
  return bytes == Q4_K_X8_BYTES || bytes == Q6_K_X8_BYTES || bytes == Q8_0_X8_BYTES || bytes == Q5_0_X8_BYTES;
}

// A repacked part (`groups` groups of eight rows) times every row of x into out (ldo
// apart): tiled for a long pass, else groups split between the threads.
template <typename Block>
void x8_part(const uint8_t* w, int64_t blocks, int64_t groups, Rows x, float* out, int64_t ldo) {
  if (x.count >= TILE_ROWS / 2) return x8_tiled<Block>(w, blocks, groups, x, out, ldo);
#ifdef AMX_INT8
  if (x.count >= amx_min_rows<Block>()) return amx_part<Block>(w, blocks, groups, x, out, ldo);
#endif
  at::parallel_for(0, groups, 2, [&](int64_t g0, int64_t g1) {
    rows_times_any<Block, true>(w, blocks, x, g0, g1, out, ldo);
  });
}

}  // namespace

// x (M, K) bf16 or fp32; parts: uint8 (rows_i, K / values per block, bytes per block), their
// rows summing to N; bias (N) or None. Returns (M, N) in x's dtype.
torch::Tensor quant_linear(torch::Tensor x, std::vector<torch::Tensor> parts, c10::optional<torch::Tensor> bias,
                           int64_t N) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x must be (rows, K)");
  const int64_t M = x.size(0), K = x.size(1);
  const bool narrow = x.scalar_type() == torch::kBFloat16;  // its products leave in bf16
  const auto xc = narrow ? x.contiguous() : x.to(torch::kFloat32).contiguous();
  bool k_quants = false, q8_0 = false;
  int64_t rows = 0;
  for (const auto& p : parts) {
    TORCH_CHECK(p.scalar_type() == torch::kUInt8 && p.is_contiguous() && p.dim() == 3,
                "quant_linear: each part must be contiguous uint8 (rows, blocks, bytes per block)");
    const int64_t values = block_values(p.size(2));
    TORCH_CHECK(p.size(1) * values == K, "quant_linear: a part's blocks cover ", p.size(1) * values, " inputs, not ", K);
    (values == QK_K ? k_quants : q8_0) = true;
    rows += p.size(0) * (repacked(p.size(2)) ? 8 : 1);
  }
  TORCH_CHECK(rows == N, "quant_linear: the parts hold ", rows, " rows, not ", N);
  const std::vector<Q8Row> x8k = k_quants ? quantize_rows(xc, QK_K) : std::vector<Q8Row>{},
                           x80 = q8_0 ? quantize_rows(xc, QK8_0) : std::vector<Q8Row>{};
  // A bf16 call's fp32 products go to this thread's buffer, kept from call to call (as large
  // as the largest product yet: 37 MB for Qwen2.5-1.5B's gate and up projections over a
  // 512-token chunk of a prefill). A fresh one each call is memory the OS maps and zeroes
  // page by page: with it, and the bf16 inputs widened to a copy, a 512-token prefill took
  // 3.72 s against 3.42 (AMD EPYC Zen 4, 2 threads, interleaved, fastest of ten).
  thread_local std::vector<float> products;
  if (narrow && products.size() < static_cast<size_t>(M * N)) products.resize(M * N);
  auto y = narrow ? torch::from_blob(products.data(), {M, N}, torch::kFloat32) : torch::empty({M, N}, torch::kFloat32);
  float* yp = y.data_ptr<float>();
  int64_t first = 0;
  for (const auto& p : parts) {
    const uint8_t* w = p.data_ptr<uint8_t>();
    const int64_t blocks = p.size(1), bytes = p.size(2), n_rows = p.size(0);
    float* out = yp + first;
    const Rows k_rows{x8k.data(), k_quants ? M : 0}, rows32{x80.data(), q8_0 ? M : 0};
    if (repacked(bytes)) {  // n_rows groups of eight
      if (bytes == Q4_K_X8_BYTES) x8_part<Q4KX8>(w, blocks, n_rows, k_rows, out, N);
      else if (bytes == Q6_K_X8_BYTES) x8_part<Q6KX8>(w, blocks, n_rows, k_rows, out, N);
      else if (bytes == Q8_0_X8_BYTES) x8_part<Q80X8>(w, blocks, n_rows, rows32, out, N);
      else x8_part<Q50X8>(w, blocks, n_rows, rows32, out, N);
      first += 8 * n_rows;
      continue;
    }
    // Blocks as stored, TILE_ROWS rows at a time (a long pass's inputs then stay in cache);
    // grain 16 rows: at most 16 x 210 x 35 bytes (118 KB) of weights per task on the widest
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
      const int64_t mt = std::min(TILE_ROWS, M - m0);
      const Rows kt{k_quants ? x8k.data() + m0 : nullptr, k_quants ? mt : 0},  // a kind of row the call
          t32{q8_0 ? x80.data() + m0 : nullptr, q8_0 ? mt : 0};                  // lacks is never read
      float* tile_out = out + m0 * N;
      at::parallel_for(0, n_rows, 16, [&](int64_t n0, int64_t n1) {
        if (bytes == Q4_K_BYTES) rows_times_any<Q4K, false>(w, blocks, kt, n0, n1, tile_out, N);
        else if (bytes == Q6_K_BYTES) rows_times_any<Q6K, false>(w, blocks, kt, n0, n1, tile_out, N);
        else if (bytes == Q8_0_BYTES) rows_times_any<Q80, false>(w, blocks, t32, n0, n1, tile_out, N);
        else if (bytes == Q4_0_BYTES) rows_times_any<Q4Legacy<false>, false>(w, blocks, t32, n0, n1, tile_out, N);
        else if (bytes == Q5_0_BYTES) rows_times_any<Q50, false>(w, blocks, t32, n0, n1, tile_out, N);
        else rows_times_any<Q4Legacy<true>, false>(w, blocks, t32, n0, n1, tile_out, N);
      });
    }
    first += n_rows;
  }
  if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
  return y.to(x.scalar_type());
}
