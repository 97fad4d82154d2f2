// Copies blocks of one cache into blocks of another with the same block shape (swap out
// to, or in from, a CPU swap cache). Parallel over pairs; byte copies.
#include "common.h"  // first: it picks the vector ISA
#include "ops.h"

#include <ATen/Parallel.h>

namespace pagedserve {
void swap_blocks(const at::Tensor& src, const at::Tensor& dst, const at::Tensor& block_mapping) {
  // Structural guards for callers that bypass cuda_ext.native_cpu (which explains them).
  TORCH_CHECK_VALUE(src.dim() >= 1 && dst.dim() == src.dim() &&
                        src.sizes().slice(1) == dst.sizes().slice(1) &&
                        src.scalar_type() == dst.scalar_type() && src.is_contiguous() &&
                        dst.is_contiguous() && src.device().is_cpu() && dst.device().is_cpu(),
                    "swap_blocks: src and dst must be contiguous CPU tensors of one dtype "
                    "and block shape");
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2 &&
                        block_mapping.scalar_type() == at::kLong &&
                        block_mapping.is_contiguous(),
                    "swap_blocks: block_mapping must be [num_pairs, 2] int64");
  const int64_t pairs = block_mapping.size(0);
  const int64_t* mapping = block_mapping.data_ptr<int64_t>();
  const int64_t src_blocks = src.size(0), dst_blocks = dst.size(0);
  for (int64_t i = 0; i < pairs; ++i) {
    TORCH_CHECK_VALUE(mapping[2 * i] >= 0 && mapping[2 * i] < src_blocks,
                      "swap_blocks: block_mapping[", i, ", 0] = ", mapping[2 * i],
                      " is not a block of src (", src_blocks, " blocks)");
    TORCH_CHECK_VALUE(mapping[2 * i + 1] >= 0 && mapping[2 * i + 1] < dst_blocks,
                      "swap_blocks: block_mapping[", i, ", 1] = ", mapping[2 * i + 1],
                      " is not a block of dst (", dst_blocks, " blocks)");
  }
  if (pairs == 0 || src_blocks == 0) return;
  const int64_t block_bytes = src.nbytes() / src_blocks;
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(dst.data_ptr());
#pragma omp parallel for num_threads(at::get_num_threads()) if (pairs * block_bytes > kParallelBytes)
  for (int64_t i = 0; i < pairs; ++i) {
    std::memcpy(to + mapping[2 * i + 1] * block_bytes, from + mapping[2 * i] * block_bytes,
                block_bytes);
  }
}

}  // namespace pagedserve
