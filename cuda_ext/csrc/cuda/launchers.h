// Host launchers of the paged KV cache kernels: the only seam between the kernels and torch.
//
// The kernels (*.cu) depend on CUDA headers only, so `nvcc -c` compiles them without torch;
// bindings.cpp (built on a GPU machine by torch.utils.cpp_extension) turns tensors into the
// raw pointers, sizes and stream these functions take. Every launcher returns the launch's
// cudaError_t (cudaErrorInvalidValue for an unsupported size) and never synchronizes.
//
// House cache layout (one layer): key_cache, value_cache
//   [num_blocks, block_size, num_kv_heads, head_size], contiguous;
//   a slot is block_id * block_size + offset.
// Index tensors: slot_mapping int64; block_tables, seq_lens, query_start_loc int32.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace pagedserve {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int kMaxHeadSize = 256;    // the generic (unspecialized) head-size path's bound
constexpr int kPartitionSize = 512;  // tokens of context per thread block in paged attention v2

// A layer's optional attention features, all off by default (the kernels then compile
// the plain path, unchanged). sliding_window W > 0: a query at position p sees the keys
// p - W < j <= p, and no block wholly before the step's first query's window is read (its
// table entry may be anything); soft_cap c > 0: each scaled logit x becomes c * tanh(x / c)
// before masking; sinks (device float32 [num_heads], or null): one more logit per query
// head in every softmax's denominator, with no value (GPT-OSS's learned sinks).
struct AttentionFeatures {
  int sliding_window = 0;
  float soft_cap = 0.f;
  const float* sinks = nullptr;

  bool any() const { return sliding_window > 0 || soft_cap > 0.f || sinks != nullptr; }
};

// key, value: [num_tokens, num_kv_heads, head_size], the last two dims contiguous, token
// strides given in elements. Tokens whose slot is < 0 are padding and are skipped.
cudaError_t launch_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int num_tokens, int64_t key_stride, int64_t value_stride,
                                     int num_kv_heads, int head_size, DType dtype,
                                     cudaStream_t stream);

// Decode: one query token per sequence. out: [num_seqs, num_heads, head_size] contiguous;
// query: [num_seqs, num_heads, head_size] with token stride query_stride (elements);
// block_tables: [num_seqs, max_blocks_per_seq]; seq_lens: [num_seqs], the context length
// including this token. One pass over the whole context per (sequence, head).
cudaError_t launch_paged_attention_v1(void* out, const void* query, int64_t query_stride,
                                      const void* key_cache, const void* value_cache,
                                      const int* block_tables, const int* seq_lens,
                                      int num_seqs, int num_heads, int num_kv_heads,
                                      int head_size, int block_size, int max_blocks_per_seq,
                                      float scale, const AttentionFeatures& features,
                                      DType dtype, cudaStream_t stream);

// As v1, with the context cut into kPartitionSize-token partitions attended by separate
// thread blocks, then combined by a reduce kernel. Workspaces (float32, any contents):
// exp_sums, max_logits [num_seqs, num_heads, max_num_partitions];
// tmp_out [num_seqs, num_heads, max_num_partitions, head_size];
// max_num_partitions = cdiv(max(seq_lens), kPartitionSize).
cudaError_t launch_paged_attention_v2(void* out, const void* query, int64_t query_stride,
                                      const void* key_cache, const void* value_cache,
                                      const int* block_tables, const int* seq_lens,
                                      float* exp_sums, float* max_logits, float* tmp_out,
                                      int max_num_partitions, int num_seqs, int num_heads,
                                      int num_kv_heads, int head_size, int block_size,
                                      int max_blocks_per_seq, float scale,
                                      const AttentionFeatures& features, DType dtype,
                                      cudaStream_t stream);

// Causal attention of each sequence's new tokens (its last q_len positions) over its paged
// context; any mix of prefill chunks and decodes. out: [num_tokens, num_heads, head_size]
// contiguous; query: [num_tokens, num_heads, head_size], token stride query_stride;
// query_start_loc: [num_seqs + 1]; max_query_len bounds query_start_loc's differences.
cudaError_t launch_prefill_attention(void* out, const void* query, int64_t query_stride,
                                     const void* key_cache, const void* value_cache,
                                     const int* block_tables, const int* query_start_loc,
                                     const int* seq_lens, int num_seqs, int max_query_len,
                                     int num_heads, int num_kv_heads, int head_size,
                                     int block_size, int max_blocks_per_seq, float scale,
                                     const AttentionFeatures& features, DType dtype,
                                     cudaStream_t stream);

// Copy-on-write for every layer in one launch. key_cache_ptrs, value_cache_ptrs: device
// arrays of num_layers addresses (int64) of caches whose blocks are block_bytes apart;
// block_mapping: device [num_pairs, 2] (src, dst) block ids.
cudaError_t launch_copy_blocks(const int64_t* key_cache_ptrs, const int64_t* value_cache_ptrs,
                               const int64_t* block_mapping, int num_layers, int num_pairs,
                               int64_t block_bytes, cudaStream_t stream);

// Swapping: one cudaMemcpyAsync of block_bytes per pair on `stream`. block_mapping: HOST
// [num_pairs, 2] (src, dst) block ids; kind: the direction (the host side must be pinned
// for the copies to be asynchronous).
cudaError_t launch_swap_blocks(const void* src, void* dst, const int64_t* block_mapping,
                               int num_pairs, int64_t block_bytes, cudaMemcpyKind kind,
                               cudaStream_t stream);

}  // namespace pagedserve
