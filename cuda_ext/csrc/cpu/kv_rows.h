// The KV cache's row codecs: how the attention kernels read a cache row as floats and how
// reshape_and_cache writes one. The format and its pure-torch oracle: cuda_ext/kv_quant.py.
//
// A row is one (token, KV head) of a cache, `row_bytes` wide. kv_format 0 (PlainRows<T>)
// is a float cache: head_size values of the query's dtype T, no scale. kv_format 1..3
// (CodedRows<Code>) are 8-bit caches: head_size one-byte codes, then the row's float32
// scale (4 bytes, little-endian), a value being float(code) * scale. Both codecs give:
//
//   kScaled                  whether a row has a scale (false: scale() is never called)
//   load(row, first)         kVec values from element `first` on, as float (unscaled codes)
//   load(row, first, n)      the first n (< kVec) of them, the rest zero
//   scale(row, head_size)    the row's scale
//
// The attention kernels apply a row's scale once per row read, after the widening load
// (attention_tile.h).
#pragma once

#include "common.h"  // first: it picks the vector ISA

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cmath>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace pagedserve {

// What a cache row holds: cuda_ext/kv_quant.py's KVRowCode, 0 for a float cache.
enum class KVFormat : int64_t { kFloat = 0, kInt8 = 1, kFp8E4M3 = 2, kFp8E5M2 = 3 };
constexpr int64_t kScaleBytes = 4;  // the float32 scale ending an 8-bit row

inline bool valid_kv_format(int64_t kv_format) { return kv_format >= 0 && kv_format <= 3; }

// kv_format 0: a row of head_size values of T (float32 or bfloat16).
template <typename T>
struct PlainRows {
  static constexpr bool kScaled = false;
  static fvec load(const uint8_t* row, int64_t first) {
    return load_f(reinterpret_cast<const T*>(row) + first);
  }
  static fvec load(const uint8_t* row, int64_t first, int n) {
    return load_f(reinterpret_cast<const T*>(row) + first, n);
  }
  static float scale(const uint8_t*, int64_t) { return 1.f; }
};

// The three 8-bit codes. Each: kQmax, encode (a float within +-kQmax to its byte),
// decode (a byte to its float, exact), load (kVec bytes to floats, exact).

// A float8 code's exponent and mantissa bits placed at a float's low exponent and high
// mantissa bits read as 2^-kRebias times its value, normals and subnormals alike (a
// subnormal code becomes a subnormal float, exact); then the sign. kShift: 23 minus the
// code's mantissa bits; kRebias: 127 minus the code's exponent bias.
template <int kShift, int kRebias>
inline float decode_float8(uint8_t b) {
  const uint32_t mag = static_cast<uint32_t>(b & 0x7f) << kShift;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  float value;
  std::memcpy(&value, &mag, sizeof value);
  value *= std::ldexp(1.f, kRebias);
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits |= sign;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

struct Int8Code {
  static constexpr float kQmax = 127.f;
  // Round half to even (the default rounding mode), as torch.round.
  static uint8_t encode(float x) {
    return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(x)));
  }
  static float decode(uint8_t b) { return static_cast<float>(static_cast<int8_t>(b)); }
  static fvec load(const uint8_t* p);
};

struct E4M3Code {  // float8_e4m3fn: bits as torch's .to(torch.float8_e4m3fn)
  static constexpr float kQmax = 448.f;
  static uint8_t encode(float x) { return c10::Float8_e4m3fn(x).x; }
  // 0x7f / 0xff (NaN) are never written; they would read as +-480.
  static float decode(uint8_t b) { return decode_float8<20, 120>(b); }
  static fvec load(const uint8_t* p);
};

struct E5M2Code {  // float8_e5m2: bits as torch's .to(torch.float8_e5m2)
  static constexpr float kQmax = 57344.f;
  static uint8_t encode(float x) { return c10::Float8_e5m2(x).x; }
  // Infinities and NaN (exponent bits all set) are never written.
  static float decode(uint8_t b) { return decode_float8<21, 112>(b); }
  static fvec load(const uint8_t* p);
};

// kVec codes decoded one at a time: other ISAs, and the tail of a row.
template <typename Code>
inline fvec decode_codes(const uint8_t* p, int n) {
  float buf[kVec] = {};
  for (int i = 0; i < n; ++i) buf[i] = Code::decode(p[i]);
  return fvec::loadu(buf);
}

#if defined(CPU_CAPABILITY_AVX512)

inline __m128i load_code_bytes(const uint8_t* p) {  // kVec = 16 bytes
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline fvec Int8Code::load(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_code_bytes(p)));
}
// e5m2 is the high byte of an fp16 (the same sign, exponent and bias).
inline fvec E5M2Code::load(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load_code_bytes(p)), 8));
}
// As decode_float8<20, 120>.
inline fvec E4M3Code::load(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(load_code_bytes(p));
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

#elif defined(CPU_CAPABILITY_AVX2)

inline __m128i load_code_bytes(const uint8_t* p) {  // kVec = 8 bytes
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline fvec Int8Code::load(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_code_bytes(p)));
}
inline fvec E5M2Code::load(const uint8_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load_code_bytes(p)), 8));
#else
  return decode_codes<E5M2Code>(p, kVec);
#endif
}
inline fvec E4M3Code::load(const uint8_t* p) {  // as under AVX-512
  const __m256i b = _mm256_cvtepu8_epi32(load_code_bytes(p));
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(value), sign));
}

#else

inline fvec Int8Code::load(const uint8_t* p) { return decode_codes<Int8Code>(p, kVec); }
inline fvec E4M3Code::load(const uint8_t* p) { return decode_codes<E4M3Code>(p, kVec); }
inline fvec E5M2Code::load(const uint8_t* p) { return decode_codes<E5M2Code>(p, kVec); }

#endif

// kv_format 1..3: head_size codes, then the row's float32 scale.
template <typename Code>
struct CodedRows {
  static constexpr bool kScaled = true;
  static fvec load(const uint8_t* row, int64_t first) { return Code::load(row + first); }
  // Through a zeroed buffer (a zero byte is 0 in every code): far less code than n
  // decodes, which GCC unrolled into every vector of the generic path (build time).
  static fvec load(const uint8_t* row, int64_t first, int n) {
    uint8_t buf[kVec] = {};
    std::memcpy(buf, row + first, n);
    return Code::load(buf);
  }
  static float scale(const uint8_t* row, int64_t head_size) {
    float s;
    std::memcpy(&s, row + head_size, sizeof s);
    return s;
  }

  // Codes `x` (head_size values of float32 / bfloat16) into `row`, as
  // cuda_ext.kv_quant.quantize_rows does, bit for bit: float32 math, the scale and its
  // inverse from the row's max magnitude (both 0 when it is under FLT_MIN: the inverse
  // would overflow), each value scaled, clamped to +-kQmax and encoded. A NaN value is
  // coded 0 (the reference leaves non-finite rows unspecified).
  template <typename T>
  static void encode(const T* x, int64_t head_size, uint8_t* row) {
    float amax = 0.f;
    for (int64_t i = 0; i < head_size; ++i) {
      amax = std::max(amax, std::abs(static_cast<float>(x[i])));
    }
    const bool coded = amax >= std::numeric_limits<float>::min();
    const float scale = coded ? amax / Code::kQmax : 0.f;
    const float inv = coded ? Code::kQmax / amax : 0.f;
    for (int64_t i = 0; i < head_size; ++i) {
      const float scaled = static_cast<float>(x[i]) * inv;
      const float kept = scaled == scaled ? scaled : 0.f;  // NaN -> 0
      row[i] = Code::encode(std::min(std::max(kept, -Code::kQmax), Code::kQmax));
    }
    std::memcpy(row + head_size, &scale, sizeof scale);
  }
};

// Calls f(Rows{}) with Rows the codec of `kv_format` (valid: checked by the caller) for
// a query of dtype T.
template <typename T, typename F>
inline void dispatch_kv_rows(int64_t kv_format, F&& f) {
  switch (static_cast<KVFormat>(kv_format)) {
    case KVFormat::kInt8: f(CodedRows<Int8Code>{}); break;
    case KVFormat::kFp8E4M3: f(CodedRows<E4M3Code>{}); break;
    case KVFormat::kFp8E5M2: f(CodedRows<E5M2Code>{}); break;
    default: f(PlainRows<T>{}); break;
  }
}

}  // namespace pagedserve
