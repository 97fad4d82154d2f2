// swap_blocks: moves whole blocks between a device cache and a pinned host cache (or two
// device caches), one cudaMemcpyAsync per block on the caller's stream. Copies to or from
// pinned memory are asynchronous: synchronize the stream before reading a swapped-out block
// on the host or reusing a swapped-in block's host memory.
#include "common.cuh"

namespace pagedserve {

cudaError_t launch_swap_blocks(const void* src, void* dst, const int64_t* block_mapping,
                               int num_pairs, int64_t block_bytes, cudaMemcpyKind kind,
                               cudaStream_t stream) {
  if (num_pairs < 0 || block_bytes <= 0) return cudaErrorInvalidValue;
  const char* src_bytes = static_cast<const char*>(src);
  char* dst_bytes = static_cast<char*>(dst);
  for (int i = 0; i < num_pairs; ++i) {
    const int64_t from = block_mapping[2 * i] * block_bytes;
    const int64_t to = block_mapping[2 * i + 1] * block_bytes;
    const cudaError_t err =
        cudaMemcpyAsync(dst_bytes + to, src_bytes + from, block_bytes, kind, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace pagedserve
