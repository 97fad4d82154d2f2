// Helpers shared by the native CPU kernels: vector ISA choice, float loads of float32 /
// bfloat16 storage, dtype and head-size dispatch, block-table reads and their checks.
//
// Include this header FIRST in every kernel file: ATen's vec.h picks its vector width
// from the CPU_CAPABILITY_* macros defined here (from what -march=native enables).
#pragma once

#if defined(VECTOR_WIDTH)
#error "include common.h before any ATen header: ATen's vec.h was already configured"
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
// Our own inline namespace for at::vec, so these instantiations never clash with
// libtorch's copies of the same inline functions (built for other ISAs).
#define CPU_CAPABILITY pagedserve_native

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace pagedserve {

using fvec = at::vec::Vectorized<float>;
constexpr int kVec = fvec::size();  // floats per vector: 16 with AVX-512, 8 with AVX2
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A full vector of float32 / bfloat16 storage, as float.
inline fvec load_f(const float* p) { return fvec::loadu(p); }
inline fvec load_f(const at::BFloat16* p) {
  fvec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

// The first n (< kVec) elements, the rest zero: the tail of a head that is not a
// multiple of the vector width.
template <typename T>
inline fvec load_f(const T* p, int n) {
  float buf[kVec] = {};
  for (int i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return fvec::loadu(buf);
}

inline float reduce_add(const fvec& v) {
  return at::vec::vec_reduce_all<float>([](fvec a, fvec b) { return a + b; }, v);
}

inline float reduce_max(const fvec& v) {
  return at::vec::vec_reduce_all<float>(
      [](fvec a, fvec b) { return at::vec::maximum(a, b); }, v);
}

// Calls f(T{}) with T the storage type of `dtype` (float32 or bfloat16).
template <typename F>
inline void dispatch_dtype(at::ScalarType dtype, const char* op, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK_VALUE(false, op, ": dtype ", dtype,
                      " is not supported on CPU; use float32 or bfloat16");
  }
}

// Calls f(std::integral_constant<int, HEAD>) with HEAD the head size where a
// specialization exists, else 0 (the generic path, head size known at run time).
// kEvery false: only 64 and 128 are specialized (for kernels instantiated many times
// over, where each specialization costs build time).
template <bool kEvery = true, typename F>
inline void dispatch_head_size(int64_t head_size, F&& f) {
  if (head_size == 64) return f(std::integral_constant<int, 64>{});
  if (head_size == 128) return f(std::integral_constant<int, 128>{});
  if constexpr (kEvery) {
    if (head_size == 80) return f(std::integral_constant<int, 80>{});
    if (head_size == 96) return f(std::integral_constant<int, 96>{});
  }
  f(std::integral_constant<int, 0>{});
}

// Calls f(std::bool_constant<flag>{}): a run-time flag made a template argument, so the
// code without the feature it turns on is what it was before the feature.
template <typename F>
inline void dispatch_flag(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Copies smaller than this run on one thread: starting the others costs more.
constexpr int64_t kParallelBytes = 1 << 16;

// The largest head size the generic path takes (its rows live in stack arrays).
constexpr int64_t kMaxHeadSize = 512;

// One sequence's row of the block table, int32 or int64.
struct BlockTableRow {
  const void* data;
  bool is64;
  int64_t operator[](int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i]
                : static_cast<const int32_t*>(data)[i];
  }
};

inline BlockTableRow block_table_row(const at::Tensor& block_tables, int64_t seq) {
  const bool is64 = block_tables.scalar_type() == at::kLong;
  const char* base = static_cast<const char*>(block_tables.data_ptr());
  return {base + seq * block_tables.stride(0) * block_tables.element_size(), is64};
}

// Checks, before any parallel region, that every block a sequence reads exists: a bad
// id would otherwise read out of bounds. Sequence s reads positions [first_read(s),
// seq_lens[s]); entries of the blocks wholly before that (behind a sliding window) may
// be anything. O(total blocks read), cheap next to attention.
template <typename F>
inline void check_block_tables(const char* op, const at::Tensor& block_tables,
                               const int64_t* seq_lens, int64_t num_seqs,
                               int64_t block_size, int64_t num_blocks, F&& first_read) {
  const int64_t width = block_tables.size(1);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = seq_lens[s];
    const int64_t need = cdiv(len, block_size);
    TORCH_CHECK_VALUE(len >= 0 && need <= width, op, ": seq_lens[", s, "] = ", len,
                      " needs ", need, " blocks of ", block_size,
                      " tokens; block_tables has ", width, " columns");
    const BlockTableRow row = block_table_row(block_tables, s);
    for (int64_t i = first_read(s) / block_size; i < need; ++i) {
      const int64_t id = row[i];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, op, ": block_tables[", s, ", ", i,
                        "] = ", id, " is not a block of the cache (", num_blocks,
                        " blocks)");
    }
  }
}

// Calls f(pos, slot, n) for each run of positions [pos, pos + n) within [begin, end)
// that share a block, in order; their slots are slot .. slot + n - 1.
template <typename F>
inline void for_each_block(const BlockTableRow& table, int64_t block_size, int64_t begin,
                           int64_t end, F&& f) {
  int64_t pos = begin;
  while (pos < end) {
    const int64_t logical = pos / block_size;
    const int64_t offset = pos - logical * block_size;
    const int64_t n = std::min(block_size - offset, end - pos);
    f(pos, table[logical] * block_size + offset, n);
    pos += n;
  }
}

// Asks for `rows` rows of `bytes` bytes each, `stride` elements apart, to be brought
// into cache ahead of use (kLocality 3: into L1, 2: into L2). Only a hint: never faults.
// Always inlined, as must be every function whose only effect is a prefetch: GCC 12
// takes such a function for const and drops the calls to it (the attention kernels had
// no prefetch instruction left until theirs were inlined).
template <int kLocality, typename T>
[[gnu::always_inline]] inline void prefetch_rows(const T* first, int64_t rows, int64_t stride,
                                                int64_t bytes) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* p = reinterpret_cast<const char*>(first + r * stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, kLocality);
  }
}

}  // namespace pagedserve
