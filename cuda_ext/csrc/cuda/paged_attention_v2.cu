// paged_attention v2: decode attention with the context cut into kPartitionSize-token
// partitions. Pass 1 (paged_attention.cuh) gives each (head, sequence, partition) its own
// thread block, which writes the partition's normalized output, max logit and exp sum to
// float32 workspaces; pass 2 (below) combines a sequence's partitions per head:
//   M = max_p m_p,  w_p = l_p * exp(m_p - M),  out = sum_p w_p * o_p / sum_p w_p,
// with a head's sink logit s (AttentionFeatures) adding exp(s - M) to the denominator
// (softmax_normalizer); a partition wholly before a sliding window has l_p = 0.
// Long contexts thus spread over many SMs even when the batch is small.
#include "paged_attention.cuh"

namespace pagedserve {
namespace {

constexpr int kReduceThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kReduceThreads) paged_attention_reduce_kernel(
    T* __restrict__ out,                   // [num_seqs, num_heads, head_size]
    const float* __restrict__ exp_sums,    // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ max_logits,  // [num_seqs, num_heads, max_num_partitions]
    const float* __restrict__ tmp_out,     // [num_seqs, num_heads, max_parts, head_size]
    const int* __restrict__ seq_lens,      // [num_seqs]
    const float* __restrict__ sinks,       // [num_heads] or null
    int max_num_partitions, int head_size) {
  extern __shared__ float partition_weight[];  // [max_num_partitions]
  __shared__ float scratch[kReduceThreads / kWarpSize];
  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int64_t row = static_cast<int64_t>(seq) * gridDim.x + head;
  T* o = out + row * head_size;
  const int seq_len = seq_lens[seq];
  if (seq_len <= 0) {
    for (int d = threadIdx.x; d < head_size; d += kReduceThreads) o[d] = from_float<T>(0.f);
    return;
  }
  // Clamped so that a caller's too-small max_num_partitions truncates, never reads past
  // the workspaces.
  const int num_partitions = min(cdiv(seq_len, kPartitionSize), max_num_partitions);
  const float* m = max_logits + row * max_num_partitions;
  const float* l = exp_sums + row * max_num_partitions;

  float local_max = kNegInfinity;
  for (int p = threadIdx.x; p < num_partitions; p += kReduceThreads) {
    local_max = fmaxf(local_max, m[p]);
  }
  const float total_max = block_max(local_max, scratch);
  float local_sum = 0.f;
  for (int p = threadIdx.x; p < num_partitions; p += kReduceThreads) {
    const float w = l[p] * __expf(m[p] - total_max);
    partition_weight[p] = w;
    local_sum += w;
  }
  // block_sum also publishes the weights.
  const float inv_sum = softmax_normalizer(total_max, block_sum(local_sum, scratch), sinks, head);

  const float* partial = tmp_out + row * max_num_partitions * head_size;
  for (int d = threadIdx.x; d < head_size; d += kReduceThreads) {
    float acc = 0.f;
    for (int p = 0; p < num_partitions; ++p) {
      acc = fmaf(partition_weight[p], partial[static_cast<int64_t>(p) * head_size + d], acc);
    }
    o[d] = from_float<T>(acc * inv_sum);
  }
}

}  // namespace

cudaError_t launch_paged_attention_v2(void* out, const void* query, int64_t query_stride,
                                      const void* key_cache, const void* value_cache,
                                      const int* block_tables, const int* seq_lens,
                                      float* exp_sums, float* max_logits, float* tmp_out,
                                      int max_num_partitions, int num_seqs, int num_heads,
                                      int num_kv_heads, int head_size, int block_size,
                                      int max_blocks_per_seq, float scale,
                                      const AttentionFeatures& features, DType dtype,
                                      cudaStream_t stream) {
  cudaError_t err = launch_paged_attention_kernel<kPartitionSize>(
      nullptr, exp_sums, max_logits, tmp_out, max_num_partitions, query, query_stride,
      key_cache, value_cache, block_tables, seq_lens, num_seqs, num_heads, num_kv_heads,
      head_size, block_size, max_blocks_per_seq, scale, features, dtype, stream);
  if (err != cudaSuccess || num_seqs == 0) return err;
  const size_t smem = static_cast<size_t>(max_num_partitions) * sizeof(float);
  if (smem > 48 * 1024) return cudaErrorInvalidValue;  // contexts over 6M tokens
  const dim3 grid(num_heads, num_seqs);
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    paged_attention_reduce_kernel<T><<<grid, kReduceThreads, smem, stream>>>(
        static_cast<T*>(out), exp_sums, max_logits, tmp_out, seq_lens, features.sinks,
        max_num_partitions, head_size);
    return cudaGetLastError();
  });
}

}  // namespace pagedserve
