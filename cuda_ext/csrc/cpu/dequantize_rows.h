// GGUF block rows decoded into float32 values, as `cuda_ext.quant_gemm.dequantize` gives
// them (the same formulas per type, quant_blocks.h; a multiply-add may be fused, so a
// value can differ from the reference's in its last bit). The many-row product
// (quant_gemm.cpp) decodes a panel of weight rows this way, into cache, and multiplies it
// by the activations in float: no activation rounding, and the float GEMM's speed once
// enough rows share each decoded weight.
//
// Each block is decoded in two passes: its integer values (and one scale and offset per
// run of 16 or 32 elements), then value = scale * q + offset over the run, a plain loop
// the compiler vectorizes.
#pragma once

#include "quant_blocks.h"  // first: it picks the vector ISA (through common.h)

#include <cstring>

namespace pagedserve::quant {

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define DQ_SIMD 1
#include <immintrin.h>

// out[0..16) = scale * q + offset for the 16 signed bytes q (a multiply-add with offset
// 0 is the product, rounded once).
inline void scale_bytes16(__m128i q, float scale, float offset, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(v, _mm512_set1_ps(scale), _mm512_set1_ps(offset)));
#else
  const __m256 s = _mm256_set1_ps(scale), o = _mm256_set1_ps(offset);
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
  _mm256_storeu_ps(out, _mm256_fmadd_ps(lo, s, o));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(hi, s, o));
#endif
}

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
inline __m128i nibbles_lo(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline __m128i nibbles_hi(__m128i v) {
  return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
}
// v with 0x10 added to byte i where bit i of the low 16 bits of bits is set.
inline __m128i with_bit4(__m128i v, uint32_t bits) {
  const __m128i select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64,
                                       -128);
  const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1,
                                                        1, 1, 1));
  const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(spread, select), select);
  return _mm_add_epi8(v, _mm_and_si128(set, _mm_set1_epi8(0x10)));
}

// A whole 32-element block, vectorized: its values as signed bytes (zero point
// subtracted), then scale_bytes16.
template <QType T>
inline void dequantize_block32_simd(const uint8_t* b, float* out) {
  const float d = fp16(b);
  const float m = has_min(T) ? fp16(b + 2) : 0.f;
  if constexpr (T == QType::Q8_0) {
    scale_bytes16(load16(b + 2), d, 0.f, out);
    scale_bytes16(load16(b + 18), d, 0.f, out + 16);
  } else {
    constexpr int qh_at = has_min(T) ? 4 : 2;
    constexpr bool five_bit = T == QType::Q5_0 || T == QType::Q5_1;
    const __m128i qs = load16(b + qh_at + (five_bit ? 4 : 0));
    __m128i lo = nibbles_lo(qs), hi = nibbles_hi(qs);
    if constexpr (five_bit) {
      const uint32_t qh = load_u32(b + qh_at);
      lo = with_bit4(lo, qh);
      hi = with_bit4(hi, qh >> 16);
    }
    const __m128i zp = _mm_set1_epi8(static_cast<char>(zero_point(T)));
    scale_bytes16(_mm_sub_epi8(lo, zp), d, m, out);
    scale_bytes16(_mm_sub_epi8(hi, zp), d, m, out + 16);
  }
}
#endif  // CPU_CAPABILITY_AVX512 || CPU_CAPABILITY_AVX2

// out[e] = scale * q[e] + offset for e < n (n <= 32).
inline void scale_run(const int32_t* q, float scale, float offset, float* out, int n) {
  for (int e = 0; e < n; ++e) out[e] = scale * static_cast<float>(q[e]) + offset;
}

// One 32-element block: decode_block32's values q - zero point, then d * q (+ m).
template <QType T>
inline void dequantize_block32(const uint8_t* b, float* out, int n) {
#if defined(DQ_SIMD)
  if (n == 32) return dequantize_block32_simd<T>(b, out);
#endif
  int32_t q[32];
  float d, m;
  decode_block32<T>(b, q, d, m);
  scale_run(q, d, m, out, n);
}

// One k-quant super-block's integer values (decode_super_values), with a scale and
// offset per 16 elements: value e = scale[e / 16] * q[e] + offset[e / 16].
template <QType T>
inline void decode_super(const uint8_t* b, int32_t* q, float* scale, float* offset) {
  decode_super_values<T>(b, q);
  if constexpr (T == QType::Q6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = fp16(b + 208);
    for (int j = 0; j < 16; ++j) {
      scale[j] = d * static_cast<float>(sc[j]);
      offset[j] = 0.f;
    }
  } else {  // Q4_K, Q5_K
    uint8_t sc[8], mins[8];
    k_scales_mins(b + 4, sc, mins);
    const float d = fp16(b), dmin = fp16(b + 2);
    for (int j = 0; j < 16; ++j) {  // sub-block j / 2 of 32 elements
      scale[j] = d * static_cast<float>(sc[j / 2]);
      offset[j] = -(dmin * static_cast<float>(mins[j / 2]));
    }
  }
}

template <QType T>
inline void dequantize_super(const uint8_t* b, float* out, int n) {
  int32_t q[256];
  float scale[16], offset[16];
  decode_super<T>(b, q, scale, offset);
  for (int j = 0; j * 16 < n; ++j) {
    scale_run(q + 16 * j, scale[j], offset[j], out + 16 * j, std::min(16, n - 16 * j));
  }
}

// The k values of one weight row (ceil(k / block_elements(T)) blocks at `row`).
template <QType T>
inline void dequantize_row(const uint8_t* row, int64_t k, float* out) {
  constexpr int len = block_elements(T);
  for (int64_t start = 0, b = 0; start < k; start += len, ++b) {
    const int n = static_cast<int>(std::min<int64_t>(len, k - start));
    const uint8_t* block = row + b * block_bytes(T);
    if constexpr (is_k_quant(T)) {
      dequantize_super<T>(block, out + start, n);
    } else {
      dequantize_block32<T>(block, out + start, n);
    }
  }
}

}  // namespace pagedserve::quant
