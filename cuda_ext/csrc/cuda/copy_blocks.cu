// copy_blocks: copy-on-write of whole blocks, every layer's K and V cache, in one launch.
//
// Grid (pair, layer); each thread block copies block src -> dst of one layer's key cache
// and value cache. The caches are reached through device arrays of their addresses, so the
// layer count costs no launches. Blocks are copied as raw bytes (any dtype, any layout
// whose blocks are block_bytes apart), 16 bytes at a time when block_bytes allows.
#include "common.cuh"

namespace pagedserve {
namespace {

constexpr int kCopyThreads = 256;

template <typename Word>
__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(
    const int64_t* __restrict__ key_cache_ptrs,    // [num_layers] addresses
    const int64_t* __restrict__ value_cache_ptrs,  // [num_layers] addresses
    const int64_t* __restrict__ block_mapping,     // [num_pairs, 2] (src, dst)
    int64_t block_words) {
  const int pair = blockIdx.x;
  const int layer = blockIdx.y;
  const int64_t src = block_mapping[2 * static_cast<int64_t>(pair)] * block_words;
  const int64_t dst = block_mapping[2 * static_cast<int64_t>(pair) + 1] * block_words;
  Word* key_cache = reinterpret_cast<Word*>(key_cache_ptrs[layer]);
  Word* value_cache = reinterpret_cast<Word*>(value_cache_ptrs[layer]);
  for (int64_t i = threadIdx.x; i < block_words; i += kCopyThreads) {
    key_cache[dst + i] = key_cache[src + i];
    value_cache[dst + i] = value_cache[src + i];
  }
}

}  // namespace

cudaError_t launch_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                               const int64_t* block_mapping, int num_layers, int num_pairs,
                               int64_t block_bytes, cudaStream_t stream) {
  if (num_layers == 0 || num_pairs == 0) return cudaSuccess;
  if (num_layers < 0 || num_layers > 65535 || num_pairs < 0 || block_bytes <= 0) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(num_pairs, num_layers);
  if (block_bytes % sizeof(uint4) == 0) {  // the caller guarantees 16-byte aligned caches
    copy_blocks_kernel<uint4><<<grid, kCopyThreads, 0, stream>>>(
        key_cache_ptrs, value_cache_ptrs, block_mapping, block_bytes / sizeof(uint4));
  } else {
    copy_blocks_kernel<unsigned char><<<grid, kCopyThreads, 0, stream>>>(
        key_cache_ptrs, value_cache_ptrs, block_mapping, block_bytes);
  }
  return cudaGetLastError();
}

}  // namespace pagedserve
