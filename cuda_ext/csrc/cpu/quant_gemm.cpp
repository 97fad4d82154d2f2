// out = x @ W.T with W kept in GGUF's quantized blocks (quant_blocks.h), never
// dequantized to a float matrix. Two ways:
// - integer dot products (llama.cpp's CPU approach; few activation rows, where reading W
//   is the cost): each call quantizes every activation row, per block as W's type asks
//   (int8 blocks of 32 with a float32 scale for the 32-element types, of 256 for the
//   k-quants), then computes integer dot products of weight values with activation
//   values, scaled per block into float32 sums;
// - float panels (many rows, where the arithmetic is the cost): each thread decodes a
//   panel of W's rows into float32 in its cache and multiplies x by it with a float GEMM
//   (oneDNN's or torch's mm); nothing is rounded but the GEMM's float sums.
//
// Vector paths (picked by what -march=native enables; the scalar path always compiles
// and also takes a row's last blocks that do not fill a vector step):
//   AVX-512 (F/BW/VL/DQ): 4 blocks of 32 (or a k-quant half super-block) per step;
//     VNNI's vpdpbusd / vpdpwssd where present, else vpmaddubsw + vpmaddwd.
//   AVX2 (+FMA, F16C): 2 blocks of 32 (a quarter super-block) per step; AVX-VNNI's
//     vpdpbusd where present.
// The 32-element types multiply unsigned weight values (nibbles, plus bit 4 for Q5; Q8_0's
// int8 with 128 added under VNNI) by signed activations: the zero point's share (8, 16 or
// 128 times the activation sum) starts the integer sum, precomputed per lane with the
// activations (ActGroup::aux); the mins of Q4_1 / Q5_1 multiply float activation sums.
// Q8_0 without VNNI multiplies |w| by a with w's sign (vpmaddubsw would saturate w + 128).
// The k-quants multiply pairs (vpmaddubsw) and then by the sub-block scales (vpmaddwd /
// vpdpwssd); the mins (Q4_K, Q5_K) and Q6_K's zero point 32 use the activation sums.
//
// Work: output rows in tiles of kTileRows weight rows x up to kMaxTileCols activation rows
// (the weight decoded once per tile, reused across its activation rows), tiles spread
// over the threads. Accumulation is float32; the result is rounded to x's dtype.
// The 32-element types decode a step of all the tile's weight rows first, then load each
// activation row's step once for all of them: 1.45x faster at M = 16 and 64 than
// decoding row by row (bench/quant_gemm.py's 4096 x 4096, Q4_0 and Q8_0). The k-quants
// decode row by row: holding 4 rows' decoded half super-blocks (4 vectors each) and their
// integer sums per activation row would need more than the 32 vector registers.
#include "quant_blocks.h"  // first: it picks the vector ISA (through common.h)
#include "dequantize_rows.h"
#include "elementwise.h"
#include "ops.h"

#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <cstring>
#include <exception>
#include <vector>

#include <omp.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__F16C__)
#define QG_AVX512 1
#elif defined(CPU_CAPABILITY_AVX2) && defined(__F16C__)
#define QG_AVX2 1
#endif
#if (defined(QG_AVX512) && defined(__AVX512VNNI__)) || \
    (defined(QG_AVX2) && (defined(__AVXVNNI__) ||    \
                          (defined(__AVX512VNNI__) && defined(__AVX512VL__))))
#define QG_VNNI 1
#endif
#if defined(QG_AVX512) || defined(QG_AVX2)
#define QG_SIMD 1
#include <immintrin.h>
#endif

namespace pagedserve {
namespace quant {
namespace {

constexpr int kTileRows = 4;  // weight rows per tile
#if defined(QG_AVX512)
constexpr int kMaxTileCols = 4;  // activation rows per tile: 16 accumulators of 32 zmm
#else
constexpr int kMaxTileCols = 2;  // 8 of AVX2's 16 ymm
#endif
#if defined(QG_VNNI)
constexpr bool kQ8Biased = true;  // Q8_0: (w + 128) * a, less 128 * sum(a) (ActGroup::aux)
#else
constexpr bool kQ8Biased = false;  // Q8_0: |w| * (a with w's sign), as vpmaddubsw needs
#endif

#if defined(QG_AVX512)
// ---------------------------------------------------------------- AVX-512 primitives
using VI = __m512i;
using VF = __m512;
constexpr int kStepBlocks = 4;  // blocks of 32 per vector step

inline VI vload(const void* p) { return _mm512_loadu_si512(p); }
inline VF vloadf(const void* p) { return _mm512_loadu_ps(static_cast<const float*>(p)); }
inline VI bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline VI vzero() { return _mm512_setzero_si512(); }
inline VF fzero() { return _mm512_setzero_ps(); }
inline VF splat(float v) { return _mm512_set1_ps(v); }
inline VI vand(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI vor(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI vxor(VI a, VI b) { return _mm512_xor_si512(a, b); }
inline VI low_nibbles(VI v) { return vand(v, bytes(0x0F)); }
inline VI high_nibbles(VI v) { return vand(_mm512_srli_epi16(v, 4), bytes(0x0F)); }
inline VF to_float(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline float hsum(VF v) { return _mm512_reduce_add_ps(v); }
inline VI maddubs(VI u, VI s) { return _mm512_maddubs_epi16(u, s); }

// acc + per int32 lane, the sum of 4 products of unsigned u by signed s bytes.
inline VI dot_u8s8(VI acc, VI u, VI s) {
#if defined(QG_VNNI)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(maddubs(u, s), _mm512_set1_epi16(1)));
#endif
}

// acc + per int32 lane, the sum of 2 products of int16 words.
inline VI dot_s16(VI acc, VI a, VI b) {
#if defined(QG_VNNI)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// dot_u8s8 of signed w: |w| (128 for -128, fine unsigned) by a with w's sign.
inline VI dot_s8s8(VI acc, VI w, VI a) {
  const VI signed_a = _mm512_mask_sub_epi8(a, _mm512_movepi8_mask(w), vzero(), a);
  return dot_u8s8(acc, _mm512_abs_epi8(w), signed_a);
}

// The step's 4 blocks' 16 bytes at p + i * stride, one per 128-bit lane.
inline VI chunks16(const uint8_t* p, int64_t stride) {
  const auto at = [&](int i) { return _mm_loadu_si128((const __m128i*)(p + i * stride)); };
  VI v = _mm512_castsi128_si512(at(0));
  v = _mm512_inserti32x4(v, at(1), 1);
  v = _mm512_inserti32x4(v, at(2), 2);
  return _mm512_inserti32x4(v, at(3), 3);
}

// The fp16 at p + i * stride (i < 4) in float lanes 4i..4i + 3.
inline VF block_scales(const uint8_t* p, int64_t stride) {
  uint64_t bits = 0;
  for (int i = 0; i < 4; ++i) {
    uint16_t h;
    std::memcpy(&h, p + i * stride, 2);
    bits |= static_cast<uint64_t>(h) << (16 * i);
  }
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi64_si128(static_cast<long long>(bits)));
  const VI lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(f));
}

// v with 0x10 added to byte i where bit i of bits is set.
inline VI add_bit4(VI v, uint64_t bits) { return _mm512_mask_add_epi8(v, bits, v, bytes(0x10)); }

// Bit (16 * half .. 16 * half + 15) of each block's Q5 qh, as bits 16i.. of a byte mask.
inline uint64_t step_high_bits(const uint8_t* qh, int64_t stride, int half) {
  uint64_t bits = 0;
  for (int i = 0; i < 4; ++i) {
    bits |= static_cast<uint64_t>((load_u32(qh + i * stride) >> (16 * half)) & 0xFFFF)
            << (16 * i);
  }
  return bits;
}

// Two 256-bit halves of 16-bit words: a in the low one, b in the high one.
inline VI words2(int a, int b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(a))),
                            _mm256_set1_epi16(static_cast<short>(b)), 1);
}
inline VI bytes2(int a, int b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8(static_cast<char>(a))),
                            _mm256_set1_epi8(static_cast<char>(b)), 1);
}
inline VI words4(int a, int b, int c, int d) {
  const auto w = [](int v) { return _mm_set1_epi16(static_cast<short>(v)); };
  VI v = _mm512_castsi128_si512(w(a));
  v = _mm512_inserti32x4(v, w(b), 1);
  v = _mm512_inserti32x4(v, w(c), 2);
  return _mm512_inserti32x4(v, w(d), 3);
}
inline VI widen(__m128i v) { return _mm512_inserti32x4(vzero(), v, 0); }
inline VI widen(__m256i v) { return _mm512_inserti64x4(vzero(), v, 0); }

#elif defined(QG_AVX2)
// ---------------------------------------------------------------- AVX2 primitives
using VI = __m256i;
using VF = __m256;
constexpr int kStepBlocks = 2;

inline VI vload(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline VF vloadf(const void* p) { return _mm256_loadu_ps(static_cast<const float*>(p)); }
inline VI bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline VI vzero() { return _mm256_setzero_si256(); }
inline VF fzero() { return _mm256_setzero_ps(); }
inline VF splat(float v) { return _mm256_set1_ps(v); }
inline VI vand(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI vor(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI vxor(VI a, VI b) { return _mm256_xor_si256(a, b); }
inline VI low_nibbles(VI v) { return vand(v, bytes(0x0F)); }
inline VI high_nibbles(VI v) { return vand(_mm256_srli_epi16(v, 4), bytes(0x0F)); }
inline VF to_float(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF fmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline float hsum(VF v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline VI maddubs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }

inline VI dot_u8s8(VI acc, VI u, VI s) {
#if defined(QG_VNNI) && defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#elif defined(QG_VNNI)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(maddubs(u, s), _mm256_set1_epi16(1)));
#endif
}

inline VI dot_s16(VI acc, VI a, VI b) {
#if defined(QG_VNNI) && defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(QG_VNNI)
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

inline VI dot_s8s8(VI acc, VI w, VI a) {
  return dot_u8s8(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

inline VI chunks16(const uint8_t* p, int64_t stride) {
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)p)),
      _mm_loadu_si128((const __m128i*)(p + stride)), 1);
}

inline VF block_scales(const uint8_t* p, int64_t stride) {
  uint16_t h0, h1;
  std::memcpy(&h0, p, 2);
  std::memcpy(&h1, p + stride, 2);
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(h0 | static_cast<int>(h1) << 16));
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f),
                                  _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// 0x10 in byte i where bit i of bits is set, else 0.
inline VI bit4_bytes(uint32_t bits) {
  const VI spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  //
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const VI select = _mm256_set1_epi64x(0x8040201008040201LL);
  return vand(_mm256_cmpeq_epi8(vand(spread, select), select), bytes(0x10));
}
inline VI add_bit4(VI v, uint64_t bits) { return vor(v, bit4_bytes(static_cast<uint32_t>(bits))); }

inline uint64_t step_high_bits(const uint8_t* qh, int64_t stride, int half) {
  return ((load_u32(qh) >> (16 * half)) & 0xFFFF) |
         ((load_u32(qh + stride) >> (16 * half)) & 0xFFFF) << 16;
}

// 0x10 in each byte of qh whose bit j is set.
inline VI bit_j_to_4(VI qh, int j) {
  const VI select = bytes(1 << j);
  return vand(_mm256_cmpeq_epi8(vand(qh, select), select), bytes(0x10));
}
inline VI widen(__m128i v) { return _mm256_inserti128_si256(vzero(), v, 0); }
#endif

#if defined(QG_SIMD)
// ---------------------------------------------------------------- 32-element types

// One vector step of one weight row: kStepBlocks blocks' values as unsigned bytes (lo:
// elements 0..15 of each block, hi: 16..31), their scales d and mins m per int32 lane.
struct Step32 {
  VI lo, hi;
  VF d, m;
};

template <QType T>
inline Step32 decode_step(const uint8_t* p) {
  constexpr int B = block_bytes(T);
  Step32 s;
  s.d = block_scales(p, B);
  s.m = has_min(T) ? block_scales(p + 2, B) : fzero();
  if constexpr (T == QType::Q8_0) {
    s.lo = chunks16(p + 2, B);
    s.hi = chunks16(p + 18, B);
    if constexpr (kQ8Biased) {
      s.lo = vxor(s.lo, bytes(0x80));
      s.hi = vxor(s.hi, bytes(0x80));
    }
  } else {
    constexpr bool five_bit = T == QType::Q5_0 || T == QType::Q5_1;
    constexpr int qh_at = has_min(T) ? 4 : 2;
    const VI qs = chunks16(p + qh_at + (five_bit ? 4 : 0), B);
    s.lo = low_nibbles(qs);
    s.hi = high_nibbles(qs);
    if constexpr (five_bit) {
      s.lo = add_bit4(s.lo, step_high_bits(p + qh_at, B, 0));
      s.hi = add_bit4(s.hi, step_high_bits(p + qh_at, B, 1));
    }
  }
  return s;
}

// One vector step of one activation row: its values, scales and per-lane aux (ActGroup).
struct ActStep {
  VI lo, hi, aux;
  VF d;
};

inline ActStep load_act_step(const ActGroup& g, int part) {
  return {vload(g.lo + 16 * part), vload(g.hi + 16 * part), vload(g.aux + 4 * part),
          vloadf(g.d + 4 * part)};
}

// acc += the step's weights dotted with the step's activations, per lane.
template <QType T>
inline void accumulate_step(const Step32& s, const ActStep& a, VF& acc) {
  VI dot;
  if constexpr (T == QType::Q8_0 && !kQ8Biased) {
    dot = dot_s8s8(dot_s8s8(vzero(), s.lo, a.lo), s.hi, a.hi);
  } else {
    dot = dot_u8s8(dot_u8s8(has_min(T) ? vzero() : a.aux, s.lo, a.lo), s.hi, a.hi);
  }
  acc = fmadd(mul(to_float(dot), a.d), s.d, acc);
#if defined(QG_AVX512)
  if constexpr (has_min(T)) acc = fmadd(_mm512_castsi512_ps(a.aux), s.m, acc);
#else
  if constexpr (has_min(T)) acc = fmadd(_mm256_castsi256_ps(a.aux), s.m, acc);
#endif
}

// ---------------------------------------------------------------- k-quants

// acc[m] += one weight super-block (at b) dotted with activation super-block act[m].
template <QType T, int RM>
inline void accumulate_super(const uint8_t* b, const ActSuper* const (&act)[RM],
                             VF (&acc)[RM]) {
  VI p[RM];
  for (int m = 0; m < RM; ++m) p[m] = vzero();
  if constexpr (T == QType::Q6_K) {
    const __m128i sc8 = _mm_loadu_si128((const __m128i*)(b + 192));
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
#if defined(QG_AVX512)
    const VI sc = _mm512_castsi256_si512(sc16);
    for (int h = 0; h < 2; ++h) {
      const VI ql = vload(b + 64 * h);
      const VI qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
      const VI lo = vor(low_nibbles(ql), vand(_mm512_sllv_epi16(qh, words2(4, 2)), bytes(0x30)));
      const VI hi = vor(high_nibbles(ql), vand(_mm512_srlv_epi16(qh, words2(0, 2)), bytes(0x30)));
      const int j = 8 * h;  // the first of the half's 8 scales
      const VI s_lo = _mm512_permutexvar_epi16(words4(j, j + 1, j + 2, j + 3), sc);
      const VI s_hi = _mm512_permutexvar_epi16(words4(j + 4, j + 5, j + 6, j + 7), sc);
      for (int m = 0; m < RM; ++m) {
        p[m] = dot_s16(p[m], maddubs(lo, vload(act[m]->q + 128 * h)), s_lo);
        p[m] = dot_s16(p[m], maddubs(hi, vload(act[m]->q + 128 * h + 64)), s_hi);
      }
    }
#else
    for (int h = 0; h < 2; ++h) {
      const VI qh = vload(b + 128 + 32 * h);
      for (int t = 0; t < 2; ++t) {  // quarters t (low nibbles) and t + 2 (high)
        const VI ql = vload(b + 64 * h + 32 * t);
        const VI bits_lo = t == 0 ? _mm256_slli_epi16(qh, 4) : _mm256_slli_epi16(qh, 2);
        const VI bits_hi = t == 0 ? qh : _mm256_srli_epi16(qh, 2);
        const VI lo = vor(low_nibbles(ql), vand(bits_lo, bytes(0x30)));
        const VI hi = vor(high_nibbles(ql), vand(bits_hi, bytes(0x30)));
        const auto scales = [&](int quarter) {  // words 0..7: scale 2q, 8..15: 2q + 1
          const int j = 2 * (4 * h + quarter);
          return _mm256_setr_m128i(_mm_set1_epi16(static_cast<int8_t>(b[192 + j])),
                                   _mm_set1_epi16(static_cast<int8_t>(b[193 + j])));
        };
        const VI s_lo = scales(t), s_hi = scales(t + 2);
        for (int m = 0; m < RM; ++m) {
          p[m] = dot_s16(p[m], maddubs(lo, vload(act[m]->q + 128 * h + 32 * t)), s_lo);
          p[m] = dot_s16(p[m], maddubs(hi, vload(act[m]->q + 128 * h + 64 + 32 * t)), s_hi);
        }
      }
    }
#endif
    const float d = fp16(b + 208);
    for (int m = 0; m < RM; ++m) {  // less 32 * sum_j scale_j * (sum of a over j's 16)
      const __m256i zero_point = _mm256_madd_epi16(
          sc16, _mm256_loadu_si256((const __m256i*)act[m]->sums));
#if defined(QG_AVX512)
      p[m] = _mm512_sub_epi32(p[m], _mm512_slli_epi32(widen(zero_point), 5));
#else
      p[m] = _mm256_sub_epi32(p[m], _mm256_slli_epi32(zero_point, 5));
#endif
      acc[m] = fmadd(to_float(p[m]), splat(d * act[m]->d), acc[m]);
    }
  } else {  // Q4_K, Q5_K
    alignas(16) uint8_t sc[16];  // 8 scales, 8 mins
    k_scales_mins(b + 4, sc, sc + 8);
    const __m128i scales_mins = _mm_load_si128((const __m128i*)sc);
    const uint8_t* qs = b + (T == QType::Q5_K ? 48 : 16);
#if defined(QG_AVX512)
    const VI sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scales_mins));
    const VI qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 16)));
    for (int h = 0; h < 2; ++h) {  // groups 2h (sub-blocks 4h, 4h + 1), 2h + 1 (4h + 2, 4h + 3)
      const VI q = vload(qs + 64 * h);
      VI lo = low_nibbles(q), hi = high_nibbles(q);
      const int j = 4 * h;
      if constexpr (T == QType::Q5_K) {
        lo = add_bit4(lo, _mm512_test_epi8_mask(qh, bytes2(1 << j, 1 << (j + 2))));
        hi = add_bit4(hi, _mm512_test_epi8_mask(qh, bytes2(1 << (j + 1), 1 << (j + 3))));
      }
      const VI s_lo = _mm512_permutexvar_epi16(words2(j, j + 2), sc16);
      const VI s_hi = _mm512_permutexvar_epi16(words2(j + 1, j + 3), sc16);
      for (int m = 0; m < RM; ++m) {
        p[m] = dot_s16(p[m], maddubs(lo, vload(act[m]->q + 128 * h)), s_lo);
        p[m] = dot_s16(p[m], maddubs(hi, vload(act[m]->q + 128 * h + 64)), s_hi);
      }
    }
#else
    const VI qh = vload(b + 16);
    for (int g = 0; g < 4; ++g) {  // group g: sub-blocks 2g (low nibbles), 2g + 1 (high)
      const VI q = vload(qs + 32 * g);
      VI lo = low_nibbles(q), hi = high_nibbles(q);
      if constexpr (T == QType::Q5_K) {
        lo = vor(lo, bit_j_to_4(qh, 2 * g));
        hi = vor(hi, bit_j_to_4(qh, 2 * g + 1));
      }
      const VI s_lo = _mm256_set1_epi16(sc[2 * g]), s_hi = _mm256_set1_epi16(sc[2 * g + 1]);
      const int at = 128 * (g / 2) + 32 * (g % 2);
      for (int m = 0; m < RM; ++m) {
        p[m] = dot_s16(p[m], maddubs(lo, vload(act[m]->q + at)), s_lo);
        p[m] = dot_s16(p[m], maddubs(hi, vload(act[m]->q + at + 64)), s_hi);
      }
    }
#endif
    const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(scales_mins, 8));
    const float d = fp16(b), dmin = fp16(b + 2);
    for (int m = 0; m < RM; ++m) {
      const __m128i min_sum = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)act[m]->sums));
      acc[m] = fmadd(to_float(p[m]), splat(d * act[m]->d), acc[m]);
      acc[m] = fmadd(to_float(widen(min_sum)), splat(-dmin * act[m]->d), acc[m]);
    }
  }
}
#endif  // QG_SIMD

// ---------------------------------------------------------------- tiles

// Asks for the bytes the next tile reads where this one reads [p, p + kBytes) now. A
// tile's rows are only a few KiB, too short for the hardware's stream prefetch to ramp
// up; the tiles a thread runs lie back to back, so the next one is tile_bytes ahead.
// Measured (bench/quant_gemm.py's shapes, weights cycled through 256 MiB so that they
// come from DRAM, M = 1, 2 threads): Q5_K 15 -> 35 GB/s, Q6_K 22 -> 37, Q4_0 29 -> 35.
template <int kBytes>
inline void prefetch_next_tile(const uint8_t* p, int64_t tile_bytes) {
  for (int offset = 0; offset < kBytes; offset += 64) {
    __builtin_prefetch(p + tile_bytes + offset, 0, 0);
  }
}

// out[r][m] = weight row r (rows w_stride bytes apart) dotted with activation row act[m].
template <QType T, int RN, int RM>
void tile_dots(const uint8_t* w, int64_t w_stride, const uint8_t* const (&act)[RM],
               int64_t num_blocks, float (&out)[RN][RM]) {
  constexpr int B = block_bytes(T);
  if constexpr (is_k_quant(T)) {
#if defined(QG_SIMD)
    VF acc[RN][RM];
    for (auto& row : acc)
      for (auto& a : row) a = fzero();
    for (int64_t sb = 0; sb < num_blocks; ++sb) {
      const ActSuper* blocks[RM];
      for (int m = 0; m < RM; ++m) blocks[m] = reinterpret_cast<const ActSuper*>(act[m]) + sb;
      for (int r = 0; r < RN; ++r) {
        const uint8_t* block = w + r * w_stride + sb * B;
        prefetch_next_tile<B>(block, RN * w_stride);
        accumulate_super<T, RM>(block, blocks, acc[r]);
      }
    }
    for (int r = 0; r < RN; ++r)
      for (int m = 0; m < RM; ++m) out[r][m] = hsum(acc[r][m]);
#else
    for (int r = 0; r < RN; ++r) {
      for (int m = 0; m < RM; ++m) {
        const auto* blocks = reinterpret_cast<const ActSuper*>(act[m]);
        float sum = 0.f;
        for (int64_t sb = 0; sb < num_blocks; ++sb)
          sum += dot_super<T>(w + r * w_stride + sb * B, blocks[sb]);
        out[r][m] = sum;
      }
    }
#endif
  } else {
    int64_t first_scalar = 0;
#if defined(QG_SIMD)
    VF acc[RN][RM];
    for (auto& row : acc)
      for (auto& a : row) a = fzero();
    const int64_t steps = num_blocks / kStepBlocks;
    for (int64_t s = 0; s < steps; ++s) {
      const int64_t b0 = s * kStepBlocks;
      const int part = static_cast<int>(b0 % 4);
      Step32 steps[RN];
      for (int r = 0; r < RN; ++r) {
        const uint8_t* first = w + r * w_stride + b0 * B;
        prefetch_next_tile<kStepBlocks * B>(first, RN * w_stride);
        steps[r] = decode_step<T>(first);
      }
      for (int m = 0; m < RM; ++m) {
        const ActStep a = load_act_step(reinterpret_cast<const ActGroup*>(act[m])[b0 / 4], part);
        for (int r = 0; r < RN; ++r) accumulate_step<T>(steps[r], a, acc[r][m]);
      }
    }
    const int64_t rest = num_blocks - steps * kStepBlocks;
    if (rest > 0) {  // the last blocks as one step, zero-padded: a zero scale adds nothing
      const int64_t b0 = steps * kStepBlocks;  // (the activation groups' tail is zeroed too)
      const int part = static_cast<int>(b0 % 4);
      alignas(64) uint8_t padded[kStepBlocks * B];
      Step32 tail[RN];
      for (int r = 0; r < RN; ++r) {
        std::memset(padded, 0, sizeof(padded));
        std::memcpy(padded, w + r * w_stride + b0 * B, rest * B);
        tail[r] = decode_step<T>(padded);
      }
      for (int m = 0; m < RM; ++m) {
        const ActStep a = load_act_step(reinterpret_cast<const ActGroup*>(act[m])[b0 / 4], part);
        for (int r = 0; r < RN; ++r) accumulate_step<T>(tail[r], a, acc[r][m]);
      }
    }
    for (int r = 0; r < RN; ++r)
      for (int m = 0; m < RM; ++m) out[r][m] = hsum(acc[r][m]);
    first_scalar = num_blocks;
#else
    for (auto& row : out)
      for (auto& o : row) o = 0.f;
#endif
    for (int64_t b = first_scalar; b < num_blocks; ++b) {
      for (int r = 0; r < RN; ++r) {
        for (int m = 0; m < RM; ++m) {
          const auto& group = reinterpret_cast<const ActGroup*>(act[m])[b / 4];
          out[r][m] += dot_block32<T>(w + r * w_stride + b * B, group, static_cast<int>(b % 4));
        }
      }
    }
  }
}

// ---------------------------------------------------------------- activations

// Rounds x[0, n) (the rest of the block zero) to int8 q = round(x * 127 / max|x|);
// returns the scale d = max|x| / 127 (x ~ d * q). tests/cuda_ext/test_quant_gemm.py
// repeats this rounding in torch: change both together.
template <typename X>
float quantize_block(const X* x, int64_t n, int len, int8_t* q) {
  alignas(64) float v[256];  // len (32 or 256, a multiple of kVec) values
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(x[i]);
  for (int64_t i = n; i < len; ++i) v[i] = 0.f;
  fvec amax(0.f);
  for (int i = 0; i < len; i += kVec) amax = at::vec::maximum(amax, fvec::loadu(v + i).abs());
  const float max_abs = reduce_max(amax);
  const fvec inverse(max_abs > 0.f ? 127.f / max_abs : 0.f);
  for (int i = 0; i < len; i += kVec) (fvec::loadu(v + i) * inverse).round().store(v + i);
  for (int i = 0; i < len; ++i) q[i] = static_cast<int8_t>(v[i]);
  return max_abs / 127.f;
}

// One activation row (k values) as qtype T's activation blocks, at dst.
template <QType T, typename X>
void prepare_row(const X* x, int64_t k, int64_t num_blocks, uint8_t* dst) {
  if constexpr (is_k_quant(T)) {
    auto* blocks = reinterpret_cast<ActSuper*>(dst);
    for (int64_t sb = 0; sb < num_blocks; ++sb) {
      int8_t q[256];
      ActSuper& a = blocks[sb];
      a.d = quantize_block(x + 256 * sb, std::min<int64_t>(256, k - 256 * sb), 256, q);
      for (int e = 0; e < 256; e += 32) std::memcpy(a.q + super_position(T, e), q + e, 32);
      constexpr int span = T == QType::Q6_K ? 16 : 32;  // the elements of one scale
      for (int j = 0; j < 16; ++j) {
        int sum = 0;
        if (j < 256 / span) {
          for (int e = span * j; e < span * (j + 1); ++e) sum += q[e];
        }
        a.sums[j] = static_cast<int16_t>(sum);
      }
      std::memset(a.pad, 0, sizeof(a.pad));
    }
  } else {
    auto* groups = reinterpret_cast<ActGroup*>(dst);
    std::memset(dst, 0, cdiv(num_blocks, 4) * sizeof(ActGroup));
    for (int64_t b = 0; b < num_blocks; ++b) {
      int8_t q[32];
      const float d = quantize_block(x + 32 * b, std::min<int64_t>(32, k - 32 * b), 32, q);
      ActGroup& g = groups[b / 4];
      const int j = static_cast<int>(b % 4);
      std::memcpy(g.lo + 16 * j, q, 16);
      std::memcpy(g.hi + 16 * j, q + 16, 16);
      for (int t = 0; t < 4; ++t) {
        const int lane = 4 * j + t;
        int32_t s = 0;
        for (int i = 0; i < 4; ++i) s += q[4 * t + i] + q[16 + 4 * t + i];
        g.d[lane] = d;
        if constexpr (has_min(T)) {
          const float scaled = d * static_cast<float>(s);
          std::memcpy(&g.aux[lane], &scaled, 4);
        } else if constexpr (T == QType::Q8_0) {
          g.aux[lane] = kQ8Biased ? -128 * s : 0;
        } else {
          g.aux[lane] = -zero_point(T) * s;
        }
      }
    }
  }
}

// What prepare_row's rounding left of x: r = x - d * q, block by block. Rounding r too
// (a second activation row) makes the pair x ~ d q + d' q' good to about 2^-15 of each
// block's largest value, where one level is good to 2^-8.
template <QType T, typename X>
void rounding_residual(const X* x, int64_t k, float* r) {
  constexpr int len = is_k_quant(T) ? 256 : 32;
  int8_t q[256];
  for (int64_t start = 0; start < k; start += len) {
    const int64_t n = std::min<int64_t>(len, k - start);
    const float d = quantize_block(x + start, n, len, q);
    for (int64_t i = 0; i < n; ++i) r[start + i] = static_cast<float>(x[start + i]) - d * q[i];
  }
}

template <QType T>
int64_t activation_row_bytes(int64_t num_blocks) {
  return is_k_quant(T) ? num_blocks * static_cast<int64_t>(sizeof(ActSuper))
                       : cdiv(num_blocks, 4) * static_cast<int64_t>(sizeof(ActGroup));
}

// ---------------------------------------------------------------- the op

template <typename F>
void dispatch_qtype(int64_t qtype, F&& f) {
  switch (static_cast<QType>(qtype)) {
    case QType::Q4_0: f(std::integral_constant<QType, QType::Q4_0>{}); break;
    case QType::Q4_1: f(std::integral_constant<QType, QType::Q4_1>{}); break;
    case QType::Q5_0: f(std::integral_constant<QType, QType::Q5_0>{}); break;
    case QType::Q5_1: f(std::integral_constant<QType, QType::Q5_1>{}); break;
    case QType::Q8_0: f(std::integral_constant<QType, QType::Q8_0>{}); break;
    case QType::Q4_K: f(std::integral_constant<QType, QType::Q4_K>{}); break;
    case QType::Q5_K: f(std::integral_constant<QType, QType::Q5_K>{}); break;
    case QType::Q6_K: f(std::integral_constant<QType, QType::Q6_K>{}); break;
    default:
      TORCH_CHECK_VALUE(false, "quantized_matmul: qtype ", qtype,
                        " is not supported; use a ggml type id of Q4_0, Q4_1, Q5_0, Q5_1, "
                        "Q8_0, Q4_K, Q5_K or Q6_K");
  }
}

struct TileRange {
  int64_t first, count;
};

// Activation rows in tiles of kMaxTileCols, then halves of it, down to 1.
std::vector<TileRange> column_tiles(int64_t rows) {
  std::vector<TileRange> tiles;
  int64_t first = 0;
  for (int64_t size = kMaxTileCols; size >= 1; size /= 2) {
    for (; rows - first >= size; first += size) tiles.push_back({first, size});
  }
  return tiles;
}

template <QType T, typename X, int RM>
void run_tile(const uint8_t* weights, int64_t w_stride, int64_t n0, int64_t n_rows,
              const uint8_t* act, int64_t act_stride, int64_t m0, int64_t num_blocks,
              const Rows<X>& out) {
  const uint8_t* rows[RM];
  for (int m = 0; m < RM; ++m) rows[m] = act + (m0 + m) * act_stride;
  const auto store = [&](int64_t n, const float* sums) {  // sums: [RM], output column n
    for (int m = 0; m < RM; ++m) out[m0 + m][n] = static_cast<X>(sums[m]);
  };
  if (n_rows == kTileRows) {
    float sums[kTileRows][RM];
    tile_dots<T, kTileRows, RM>(weights + n0 * w_stride, w_stride, rows, num_blocks, sums);
    for (int r = 0; r < kTileRows; ++r) store(n0 + r, sums[r]);
  } else {
    for (int64_t n = n0; n < n0 + n_rows; ++n) {
      float sums[1][RM];
      tile_dots<T, 1, RM>(weights + n * w_stride, w_stride, rows, num_blocks, sums);
      store(n, sums[0]);
    }
  }
}

// The tiles' products of every activation row (`rows` of them, prepared in `act`) with
// every weight row, into dst [rows, N].
template <QType T, typename X>
void tile_products(const uint8_t* weights, int64_t N, int64_t w_stride, const uint8_t* act_data,
                   int64_t act_stride, int64_t rows, int64_t num_blocks, const Rows<X>& dst) {
  const int threads = at::get_num_threads();
  const bool parallel = N * w_stride * cdiv(rows, kMaxTileCols) > kParallelBytes;
  const std::vector<TileRange> cols = column_tiles(rows);
  const int64_t num_col_tiles = static_cast<int64_t>(cols.size());
  const int64_t tasks = cdiv(N, kTileRows) * num_col_tiles;
#pragma omp parallel for num_threads(threads) schedule(static) if (parallel)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = t / num_col_tiles * kTileRows;
    const int64_t n_rows = std::min<int64_t>(kTileRows, N - n0);
    const TileRange col = cols[t % num_col_tiles];
    const auto run = [&](auto rm) {
      run_tile<T, X, decltype(rm)::value>(weights, w_stride, n0, n_rows, act_data, act_stride,
                                          col.first, num_blocks, dst);
    };
    switch (col.count) {
#if defined(QG_AVX512)
      case 4: run(std::integral_constant<int, 4>{}); break;
#endif
      case 2: run(std::integral_constant<int, 2>{}); break;
      default: run(std::integral_constant<int, 1>{}); break;
    }
  }
}

// ---------------------------------------------------------------- float panels

// The most bytes of float32 values per panel (at least 32 rows): a thread's panel stays
// in its cache while the GEMM reads it.
constexpr int64_t kPanelBytes = 2 << 20;

// Who multiplies a decoded panel: torch's mm (MKL), or oneDNN's linear (twice MKL's
// speed where MKL takes its AVX2 path, as on AMD CPUs; the caller knows torch has it).
enum class PanelGemm { kMm, kOneDnn };

// x [M, k] @ panel.T -> [M, rows] through torch's mkldnn linear op, which takes a plain
// row-major weight (inside an OpenMP region, oneDNN runs on the calling thread alone).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& panel) {
  static const auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  return linear.call(x, panel, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                     std::nullopt);
}

// out = x @ W.T with no activation rounding: each thread decodes a panel of W's rows
// into float32 (dequantize_rows.h) and multiplies x by it into the panel's columns of
// out, the decoding and the GEMM on the same thread. Panels are balanced over the
// threads: N / threads rows each, cut into as few panels as kPanelBytes allows.
template <QType T>
void panel_matmul_typed(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks,
                        int64_t k, PanelGemm gemm) {
  const int64_t N = blocks.size(0), w_stride = blocks.size(1);
  if (N == 0 || x.size(0) == 0) return;  // out has no elements
  const int64_t max_rows = std::max<int64_t>(32, kPanelBytes / (4 * k));
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), cdiv(N, 16)));
  const int64_t panels_each = cdiv(N, threads * max_rows);
  const int64_t panel_rows = cdiv(cdiv(N, threads * panels_each), 16) * 16;
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // [M, k]
  const at::Tensor outf = out.scalar_type() == at::kFloat
                              ? out
                              : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  const at::Tensor panels = at::empty({threads, panel_rows, k}, x.options().dtype(at::kFloat));
  const uint8_t* weights = blocks.data_ptr<uint8_t>();
  const at::ThreadLocalState caller;  // inference mode, grad mode: torch's are per thread
  std::exception_ptr failure;         // the first error of any thread, rethrown after
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += panel_rows) {
    try {
      const at::ThreadLocalStateGuard as_caller(caller);
      const int64_t rows = std::min(panel_rows, N - n0);
      const at::Tensor panel = panels[omp_get_thread_num()].narrow(0, 0, rows);  // [rows, k]
      const Rows<float> dst(panel);
      for (int64_t r = 0; r < rows; ++r) {
        dequantize_row<T>(weights + (n0 + r) * w_stride, k, dst[r]);
      }
      at::Tensor cols = outf.narrow(1, n0, rows);  // [M, rows]
      if (gemm == PanelGemm::kOneDnn) {
        cols.copy_(onednn_linear(xf, panel));
      } else {
        at::mm_out(cols, xf, panel.t());
      }
    } catch (...) {
#pragma omp critical(panel_failure)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  if (!outf.is_same(out)) out.copy_(outf);
}

// out = x @ W.T. levels -1 / 0: panel_matmul_typed (no rounding) with oneDNN / torch's
// mm. levels 1: each activation block rounded to int8 once (llama.cpp's
// scheme); 2: its rounding error rounded again as a second activation row, the two
// rows' products summed in float32 (the weights decoded once for both).
template <QType T, typename X>
void quantized_matmul_typed(const at::Tensor& out, const at::Tensor& x,
                            const at::Tensor& blocks, int64_t k, int64_t levels) {
  if (levels <= 0) {
    const PanelGemm gemm = levels == 0 ? PanelGemm::kMm : PanelGemm::kOneDnn;
    panel_matmul_typed<T>(out, x, blocks, k, gemm);
    return;
  }
  const int64_t M = x.size(0), N = blocks.size(0);
  const int64_t num_blocks = cdiv(k, block_elements(T));
  const int64_t w_stride = blocks.size(1);
  const int64_t act_stride = activation_row_bytes<T>(num_blocks);
  const at::Tensor act = at::empty({levels * M, act_stride}, x.options().dtype(at::kByte));
  uint8_t* act_data = act.data_ptr<uint8_t>();
  const Rows<const X> xs(x);
  const int threads = at::get_num_threads();
  const uint8_t* weights = blocks.data_ptr<uint8_t>();
  const at::Tensor residual = at::empty({levels == 2 ? M : 0, k}, x.options().dtype(at::kFloat));
  const Rows<float> rs(residual);
#pragma omp parallel for num_threads(threads) if (M > 1 && M * k > kParallelBytes)
  for (int64_t m = 0; m < M; ++m) {
    prepare_row<T>(xs[m], k, num_blocks, act_data + m * act_stride);
    if (levels == 2) {
      rounding_residual<T>(xs[m], k, rs[m]);
      prepare_row<T>(static_cast<const float*>(rs[m]), k, num_blocks,
                     act_data + (M + m) * act_stride);
    }
  }
  if (levels == 1) {
    tile_products<T, X>(weights, N, w_stride, act_data, act_stride, M, num_blocks, Rows<X>(out));
    return;
  }
  const at::Tensor sums = at::empty({2 * M, N}, x.options().dtype(at::kFloat));
  const Rows<float> s(sums);
  tile_products<T, float>(weights, N, w_stride, act_data, act_stride, 2 * M, num_blocks, s);
  const Rows<X> dst(out);
#pragma omp parallel for num_threads(threads) if (M * N > kParallelBytes)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) dst[m][n] = static_cast<X>(s[m][n] + s[M + m][n]);
  }
}

}  // namespace
}  // namespace quant

void quantized_matmul(const at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks,
                      int64_t qtype, int64_t k, int64_t levels) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(k > 0 && x.dim() == 2 && is_rows(x, x.size(0), k),
                    "quantized_matmul: x must be [M, k] with unit last stride, k > 0");
  TORCH_CHECK_VALUE(levels >= -1 && levels <= 2,
                    "quantized_matmul: levels must be -1, 0, 1 or 2");
  quant::dispatch_qtype(qtype, [&](auto tag) {
    constexpr quant::QType T = decltype(tag)::value;
    const int64_t bytes = cdiv(k, quant::block_elements(T)) * quant::block_bytes(T);
    TORCH_CHECK_VALUE(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                          blocks.dim() == 2 && blocks.size(1) == bytes &&
                          blocks.is_contiguous(),
                      "quantized_matmul: blocks must be contiguous uint8 [N, ", bytes, "]");
    TORCH_CHECK_VALUE(is_rows(out, x.size(0), blocks.size(0)) &&
                          out.scalar_type() == x.scalar_type() &&
                          (out.size(0) <= 1 || out.stride(0) >= blocks.size(0)),
                      "quantized_matmul: out must be [M, N] of x's dtype, unit last stride");
    dispatch_dtype(x.scalar_type(), "quantized_matmul", [&](auto x_tag) {
      quant::quantized_matmul_typed<T, decltype(x_tag)>(out, x, blocks, k, levels);
    });
  });
}

}  // namespace pagedserve
