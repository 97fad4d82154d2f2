// The decode attention kernel shared by paged_attention_v1.cu and paged_attention_v2.cu.
//
// One thread block per (head, sequence, partition). v1 has one partition, the whole
// context; v2 cuts the context into PARTITION_SIZE-token partitions and combines them
// afterwards (paged_attention_v2.cu). Within a thread block:
//   - every warp holds the (scaled) query, spread over its lanes: lane l owns dims
//     [(i * 32 + l) * VEC, + VEC) for i < ITERS;
//   - warps take the partition's KV blocks round-robin, reading each through the block
//     table. For a block, each lane computes its partial dot product with every token's
//     key (BLOCK_SIZE independent loads in flight), a butterfly reduction gives every lane
//     every logit, and the warp folds the block into its own running softmax (max m, sum l,
//     unnormalized output acc) and accumulates p * V over the lane's dims;
//   - the warps' (m, l, acc) are combined in shared memory (block-level reduction).
// No logit is stored, so the one-pass v1 handles any context length (only its parallelism
// suffers, which is what v2 is for). Query heads of one KV group are adjacent in
// blockIdx.x, so under GQA the group's thread blocks tend to run together and can find
// their shared K/V in L2 (the design's intent; not measured).
// With a sliding window (AttentionFeatures) a context starts at the query's window: blocks
// wholly before it are never read, and the first block's earlier tokens are masked.
#pragma once

#include "common.cuh"

namespace pagedserve {

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / kWarpSize;
constexpr int kMaxGroupedHeads = 4;  // query heads per thread block on the grouped path

}  // namespace pagedserve

#include "paged_attention_grouped.cuh"

namespace pagedserve {

// The first of VEC consecutive dims that lane `lane` owns in its i-th slice of a head.
template <int VEC>
__device__ __forceinline__ int lane_dim(int i, int lane) {
  return (i * kWarpSize + lane) * VEC;
}

// One warp's online softmax over the KV blocks it has seen: the max logit m, the sum l of
// exp(logit - m), and the output sum of exp(logit - m) * v in the lane's dims.
template <int ITERS, int VEC>
struct WarpSoftmax {
  float m;
  float l;
  float acc[ITERS][VEC];

  __device__ WarpSoftmax() : m(kNegInfinity), l(0.f) {
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[i][v] = 0.f;
    }
  }
};

// Folds tokens [lo, valid) of one KV block into the warp's softmax (lo > 0 only for the
// block where a sliding window starts; FEATURES also soft-caps the logits). The block's
// other slots are never read: their memory may hold anything, NaN included.
template <typename T, int BLOCK_SIZE, bool FEATURES, int ITERS, int VEC>
__device__ __forceinline__ void fold_block(WarpSoftmax<ITERS, VEC>& state,
                                           const float (&q)[ITERS][VEC],  // scaled query
                                           const T* k_block, const T* v_block,
                                           int64_t token_stride, int lo, int valid,
                                           int head_size, int lane, float soft_cap) {
  // `lo` and `valid` are uniform in the warp; the plain path has lo == 0.
  const auto seen = [&](int t) { return (!FEATURES || t >= lo) && t < valid; };
  // Partial dot products for every token (BLOCK_SIZE independent loads in flight), then
  // a butterfly sum that leaves every logit in every lane.
  float s[BLOCK_SIZE];
#pragma unroll
  for (int t = 0; t < BLOCK_SIZE; ++t) {
    float partial = 0.f;
    if (seen(t)) {
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int d0 = lane_dim<VEC>(i, lane);
        if (d0 < head_size) {
          float k[VEC];
          load_floats<T, VEC>(k_block + t * token_stride + d0, k);
#pragma unroll
          for (int v = 0; v < VEC; ++v) partial = fmaf(q[i][v], k[v], partial);
        }
      }
    }
    s[t] = partial;
  }
  float block_max_logit = kNegInfinity;
#pragma unroll
  for (int t = 0; t < BLOCK_SIZE; ++t) {
    s[t] = seen(t) ? group_sum(s[t]) : kNegInfinity;
    if constexpr (FEATURES) s[t] = seen(t) ? soft_capped(s[t], soft_cap) : kNegInfinity;
    block_max_logit = fmaxf(block_max_logit, s[t]);
  }

  // Rescale to the new max (exp(-inf) = 0 on the warp's first block), then add p * V.
  const float m_new = fmaxf(state.m, block_max_logit);
  const float rescale = __expf(state.m - m_new);
  state.m = m_new;
  state.l *= rescale;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
#pragma unroll
    for (int v = 0; v < VEC; ++v) state.acc[i][v] *= rescale;
  }
#pragma unroll
  for (int t = 0; t < BLOCK_SIZE; ++t) {
    if (seen(t)) {
      const float p = __expf(s[t] - m_new);
      state.l += p;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int d0 = lane_dim<VEC>(i, lane);
        if (d0 < head_size) {
          float val[VEC];
          load_floats<T, VEC>(v_block + t * token_stride + d0, val);
#pragma unroll
          for (int v = 0; v < VEC; ++v) state.acc[i][v] = fmaf(p, val[v], state.acc[i][v]);
        }
      }
    }
  }
}

// HEAD_SIZE == 0 is the generic path: head_size_rt <= kMaxHeadSize at run time.
// PARTITION_SIZE == 0 is v1 (write `out`); otherwise v2 (write the partition's normalized
// output to tmp_out and its max logit and exp sum to max_logits and exp_sums; a partition
// wholly before a sliding window writes an empty softmax: -inf, 0 and zeros). FEATURES:
// apply `features` (launchers.h); v2 leaves the sinks to the reduce kernel.
template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int PARTITION_SIZE, bool FEATURES>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_kernel(
    T* __restrict__ out,                 // v1: [num_seqs, num_heads, head_size]
    float* __restrict__ exp_sums,        // v2: [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ max_logits,      // v2: [num_seqs, num_heads, max_num_partitions]
    float* __restrict__ tmp_out,         // v2: [num_seqs, num_heads, max_parts, head_size]
    const T* __restrict__ query,         // [num_seqs, num_heads, head_size], token stride
    int64_t query_stride,                //
    const T* __restrict__ key_cache,     // [num_blocks, BLOCK_SIZE, num_kv_heads, head_size]
    const T* __restrict__ value_cache,   // [num_blocks, BLOCK_SIZE, num_kv_heads, head_size]
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ seq_lens,      // [num_seqs]
    int max_blocks_per_seq, int num_kv_heads, int head_size_rt, float scale,
    AttentionFeatures features) {
  static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "partitions hold whole blocks");
  constexpr bool kGeneric = HEAD_SIZE == 0;
  constexpr int kMaxD = kGeneric ? kMaxHeadSize : HEAD_SIZE;
  constexpr int VEC = kGeneric ? 1 : lane_vec_width(HEAD_SIZE);
  constexpr int ITERS = cdiv(kMaxD, kWarpSize * VEC);
  const int head_size = kGeneric ? head_size_rt : HEAD_SIZE;

  const int head = blockIdx.x;
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int num_heads = gridDim.x;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row = static_cast<int64_t>(seq) * num_heads + head;  // of out, the stats

  const int seq_len = seq_lens[seq];
  const int partition_start = partition * PARTITION_SIZE;  // 0 for v1
  const int end = PARTITION_SIZE == 0 ? seq_len : min(partition_start + PARTITION_SIZE, seq_len);
  if (partition_start >= end) {
    // v2: a partition past this sequence's end (the reduce kernel never reads it).
    // v1: an empty context attends to nothing; its output is zero.
    if constexpr (PARTITION_SIZE == 0) {
      for (int d = threadIdx.x; d < head_size; d += kAttnThreads) {
        out[row * head_size + d] = from_float<T>(0.f);
      }
    }
    return;
  }
  int start = partition_start;
  if constexpr (FEATURES) {
    start = max(start, window_start(seq_len - 1, features.sliding_window));
    if (PARTITION_SIZE != 0 && start >= end) {  // a v2 partition wholly before the window
      const int64_t at = row * gridDim.z + partition;
      for (int d = threadIdx.x; d < head_size; d += kAttnThreads) tmp_out[at * head_size + d] = 0.f;
      if (threadIdx.x == 0) {
        max_logits[at] = kNegInfinity;
        exp_sums[at] = 0.f;
      }
      return;
    }
  }

  float q[ITERS][VEC];  // pre-scaled, in this lane's dims
  const T* q_row = query + seq * query_stride + static_cast<int64_t>(head) * head_size;
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int d0 = lane_dim<VEC>(i, lane);
#pragma unroll
    for (int v = 0; v < VEC; ++v) q[i][v] = 0.f;
    if (d0 < head_size) load_floats<T, VEC>(q_row + d0, q[i]);
#pragma unroll
    for (int v = 0; v < VEC; ++v) q[i][v] *= scale;
  }

  // Warps take the partition's blocks round-robin.
  WarpSoftmax<ITERS, VEC> state;
  const int* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  for (int b = start / BLOCK_SIZE + warp; b < cdiv(end, BLOCK_SIZE); b += kAttnWarps) {
    const int64_t block_start = static_cast<int64_t>(table[b]) * BLOCK_SIZE * token_stride +
                                static_cast<int64_t>(kv_head) * head_size;
    const int valid = min(BLOCK_SIZE, end - b * BLOCK_SIZE);  // >= 1
    const int lo = FEATURES ? max(0, start - b * BLOCK_SIZE) : 0;  // < valid
    fold_block<T, BLOCK_SIZE, FEATURES>(state, q, key_cache + block_start,
                                        value_cache + block_start, token_stride, lo, valid,
                                        head_size, lane, features.soft_cap);
  }

  // Block-level reduction of the warps' softmaxes. A warp that saw no block has m = -inf,
  // l = 0, acc = 0 and weighs exp(-inf) = 0; at least one warp saw a block (start < end).
  __shared__ float warp_m[kAttnWarps];
  __shared__ float warp_l[kAttnWarps];
  __shared__ float warp_acc[kAttnWarps][kMaxD];
  if (lane == 0) {
    warp_m[warp] = state.m;
    warp_l[warp] = state.l;
  }
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int d0 = lane_dim<VEC>(i, lane);
    if (d0 < head_size) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) warp_acc[warp][d0 + v] = state.acc[i][v];
    }
  }
  __syncthreads();

  float total_max = kNegInfinity;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) total_max = fmaxf(total_max, warp_m[w]);
  float weight[kAttnWarps];
  float total_sum = 0.f;
#pragma unroll
  for (int w = 0; w < kAttnWarps; ++w) {
    weight[w] = __expf(warp_m[w] - total_max);
    total_sum += warp_l[w] * weight[w];
  }
  const float inv_sum = PARTITION_SIZE == 0 && FEATURES
                            ? softmax_normalizer(total_max, total_sum, features.sinks, head)
                            : 1.f / total_sum;  // v2's sinks wait for the reduce kernel
  const int max_num_partitions = gridDim.z;
  for (int d = threadIdx.x; d < head_size; d += kAttnThreads) {
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) o = fmaf(warp_acc[w][d], weight[w], o);
    if constexpr (PARTITION_SIZE == 0) {
      out[row * head_size + d] = from_float<T>(o * inv_sum);
    } else {
      tmp_out[(row * max_num_partitions + partition) * head_size + d] = o * inv_sum;
    }
  }
  if constexpr (PARTITION_SIZE != 0) {
    if (threadIdx.x == 0) {
      max_logits[row * max_num_partitions + partition] = total_max;
      exp_sums[row * max_num_partitions + partition] = total_sum;
    }
  }
}

// Launches the decode kernel for the storage type, head size and block size given at run
// time: paged_attention_grouped_kernel (paged_attention_grouped.cuh) where it takes the
// head size, over grid (num_kv_heads * slices of its query heads, num_seqs, partitions);
// else paged_attention_kernel over grid (num_heads, num_seqs, num_partitions).
template <int PARTITION_SIZE>
cudaError_t launch_paged_attention_kernel(void* out, float* exp_sums, float* max_logits,
                                          float* tmp_out, int num_partitions,
                                          const void* query, int64_t query_stride,
                                          const void* key_cache, const void* value_cache,
                                          const int* block_tables, const int* seq_lens,
                                          int num_seqs, int num_heads, int num_kv_heads,
                                          int head_size, int block_size,
                                          int max_blocks_per_seq, float scale,
                                          const AttentionFeatures& features, DType dtype,
                                          cudaStream_t stream) {
  if (num_seqs == 0) return cudaSuccess;
  if (num_seqs < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 ||
      num_seqs > 65535 || num_partitions <= 0 || num_partitions > 65535) {
    return cudaErrorInvalidValue;
  }
  if (features.sliding_window < 0 || !(features.soft_cap >= 0.f)) return cudaErrorInvalidValue;
  const int group = num_heads / num_kv_heads;
  return dispatch_bool(features.any(), [&](auto features_tag) {
  constexpr bool kFeatures = decltype(features_tag)::value;
  return dispatch_dtype(dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    return dispatch_head_size(head_size, [&](auto head_tag) {
      constexpr int kHead = decltype(head_tag)::value;
      return dispatch_block_size(block_size, [&](auto block_tag) {
        constexpr int kBlock = decltype(block_tag)::value;
        if constexpr (kHead != 0 && grouped_head_size<T>(kHead)) {
          // The fast path: one thread block per (KV head, slice of its query heads).
          const auto launch = [&](auto group_tag) {
            constexpr int kGroup = decltype(group_tag)::value;
            const dim3 grid(num_kv_heads * cdiv(group, kGroup), num_seqs, num_partitions);
            paged_attention_grouped_kernel<T, kHead, kBlock, PARTITION_SIZE, kGroup, kFeatures>
                <<<grid, kAttnThreads, 0, stream>>>(
                    static_cast<T*>(out), exp_sums, max_logits, tmp_out,
                    static_cast<const T*>(query), query_stride,
                    static_cast<const T*>(key_cache), static_cast<const T*>(value_cache),
                    block_tables, seq_lens, max_blocks_per_seq, num_heads, num_kv_heads,
                    scale, features);
            return cudaGetLastError();
          };
          return group == 1 ? launch(IntConst<1>{}) : launch(IntConst<kMaxGroupedHeads>{});
        } else {
          const dim3 grid(num_heads, num_seqs, num_partitions);
          paged_attention_kernel<T, kHead, kBlock, PARTITION_SIZE, kFeatures>
              <<<grid, kAttnThreads, 0, stream>>>(
                  static_cast<T*>(out), exp_sums, max_logits, tmp_out,
                  static_cast<const T*>(query), query_stride,
                  static_cast<const T*>(key_cache), static_cast<const T*>(value_cache),
                  block_tables, seq_lens, max_blocks_per_seq, num_kv_heads, head_size, scale,
                  features);
          return cudaGetLastError();
        }
      });
    });
  });
  });
}

}  // namespace pagedserve
