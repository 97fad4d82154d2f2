// RMSNorm with HF LlamaRMSNorm's rounding: the norm in float32, rounded to the input's
// dtype, then scaled by the weight (one more rounding). The fused variant first adds the
// sublayer output into the residual stream (rounded, as torch's add) and normalizes the
// sum. One row per token; parallel over rows.
#include "elementwise.h"  // first: it picks the vector ISA
#include "ops.h"

#include <cmath>

namespace pagedserve {
namespace {

float inverse_rms(const fvec& sum_of_squares, int64_t d, float eps) {
  return 1.f / std::sqrt(reduce_add(sum_of_squares) / static_cast<float>(d) + eps);
}

// 1 / sqrt(mean(x^2) + eps) of one row, in float32.
template <typename T>
float inverse_rms(const T* x, int64_t d, float eps) {
  fvec acc(0.f);
  for (int64_t i = 0; i < d; i += kVec) {
    const fvec v = load_n(x + i, std::min<int64_t>(kVec, d - i));
    acc = at::vec::fmadd(v, v, acc);
  }
  return inverse_rms(acc, d, eps);
}

// out = weight * rounded(x * inv_rms); out may be x.
template <typename T>
void scale_row(T* out, const T* x, const T* weight, int64_t d, float inv_rms) {
  const fvec r(inv_rms);
  for (int64_t i = 0; i < d; i += kVec) {
    const int64_t n = std::min<int64_t>(kVec, d - i);
    store_n(out + i, load_n(weight + i, n) * rounded<T>(load_n(x + i, n) * r), n);
  }
}

// residual = rounded(residual + x), in place; returns the new residual's inverse RMS.
template <typename T>
float add_row(T* residual, const T* x, int64_t d, float eps) {
  fvec acc(0.f);
  for (int64_t i = 0; i < d; i += kVec) {
    const int64_t n = std::min<int64_t>(kVec, d - i);
    const fvec sum = rounded<T>(load_n(residual + i, n) + load_n(x + i, n));
    store_n(residual + i, sum, n);
    acc = at::vec::fmadd(sum, sum, acc);  // lanes past n hold 0 + 0
  }
  return inverse_rms(acc, d, eps);
}

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                     const at::Tensor& other, const char* other_name) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(x.dim() == 2 && is_rows(x, x.size(0), x.size(1)), op,
                    ": x must be [num_tokens, hidden_size] with unit last stride");
  TORCH_CHECK_VALUE(is_rows(other, x.size(0), x.size(1)) &&
                        other.scalar_type() == x.scalar_type(),
                    op, ": ", other_name, " must be like x");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1) &&
                        weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                        weight.device().is_cpu(),
                    op, ": weight must be [hidden_size] of x's dtype, contiguous");
}

}  // namespace

void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
              double eps) {
  check_norm_args("rms_norm", x, weight, out, "out");
  const int64_t rows = x.size(0), d = x.size(1);
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> src(x), dst(out);
    const T* w = static_cast<const T*>(weight.data_ptr());
    for_each_row(rows, 2 * x.numel() * x.element_size(), [&](int64_t r) {
      scale_row(dst[r], src[r], w, d, inverse_rms(src[r], d, static_cast<float>(eps)));
    });
  });
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                        const at::Tensor& weight, double eps) {
  check_norm_args("fused_add_rms_norm", x, weight, residual, "residual");
  const int64_t rows = x.size(0), d = x.size(1);
  dispatch_dtype(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> xs(x), res(residual);
    const T* w = static_cast<const T*>(weight.data_ptr());
    for_each_row(rows, 3 * x.numel() * x.element_size(), [&](int64_t r) {
      const float inv_rms = add_row(res[r], xs[r], d, static_cast<float>(eps));
      scale_row(xs[r], res[r], w, d, inv_rms);
    });
  });
}

}  // namespace pagedserve
