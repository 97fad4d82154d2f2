// paged_attention v1: decode attention in one pass, one thread block per (head, sequence)
// over the whole context (the kernel is in paged_attention.cuh). Best when num_seqs *
// num_heads alone fills the GPU or contexts are short.
#include "paged_attention.cuh"

namespace pagedserve {

cudaError_t launch_paged_attention_v1(void* out, const void* query, int64_t query_stride,
                                      const void* key_cache, const void* value_cache,
                                      const int* block_tables, const int* seq_lens,
                                      int num_seqs, int num_heads, int num_kv_heads,
                                      int head_size, int block_size, int max_blocks_per_seq,
                                      float scale, const AttentionFeatures& features,
                                      DType dtype, cudaStream_t stream) {
  return launch_paged_attention_kernel<0>(
      out, nullptr, nullptr, nullptr, /*num_partitions=*/1, query, query_stride, key_cache,
      value_cache, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads, head_size,
      block_size, max_blocks_per_seq, scale, features, dtype, stream);
}

}  // namespace pagedserve
