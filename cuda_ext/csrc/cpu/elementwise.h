// Helpers of the row-wise elementwise kernels (RMSNorm, SiLU-and-mul, rotary): float
// vectors in and out of float32 / bfloat16 rows with a tail, rounding to the storage
// precision, rows of a strided 2-D tensor, and a parallel loop over rows.
//
// Rounding: torch rounds every intermediate of an elementwise op chain to the tensor's
// dtype; `rounded<T>` does the same where a kernel must reproduce such a chain (HF's
// RMSNorm and rotary in bfloat16). In float32 it is the identity.
#pragma once

#include "common.h"  // first: it picks the vector ISA

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional_bfloat16.h>

#include <tuple>

namespace pagedserve {

// n (<= kVec) elements of p as floats; the rest zero.
template <typename T>
inline fvec load_n(const T* p, int64_t n) {
  return n == kVec ? load_f(p) : load_f(p, static_cast<int>(n));
}

// Stores the first n (<= kVec) lanes of v into p, rounded to T.
inline void store_n(float* p, const fvec& v, int64_t n) { v.store(p, static_cast<int>(n)); }
inline void store_n(at::BFloat16* p, const fvec& v, int64_t n) {
  at::vec::convert_from_float<at::BFloat16>(v, v).store(p, static_cast<int>(n));
}

// v rounded to T's precision (round to nearest even), as float.
template <typename T>
inline fvec rounded(const fvec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// Row r of a 2-D tensor with unit stride in the last dim.
template <typename T>
struct Rows {
  T* data;
  int64_t stride;  // elements between rows

  explicit Rows(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())), stride(t.stride(0)) {}
  T* operator[](int64_t r) const { return data + r * stride; }
};

// Calls f(r) for r in [0, rows); on every thread when the op moves more than
// kParallelBytes (below that, starting the threads costs more than the work).
template <typename F>
inline void for_each_row(int64_t rows, int64_t bytes, F&& f) {
#pragma omp parallel for num_threads(at::get_num_threads()) if (bytes > kParallelBytes)
  for (int64_t r = 0; r < rows; ++r) f(r);
}

// True where `t` is a CPU [rows, cols] with unit stride in the last dim and rows that
// do not overlap (any row stride from cols up), so that rows can be written in parallel.
inline bool is_rows(const at::Tensor& t, int64_t rows, int64_t cols) {
  return t.device().is_cpu() && t.dim() == 2 && t.size(0) == rows && t.size(1) == cols &&
         (cols <= 1 || t.stride(1) == 1) && (rows <= 1 || t.stride(0) >= cols);
}

}  // namespace pagedserve
