// Writes each token's K and V rows into its cache slot (slot < 0: padding, skipped).
// The caches are head-major, [num_blocks, num_kv_heads, block_size, row]: a token's heads
// land block_size rows apart. Parallel over tokens. kv_format 0: byte copies, so any
// dtype the caches share; 1..3: each row coded into head_size 8-bit codes and its scale
// (kv_rows.h; bit for bit cuda_ext.kv_quant.quantize_rows).
#include "kv_rows.h"  // first (through common.h): it picks the vector ISA
#include "ops.h"

#include <ATen/Parallel.h>

namespace pagedserve {
namespace {

void check_args(const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
                const at::Tensor& value_cache, const at::Tensor& slot_mapping,
                int64_t kv_format) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.is_contiguous() &&
                        value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous(),
                    "reshape_and_cache: caches must be contiguous and alike");
  TORCH_CHECK_VALUE(valid_kv_format(kv_format),
                    "reshape_and_cache: kv_format must be 0 (float cache), 1 (int8), 2 "
                    "(float8_e4m3fn) or 3 (float8_e5m2); got ", kv_format);
  const bool plain = kv_format == 0;
  const int64_t row = key.dim() == 3 ? key.size(2) + (plain ? 0 : kScaleBytes) : -1;
  TORCH_CHECK_VALUE(key.dim() == 3 && value.sizes() == key.sizes() &&
                        key.size(1) == key_cache.size(1) && row == key_cache.size(3) &&
                        key.stride(2) == 1 && value.stride(2) == 1,
                    "reshape_and_cache: key/value must be [num_tokens, num_kv_heads, head_size]",
                    plain ? "" : " with cache rows of head_size + 4 bytes");
  if (plain) {
    TORCH_CHECK_VALUE(key.scalar_type() == key_cache.scalar_type() &&
                          value.scalar_type() == key_cache.scalar_type() &&
                          value_cache.scalar_type() == key_cache.scalar_type(),
                      "reshape_and_cache: key, value and caches must share a dtype");
  } else {
    TORCH_CHECK_VALUE((key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16) &&
                          value.scalar_type() == key.scalar_type() &&
                          key_cache.scalar_type() == at::kByte &&
                          value_cache.scalar_type() == at::kByte,
                      "reshape_and_cache: 8-bit caches take float32 or bfloat16 key/value "
                      "into uint8 caches");
  }
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                        slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                    "reshape_and_cache: slot_mapping must be [num_tokens] int64");
}

// Writes token t's rows of `src` (strided [num_tokens, heads, head_size]) into slot s of
// `cache` (contiguous [num_blocks, heads, block_size, row_bytes] bytes), each row through
// `write(from, to)`: a byte copy, or an 8-bit codec's encode.
struct RowWrite {
  const char* src;
  int64_t token_stride, head_stride;  // bytes
  char* cache;
  int64_t heads, block_size, row_bytes;

  template <typename F>
  void operator()(int64_t t, int64_t slot, F&& write) const {
    const char* from = src + t * token_stride;
    const int64_t block = slot / block_size, offset = slot - block * block_size;
    char* to = cache + (block * heads * block_size + offset) * row_bytes;
    for (int64_t h = 0; h < heads; ++h) {
      write(from + h * head_stride, to + h * block_size * row_bytes);
    }
  }
};

RowWrite row_write(const at::Tensor& src, const at::Tensor& cache) {
  const int64_t elem = src.element_size();
  return {static_cast<const char*>(src.data_ptr()), src.stride(0) * elem,
          src.stride(1) * elem, static_cast<char*>(cache.data_ptr()), src.size(1),
          cache.size(2), cache.size(3) * cache.element_size()};
}

// Coding rows costs 13x (int8) to 45x (e4m3) copying them, per byte written. At 16, a
// decode batch of 64 tokens, 3 KV heads of 64, takes both threads (e4m3: 61 -> 28 us).
constexpr int64_t kCodingCost = 16;

// Calls write(t, slot) for every token with a slot, in parallel when `cost` (bytes
// written, weighted) is large.
template <typename F>
void for_each_slot(const int64_t* slots, int64_t num_tokens, int64_t cost, F&& write) {
#pragma omp parallel for num_threads(at::get_num_threads()) if (cost > kParallelBytes)
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slots[t] >= 0) write(t, slots[t]);
  }
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& slot_mapping, int64_t kv_format) {
  check_args(key, value, key_cache, value_cache, slot_mapping, kv_format);
  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ",
                      slots[t], " is past the cache's ", num_slots, " slots");
  }
  const RowWrite keys = row_write(key, key_cache), values = row_write(value, value_cache);
  const int64_t bytes = 2 * num_tokens * keys.heads * keys.row_bytes;
  if (kv_format == 0) {
    const int64_t row_bytes = keys.row_bytes;
    const auto copy = [row_bytes](const char* from, char* to) {
      std::memcpy(to, from, row_bytes);
    };
    for_each_slot(slots, num_tokens, bytes, [&](int64_t t, int64_t slot) {
      keys(t, slot, copy);
      values(t, slot, copy);
    });
    return;
  }
  const int64_t head_size = key.size(2);
  dispatch_dtype(key.scalar_type(), "reshape_and_cache", [&](auto tag) {
    using T = decltype(tag);
    dispatch_kv_rows<T>(kv_format, [&](auto rows) {
      using Rows = decltype(rows);
      if constexpr (Rows::kScaled) {
        const auto encode = [head_size](const char* from, char* to) {
          Rows::encode(reinterpret_cast<const T*>(from), head_size,
                       reinterpret_cast<uint8_t*>(to));
        };
        for_each_slot(slots, num_tokens, kCodingCost * bytes, [&](int64_t t, int64_t slot) {
          keys(t, slot, encode);
          values(t, slot, encode);
        });
      }
    });
  });
}

}  // namespace pagedserve
