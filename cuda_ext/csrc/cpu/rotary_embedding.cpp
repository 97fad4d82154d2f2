// Rotate-half (GPT-NeoX) rotary embedding of query and key heads, in place:
//   x1, x2 = x[:d/2], x[d/2:];  x = [x1*cos - x2*sin, x2*cos + x1*sin]
// with cos and sin read at the token's position and rounded to the heads' dtype, and
// each product and sum rounded as torch's `x * cos + rotate_half(x) * sin` rounds them.
// One token (all its query and key heads) per task; parallel over tokens.
#include "elementwise.h"  // first: it picks the vector ISA
#include "ops.h"

namespace pagedserve {
namespace {

// One head of T, rotated by the angles of `cos`/`sin` (the first half of a table row).
template <typename T, typename C>
void rotate_head(T* x, const C* cos, const C* sin, int64_t half) {
  for (int64_t i = 0; i < half; i += kVec) {
    const int64_t n = std::min<int64_t>(kVec, half - i);
    const fvec c = rounded<T>(load_n(cos + i, n)), s = rounded<T>(load_n(sin + i, n));
    const fvec x1 = load_n(x + i, n), x2 = load_n(x + half + i, n);
    store_n(x + i, rounded<T>(x1 * c) - rounded<T>(x2 * s), n);
    store_n(x + half + i, rounded<T>(x2 * c) + rounded<T>(x1 * s), n);
  }
}

// [num_tokens, heads, head_size] heads with unit last stride, rows that do not overlap.
bool is_heads(const at::Tensor& t, int64_t tokens, int64_t head_size) {
  if (!t.device().is_cpu() || t.dim() != 3 || t.size(0) != tokens || t.size(2) != head_size) {
    return false;
  }
  const int64_t heads = t.size(1);
  return t.stride(2) == 1 && (heads <= 1 || t.stride(1) >= head_size) &&
         (tokens <= 1 || t.stride(0) >= heads * std::max(t.stride(1), head_size));
}

// The heads of one token of a [num_tokens, heads, head_size] tensor.
template <typename T>
struct Heads {
  T* data;
  int64_t count, token_stride, head_stride;

  explicit Heads(const at::Tensor& t)
      : data(static_cast<T*>(t.data_ptr())),
        count(t.size(1)),
        token_stride(t.stride(0)),
        head_stride(t.stride(1)) {}
  T* operator()(int64_t token, int64_t head) const {
    return data + token * token_stride + head * head_stride;
  }
};

template <typename T, typename C>
void rotate_all(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = query.size(2) / 2, row = cos.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const C* cos_table = static_cast<const C*>(cos.data_ptr());
  const C* sin_table = static_cast<const C*>(sin.data_ptr());
  const Heads<T> q(query), k(key);
  const int64_t bytes = 2 * (query.numel() + key.numel()) * query.element_size();
  for_each_row(query.size(0), bytes, [&](int64_t t) {
    const C* c = cos_table + pos[t] * row;
    const C* s = sin_table + pos[t] * row;
    for (int64_t h = 0; h < q.count; ++h) rotate_head(q(t, h), c, s, half);
    for (int64_t h = 0; h < k.count; ++h) rotate_head(k(t, h), c, s, half);
  });
}

void check_args(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                const at::Tensor& cos, const at::Tensor& sin) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                        positions.is_contiguous() && positions.device().is_cpu(),
                    "rotary_embedding: positions must be [num_tokens] int64");
  const int64_t tokens = positions.size(0);
  TORCH_CHECK_VALUE(query.dim() == 3 && query.size(2) % 2 == 0 &&
                        is_heads(query, tokens, query.size(2)) &&
                        is_heads(key, tokens, query.size(2)) &&
                        key.scalar_type() == query.scalar_type(),
                    "rotary_embedding: query and key must be [num_tokens, heads, head_size] "
                    "of one dtype, head_size even, rows that do not overlap");
  TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(1) == query.size(2) && cos.is_contiguous() &&
                        sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                        sin.scalar_type() == cos.scalar_type() && cos.device().is_cpu() &&
                        sin.device().is_cpu() &&
                        (cos.scalar_type() == at::kFloat ||
                         cos.scalar_type() == query.scalar_type()),
                    "rotary_embedding: cos and sin must be contiguous [max_positions, "
                    "head_size], float32 or the query's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK_VALUE(pos[t] >= 0 && pos[t] < cos.size(0), "rotary_embedding: positions[",
                      t, "] = ", pos[t], " is outside the tables' ", cos.size(0),
                      " positions");
  }
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                      const at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin) {
  check_args(positions, query, key, cos, sin);
  dispatch_dtype(query.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    if (cos.scalar_type() == at::kFloat) {
      rotate_all<T, float>(positions, query, key, cos, sin);
    } else {
      rotate_all<T, T>(positions, query, key, cos, sin);
    }
  });
}

}  // namespace pagedserve
