// Writes each token's K and V rows into its cache slot (slot < 0: padding, skipped).
// The caches are head-major, [num_blocks, num_kv_heads, block_size, head_size]: a token's
// heads land block_size rows apart. Parallel over tokens; byte copies, so any dtype the
// caches share.
#include "common.h"  // first: it picks the vector ISA
#include "ops.h"

#include <ATen/Parallel.h>

namespace pagedserve {
namespace {

void check_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                        value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(),
                    "reshape_and_cache: caches must be contiguous and alike");
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes() &&
                        key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3) &&
                        key.stride(2) == 1 && value.stride(2) == 1,
                    "reshape_and_cache: key/value must be [num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK_VALUE(key.scalar_type() == key_cache.scalar_type() &&
                        value.scalar_type() == key_cache.scalar_type() &&
                        value_cache.scalar_type() == key_cache.scalar_type(),
                    "reshape_and_cache: key, value and caches must share a dtype");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                        slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                    "reshape_and_cache: slot_mapping must be [num_tokens] int64");
}

// Copies token t's rows of `src` (strided [num_tokens, heads, head_size]) into slot s of
// `cache` (contiguous [num_blocks, heads, block_size, head_size]).
struct RowCopy {
  const char* src;
  int64_t token_stride, head_stride;  // bytes
  char* cache;
  int64_t heads, block_size, row_bytes;

  void operator()(int64_t t, int64_t slot) const {
    const char* from = src + t * token_stride;
    const int64_t block = slot / block_size, offset = slot - block * block_size;
    char* to = cache + (block * heads * block_size + offset) * row_bytes;
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(to + h * block_size * row_bytes, from + h * head_stride, row_bytes);
    }
  }
};

RowCopy row_copy(const at::Tensor& src, const at::Tensor& cache) {
  const int64_t elem = src.element_size();
  return {static_cast<const char*>(src.data_ptr()), src.stride(0) * elem,
          src.stride(1) * elem, static_cast<char*>(cache.data_ptr()), src.size(1),
          cache.size(2), src.size(2) * elem};
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  check_args(key, value, key_cache, value_cache, slot_mapping);
  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ",
                      slots[t], " is past the cache's ", num_slots, " slots");
  }
  const RowCopy copy_key = row_copy(key, key_cache), copy_value = row_copy(value, value_cache);
  const int64_t bytes = 2 * num_tokens * copy_key.heads * copy_key.row_bytes;
#pragma omp parallel for num_threads(at::get_num_threads()) if (bytes > kParallelBytes)
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] < 0) continue;
    copy_key(t, slots[t]);
    copy_value(t, slots[t]);
  }
}

}  // namespace pagedserve
