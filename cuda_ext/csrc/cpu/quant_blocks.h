// GGUF (ggml) quantized blocks as the matmul kernel reads them: the types and their byte
// layouts, the activation blocks a call quantizes x into, and the portable scalar dot
// products (the whole kernel where there is no AVX2, the tail blocks where there is).
//
// Weight blocks (ggml's layouts; fp16 = IEEE half; element e of a block, values q):
//   Q8_0 (34 B / 32): d fp16 | q int8[32]                      w = d * q
//   Q4_0 (18 B / 32): d | qs[16]: e < 16 low nibble of qs[e], else high of qs[e - 16];
//                     w = d * (q - 8)
//   Q4_1 (20 B / 32): d | m fp16 | qs[16]                      w = d * q + m
//   Q5_0 (22 B / 32): d | qh u32 (bit e: q's bit 4) | qs[16]   w = d * (q - 16)
//   Q5_1 (24 B / 32): d | m | qh | qs[16]                      w = d * q + m
//   Q4_K (144 B / 256): d | dmin fp16 | 12 B of 6-bit scales and mins of 8 sub-blocks of
//                     32 | qs[128]: 32-byte group g holds sub-block 2g in its low
//                     nibbles, 2g + 1 in its high ones; w = d * sc_j * q - dmin * m_j
//   Q5_K (176 B / 256): Q4_K's d, dmin, scales | qh[32] (bit j of qh[l]: q's bit 4 of
//                     element 32j + l) | qs[128]
//   Q6_K (210 B / 256): ql[128] | qh[64] | sc int8[16] (one per 16 elements) | d fp16;
//                     half h (128 elements): element 128h + 32s + l has low bits from
//                     ql[64h + 32(s & 1) + l] (low nibble for s < 2, else high) and high
//                     bits (qh[32h + l] >> 2s) & 3; w = d * sc * (q - 32)
#pragma once

#include "common.h"  // first: it picks the vector ISA

#include <c10/util/Half.h>

#include <cmath>

namespace pagedserve::quant {

// ggml's type ids (gguf.GGMLQuantizationType).
enum class QType : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
};

constexpr bool is_k_quant(QType t) {
  return t == QType::Q4_K || t == QType::Q5_K || t == QType::Q6_K;
}
constexpr int block_elements(QType t) { return is_k_quant(t) ? 256 : 32; }
constexpr int block_bytes(QType t) {
  switch (t) {
    case QType::Q4_0: return 18;
    case QType::Q4_1: return 20;
    case QType::Q5_0: return 22;
    case QType::Q5_1: return 24;
    case QType::Q8_0: return 34;
    case QType::Q4_K: return 144;
    case QType::Q5_K: return 176;
    case QType::Q6_K: return 210;
  }
  return 0;
}
constexpr bool has_min(QType t) { return t == QType::Q4_1 || t == QType::Q5_1; }
// The offset the _0 types subtract from their unsigned values (Q8_0's values are signed).
constexpr int zero_point(QType t) {
  return t == QType::Q4_0 ? 8 : t == QType::Q5_0 ? 16 : 0;
}

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------- activation blocks

// Four activation blocks of 32 (128 elements), as the 32-element types' kernels read
// them: block j's int8 values q (x ~ d * q) split into halves so that one vector of
// weight nibbles (elements 0..15 of 4 blocks, or 16..31) meets its activations in place.
// Int32 lane l of a dot product over lo/hi sums bytes 4l..4l+3: it belongs to block l/4.
struct alignas(64) ActGroup {
  int8_t lo[64];    // block j's elements 0..15 at [16j, 16j + 16)
  int8_t hi[64];    // block j's elements 16..31 at [16j, 16j + 16)
  float d[16];      // block j's scale in lanes 4j..4j + 3
  // Per lane l, from s = the sum of the 8 activation bytes lane l sums:
  //   Q4_0, Q5_0, Q8_0 (VNNI): int32 -zero_point * s (-128 * s for Q8_0), the start of
  //     the integer dot product of unsigned weights (Q8_0's with 128 added);
  //   Q4_1, Q5_1: float d * s, which the min multiplies.
  int32_t aux[16];
};
static_assert(sizeof(ActGroup) == 256, "ActGroup is 4 cache lines");

inline int8_t group_value(const ActGroup& g, int j, int e) {
  return e < 16 ? g.lo[16 * j + e] : g.hi[16 * j + e - 16];
}

// One activation block of 256 for the k-quants (llama.cpp's Q8_K, laid out our way).
// Q6_K reads q in element order. Q4_K and Q5_K read it permuted so that one 64-byte load
// of weight nibbles meets its activations in place: for each half h (elements 128h ..),
// bytes [128h, 128h + 64) hold the elements of the low nibbles of qs groups 2h and 2h + 1
// (sub-blocks 4h, 4h + 2), bytes [128h + 64, 128h + 128) those of the high nibbles
// (sub-blocks 4h + 1, 4h + 3).
struct alignas(64) ActSuper {
  int8_t q[256];
  int16_t sums[16];  // Q6_K: sums of q over each 16 elements; Q4_K/Q5_K: over each 32 (8)
  float d;
  int8_t pad[28];
};
static_assert(sizeof(ActSuper) == 320, "ActSuper is 5 cache lines");

// Where element e of a super-block sits in ActSuper::q for qtype t.
constexpr int super_position(QType t, int e) {
  if (t == QType::Q6_K) return e;
  const int g = e / 64, in_group = e % 64, high = in_group / 32, l = in_group % 32;
  return 128 * (g / 2) + 64 * high + 32 * (g % 2) + l;
}

// ---------------------------------------------------------------- portable dot products

// The 32-element types' weight values of one block as signed ints (the zero point
// subtracted) and its scale d (and min m for Q4_1 / Q5_1).
template <QType T>
inline void decode_block32(const uint8_t* b, int32_t* q, float& d, float& m) {
  d = fp16(b);
  m = has_min(T) ? fp16(b + 2) : 0.f;
  if constexpr (T == QType::Q8_0) {
    for (int e = 0; e < 32; ++e) q[e] = static_cast<int8_t>(b[2 + e]);
  } else {
    constexpr int qh_at = has_min(T) ? 4 : 2;
    constexpr bool five_bit = T == QType::Q5_0 || T == QType::Q5_1;
    const uint8_t* qs = b + qh_at + (five_bit ? 4 : 0);
    const uint32_t qh = five_bit ? load_u32(b + qh_at) : 0;
    for (int e = 0; e < 32; ++e) {
      const int nibble = e < 16 ? qs[e] & 0x0F : qs[e - 16] >> 4;
      q[e] = (nibble | static_cast<int>((qh >> e) & 1) << 4) - zero_point(T);
    }
  }
}

// One weight block (32 elements) dotted with activation block j of group g.
template <QType T>
inline float dot_block32(const uint8_t* b, const ActGroup& g, int j) {
  int32_t q[32];
  float d, m;
  decode_block32<T>(b, q, d, m);
  int32_t sum = 0, sum_a = 0;
  for (int e = 0; e < 32; ++e) {
    const int32_t a = group_value(g, j, e);
    sum += q[e] * a;
    sum_a += a;
  }
  const float dx = g.d[4 * j];
  return d * dx * static_cast<float>(sum) + m * dx * static_cast<float>(sum_a);
}

// Q4_K / Q5_K's 6-bit scales (bytes 0..7) and mins (8..15) of the 8 sub-blocks.
inline void k_scales_mins(const uint8_t* s, uint8_t* sc, uint8_t* mins) {
  const uint32_t u0 = load_u32(s), u1 = load_u32(s + 4), u2 = load_u32(s + 8);
  const uint32_t words[4] = {
      u0 & 0x3F3F3F3Fu, (u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u),  // scales
      u1 & 0x3F3F3F3Fu, ((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u)};  // mins
  std::memcpy(sc, words, 8);
  std::memcpy(mins, words + 2, 8);
}

// A k-quant super-block's 256 integer values in element order: Q6_K's with its zero
// point 32 subtracted, Q4_K's and Q5_K's unsigned (their mins apply per sub-block).
template <QType T>
inline void decode_super_values(const uint8_t* b, int32_t* q) {
  if constexpr (T == QType::Q6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, s = e % 128 / 32, l = e % 32;
      const int byte = ql[64 * h + 32 * (s & 1) + l];
      const int low = s < 2 ? byte & 0x0F : byte >> 4;
      const int high = (qh[32 * h + l] >> (2 * s)) & 3;
      q[e] = (low | high << 4) - 32;
    }
  } else {
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (T == QType::Q5_K ? 48 : 16);
    for (int e = 0; e < 256; ++e) {
      const int j = e / 32, l = e % 32;
      const int byte = qs[32 * (j / 2) + l];
      int v = j % 2 ? byte >> 4 : byte & 0x0F;
      if constexpr (T == QType::Q5_K) v |= ((qh[l] >> j) & 1) << 4;
      q[e] = v;
    }
  }
}

// One k-quant super-block dotted with its activation block.
template <QType T>
inline float dot_super(const uint8_t* b, const ActSuper& a) {
  int32_t q[256];
  decode_super_values<T>(b, q);
  if constexpr (T == QType::Q6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) {
      int32_t part = 0;
      for (int e = 16 * j; e < 16 * j + 16; ++e) part += q[e] * a.q[e];
      sum += sc[j] * part;
    }
    return fp16(b + 208) * a.d * static_cast<float>(sum);
  } else {
    uint8_t sc[8], mins[8];
    k_scales_mins(b + 4, sc, mins);
    int32_t sum = 0, sum_min = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t part = 0;
      for (int e = 32 * j; e < 32 * j + 32; ++e) part += q[e] * a.q[super_position(T, e)];
      sum += sc[j] * part;
      sum_min += mins[j] * a.sums[j];
    }
    return fp16(b) * a.d * static_cast<float>(sum) -
           fp16(b + 2) * a.d * static_cast<float>(sum_min);
  }
}

}  // namespace pagedserve::quant
