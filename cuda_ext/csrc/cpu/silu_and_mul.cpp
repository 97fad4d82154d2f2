// SwiGLU's activation: out = silu(gate) * up for gate_up = [gate | up], rounded as
// torch's `F.silu(gate) * up` rounds (silu to the dtype, then the product). One row per
// token; parallel over rows.
#include "elementwise.h"  // first: it picks the vector ISA
#include "ops.h"

namespace pagedserve {
namespace {

// silu(g) = g / (1 + exp(-g)), torch's formula (and its exp).
inline fvec silu(const fvec& g) { return g / (fvec(1.f) + g.neg().exp()); }

template <typename T>
void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t d) {
  for (int64_t i = 0; i < d; i += kVec) {
    const int64_t n = std::min<int64_t>(kVec, d - i);
    store_n(out + i, rounded<T>(silu(load_n(gate + i, n))) * load_n(up + i, n), n);
  }
}

}  // namespace

void silu_and_mul(const at::Tensor& out, const at::Tensor& gate_up) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                        is_rows(gate_up, gate_up.size(0), gate_up.size(1)),
                    "silu_and_mul: gate_up must be [num_tokens, 2 * d] with unit last stride");
  const int64_t rows = gate_up.size(0), d = gate_up.size(1) / 2;
  TORCH_CHECK_VALUE(is_rows(out, rows, d) && out.scalar_type() == gate_up.scalar_type(),
                    "silu_and_mul: out must be [num_tokens, d] of gate_up's dtype");
  dispatch_dtype(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const Rows<T> src(gate_up), dst(out);
    for_each_row(rows, 3 * out.numel() * out.element_size(), [&](int64_t r) {
      silu_and_mul_row(dst[r], src[r], src[r] + d, d);
    });
  });
}

}  // namespace pagedserve
