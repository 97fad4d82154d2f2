// Copies whole blocks within each layer's K and V cache (copy-on-write), every layer and
// every (src, dst) pair in one call. Parallel over caches x pairs; byte copies.
#include "common.h"  // first: it picks the vector ISA
#include "ops.h"

#include <ATen/Parallel.h>

namespace pagedserve {
namespace {

void check_cache(const at::Tensor& cache, const at::Tensor& first, const char* name,
                 size_t layer) {
  TORCH_CHECK_VALUE(cache.device().is_cpu() && cache.is_contiguous() &&
                        cache.scalar_type() == first.scalar_type() &&
                        cache.sizes() == first.sizes(),
                    "copy_blocks: ", name, "[", layer, "] must be a contiguous CPU tensor ",
                    "of the shape and dtype of key_caches[0] (", first.sizes(), ", ",
                    first.scalar_type(), "); got ", cache.sizes(), ", ", cache.scalar_type(),
                    cache.is_contiguous() ? "" : ", not contiguous", " on ", cache.device());
}

}  // namespace

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK_VALUE(key_caches.size() == value_caches.size(), "copy_blocks: ",
                    key_caches.size(), " key caches but ", value_caches.size(),
                    " value caches");
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2 &&
                        block_mapping.scalar_type() == at::kLong &&
                        block_mapping.is_contiguous(),
                    "copy_blocks: block_mapping must be [num_pairs, 2] int64");
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  TORCH_CHECK_VALUE(key_caches[0].dim() >= 1, "copy_blocks: caches need a block dimension");
  std::vector<char*> caches;
  for (size_t layer = 0; layer < key_caches.size(); ++layer) {
    check_cache(key_caches[layer], key_caches[0], "key_caches", layer);
    check_cache(value_caches[layer], key_caches[0], "value_caches", layer);
    caches.push_back(static_cast<char*>(key_caches[layer].data_ptr()));
    caches.push_back(static_cast<char*>(value_caches[layer].data_ptr()));
  }
  const at::Tensor& first = key_caches[0];
  const int64_t num_blocks = first.size(0);
  const int64_t block_bytes = num_blocks == 0 ? 0 : first.nbytes() / num_blocks;
  const int64_t pairs = block_mapping.size(0);
  const int64_t* mapping = block_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < 2 * pairs; ++i) {
    TORCH_CHECK_VALUE(mapping[i] >= 0 && mapping[i] < num_blocks, "copy_blocks: block_mapping[",
                      i / 2, ", ", i % 2, "] = ", mapping[i], " is not a block of the caches (",
                      num_blocks, " blocks)");
  }
  const int64_t items = static_cast<int64_t>(caches.size()) * pairs;
#pragma omp parallel for num_threads(at::get_num_threads()) \
    if (items * block_bytes > kParallelBytes)
  for (int64_t item = 0; item < items; ++item) {
    char* cache = caches[item / pairs];
    const int64_t* pair = mapping + 2 * (item % pairs);
    std::memcpy(cache + pair[1] * block_bytes, cache + pair[0] * block_bytes, block_bytes);
  }
}

}  // namespace pagedserve
