// The decode attention kernel's fast path, for head sizes where a token's row splits into
// 16-byte loads over a group of kTokenLanes lanes (launch_paged_attention_kernel picks it).
//
// What makes it faster than paged_attention_kernel (measured in bench/gpu_kernels.py):
//   - one thread block per (KV head, sequence, partition) attends up to GROUP query heads
//     of that KV head's group, so under GQA each K/V byte is read once, not once per head;
//   - a warp works on kTokensPerStep tokens at once, kTokenLanes lanes per token, each lane
//     loading 16 bytes at a time: a logit needs log2(kTokenLanes) shuffles, not log2(32);
//   - a piece's keys and values (up to a KV block) are all loaded before any is used
//     (2 * kSteps * ITERS 16-byte loads in flight per lane): one memory round trip each.
// Outputs, workspaces and the v1/v2 split are paged_attention_kernel's: the v2 reduce
// kernel combines partitions the same way. Slots past a context are never read, nor are
// blocks wholly before a sliding window (FEATURES: the window, soft cap and v1's sinks, as
// in paged_attention_kernel).
#pragma once

#include "common.cuh"

namespace pagedserve {

constexpr int kTokenLanes = 8;                         // lanes that share one token's row
constexpr int kTokensPerStep = kWarpSize / kTokenLanes;  // tokens a warp reads at once

__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// 16 bytes of storage held packed in four 32-bit registers (a struct of bfloat16 fields
// would take a register per element), unpacked to floats where used.
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[4], float) {
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
}
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[8], __nv_bfloat16) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // bfloat16 is the top half of a float32
    out[2 * j] = __uint_as_float(words[j] << 16);
    out[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[8], __half) {
  const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[2 * j] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[j] & 0xffffu)));
    out[2 * j + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[j] >> 16)));
  }
}

// The bits of 16 bytes of storage read element by element (rows of any alignment).
__device__ __forceinline__ uint4 pack(const float* src) {
  return make_uint4(__float_as_uint(src[0]), __float_as_uint(src[1]), __float_as_uint(src[2]),
                    __float_as_uint(src[3]));
}
__device__ __forceinline__ unsigned bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ unsigned bits(__half x) { return __half_as_ushort(x); }
template <typename T>
__device__ __forceinline__ uint4 pack(const T* src) {
  unsigned words[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) words[j] = bits(src[2 * j]) | (bits(src[2 * j + 1]) << 16);
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Whether the fast path takes this storage type and head size.
template <typename T>
__host__ __device__ constexpr bool grouped_head_size(int head_size) {
  return head_size > 0 && head_size % (kTokenLanes * (16 / static_cast<int>(sizeof(T)))) == 0;
}

template <typename T, int HEAD_SIZE, int BLOCK_SIZE, int PARTITION_SIZE, int GROUP,
          bool FEATURES>
__global__ void __launch_bounds__(kAttnThreads) paged_attention_grouped_kernel(
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
    int max_blocks_per_seq, int num_heads, int num_kv_heads, float scale,
    AttentionFeatures features) {
  constexpr int CHUNK = 16 / static_cast<int>(sizeof(T));     // elements per 16-byte load
  constexpr int ITERS = HEAD_SIZE / (kTokenLanes * CHUNK);    // loads per lane per token
  // A piece: the tokens a warp loads before using any, at most one KV block, sized so that
  // K and V take 64 registers per lane (kSteps * ITERS * 2 chunks of 4 registers). With
  // the query and outputs of 4 heads that fits 255 registers without spills at -O3 for
  // sm_90 (`nvcc -Xptxas -v` reports it); the chunks stay packed until used.
  constexpr int kChunkBudget = 8;
  constexpr int kSteps = cmin(BLOCK_SIZE / kTokensPerStep, cmax(1, kChunkBudget / ITERS));
  constexpr int PIECE = kSteps * kTokensPerStep;
  static_assert(HEAD_SIZE % (kTokenLanes * CHUNK) == 0, "a row splits into lane loads");
  static_assert(BLOCK_SIZE % PIECE == 0, "a block splits into pieces");
  static_assert(PARTITION_SIZE % BLOCK_SIZE == 0, "partitions hold whole blocks");

  // blockIdx.x: KV head, then which GROUP-sized slice of its query heads.
  const int group = num_heads / num_kv_heads;
  const int slices = cdiv(group, GROUP);
  const int kv_head = blockIdx.x / slices;
  const int first_head = kv_head * group + (blockIdx.x % slices) * GROUP;
  const int heads = min(GROUP, (kv_head + 1) * group - first_head);  // >= 1
  const int seq = blockIdx.y;
  const int partition = blockIdx.z;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int sub = lane / kTokenLanes;  // which of the step's tokens this lane reads
  const int tl = lane % kTokenLanes;   // lane within the token's group: dims below

  const int seq_len = seq_lens[seq];
  const int partition_start = partition * PARTITION_SIZE;
  const int end = PARTITION_SIZE == 0 ? seq_len : min(partition_start + PARTITION_SIZE, seq_len);
  if (partition_start >= end) {  // as paged_attention_kernel: zeros (v1) or an unread partition (v2)
    if constexpr (PARTITION_SIZE == 0) {
      for (int i = threadIdx.x; i < heads * HEAD_SIZE; i += kAttnThreads) {
        const int64_t row = static_cast<int64_t>(seq) * num_heads + first_head + i / HEAD_SIZE;
        out[row * HEAD_SIZE + i % HEAD_SIZE] = from_float<T>(0.f);
      }
    }
    return;
  }
  int start = partition_start;
  if constexpr (FEATURES) {
    start = max(start, window_start(seq_len - 1, features.sliding_window));
    if (PARTITION_SIZE != 0 && start >= end) {  // a v2 partition wholly before the window
      for (int i = threadIdx.x; i < heads * HEAD_SIZE; i += kAttnThreads) {
        const int64_t row = static_cast<int64_t>(seq) * num_heads + first_head + i / HEAD_SIZE;
        const int64_t at = row * gridDim.z + partition;
        tmp_out[at * HEAD_SIZE + i % HEAD_SIZE] = 0.f;
        if (i % HEAD_SIZE == 0) {
          max_logits[at] = kNegInfinity;
          exp_sums[at] = 0.f;
        }
      }
      return;
    }
  }

  // The lane's dims: for i < ITERS, [(i * kTokenLanes + tl) * CHUNK, + CHUNK). The query
  // stays in its storage type (half the registers of floats, and exact: the scale is
  // applied to each logit instead); zero for heads past `heads`.
  uint4 q[GROUP][ITERS];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    const T* q_row = query + seq * query_stride + static_cast<int64_t>(first_head + g) * HEAD_SIZE;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {  // query rows: any stride, so element loads
      q[g][i] = g < heads ? pack(q_row + (i * kTokenLanes + tl) * CHUNK) : make_uint4(0, 0, 0, 0);
    }
  }

  float m[GROUP];                    // running max logit (uniform in the warp)
  float l[GROUP];                    // this lane's tokens' exp sum
  float acc[GROUP][ITERS][CHUNK];    // this lane's tokens' sum of p * v in its dims
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
    m[g] = kNegInfinity;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
#pragma unroll
      for (int c = 0; c < CHUNK; ++c) acc[g][i][c] = 0.f;
    }
  }

  // Warps take the partition's pieces (PIECE tokens of one KV block) round-robin.
  const int* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * HEAD_SIZE;
  const int last_piece = cdiv(end, PIECE);
  for (int piece = start / PIECE + warp; piece < last_piece; piece += kAttnWarps) {
    const int first_token = piece * PIECE;  // of the context
    const int64_t base =
        static_cast<int64_t>(table[first_token / BLOCK_SIZE]) * BLOCK_SIZE * token_stride +
        static_cast<int64_t>(first_token % BLOCK_SIZE) * token_stride +
        static_cast<int64_t>(kv_head) * HEAD_SIZE;
    const int valid = min(PIECE, end - first_token);  // >= 1
    const int lo = FEATURES ? max(0, start - first_token) : 0;  // < valid
    // Whether the piece's t-th token is in the context (and the window); only these slots
    // are read.
    const auto seen = [&](int t) { return (!FEATURES || t >= lo) && t < valid; };
    // Every load of the piece first: keys and values of the lane's tokens.
    uint4 k[kSteps][ITERS];
    uint4 v[kSteps][ITERS];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int t = s * kTokensPerStep + sub;
      if (seen(t)) {
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
          const int64_t at = base + t * token_stride + (i * kTokenLanes + tl) * CHUNK;
          k[s][i] = *reinterpret_cast<const uint4*>(key_cache + at);
          v[s][i] = *reinterpret_cast<const uint4*>(value_cache + at);
        }
      }
    }
    // Logits of the lane's tokens (-inf past the context), a step at a time so that only
    // one step's keys are ever converted to float32.
    float logit[GROUP][kSteps];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      float key[ITERS][CHUNK];
#pragma unroll
      for (int i = 0; i < ITERS; ++i) unpack(k[s][i], key[i], T{});
#pragma unroll
      for (int g = 0; g < GROUP; ++g) {
        float partial = 0.f;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
          float query_part[CHUNK];
          unpack(q[g][i], query_part, T{});
#pragma unroll
          for (int c = 0; c < CHUNK; ++c) partial = fmaf(query_part[c], key[i][c], partial);
        }
        partial = group_sum<kTokenLanes>(partial) * scale;  // in every lane of the group
        if constexpr (FEATURES) partial = soft_capped(partial, features.soft_cap);
        logit[g][s] = seen(s * kTokensPerStep + sub) ? partial : kNegInfinity;
      }
    }
    // Each head's running softmax moves to the piece's max; p = 0 past the context.
    float p[GROUP][kSteps];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
      float piece_max = kNegInfinity;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) piece_max = fmaxf(piece_max, logit[g][s]);
#pragma unroll
      for (int mask = kTokenLanes; mask < kWarpSize; mask <<= 1) {
        piece_max = fmaxf(piece_max, __shfl_xor_sync(kFullMask, piece_max, mask));
      }
      const float m_new = fmaxf(m[g], piece_max);
      const float rescale = __expf(m[g] - m_new);  // 0 on the warp's first piece
      m[g] = m_new;
      l[g] *= rescale;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) acc[g][i][c] *= rescale;
      }
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        p[g][s] = seen(s * kTokensPerStep + sub) ? __expf(logit[g][s] - m_new) : 0.f;
        l[g] += p[g][s];
      }
    }
    // p * V, a step at a time; a value past the context may be NaN, so it is never read.
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (seen(s * kTokensPerStep + sub)) {
        float value[ITERS][CHUNK];
#pragma unroll
        for (int i = 0; i < ITERS; ++i) unpack(v[s][i], value[i], T{});
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
          for (int i = 0; i < ITERS; ++i) {
#pragma unroll
            for (int c = 0; c < CHUNK; ++c) acc[g][i][c] = fmaf(p[g][s], value[i][c], acc[g][i][c]);
          }
        }
      }
    }
  }

  // Sum each head's l and acc over the warp's token groups (all lanes then hold them),
  // then combine the warps in shared memory.
  __shared__ float warp_m[kAttnWarps][GROUP];
  __shared__ float warp_l[kAttnWarps][GROUP];
  __shared__ float warp_acc[kAttnWarps][GROUP][HEAD_SIZE];
#pragma unroll
  for (int g = 0; g < GROUP; ++g) {
#pragma unroll
    for (int mask = kTokenLanes; mask < kWarpSize; mask <<= 1) {
      l[g] += __shfl_xor_sync(kFullMask, l[g], mask);
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {
          acc[g][i][c] += __shfl_xor_sync(kFullMask, acc[g][i][c], mask);
        }
      }
    }
    if (lane == 0) {
      warp_m[warp][g] = m[g];
      warp_l[warp][g] = l[g];
    }
    if (sub == 0) {
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) warp_acc[warp][g][(i * kTokenLanes + tl) * CHUNK + c] = acc[g][i][c];
      }
    }
  }
  __syncthreads();

  const int max_num_partitions = gridDim.z;
  for (int idx = threadIdx.x; idx < heads * HEAD_SIZE; idx += kAttnThreads) {
    const int g = idx / HEAD_SIZE;
    const int d = idx % HEAD_SIZE;
    float total_max = kNegInfinity;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) total_max = fmaxf(total_max, warp_m[w][g]);
    float total_sum = 0.f;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float weight = __expf(warp_m[w][g] - total_max);  // 0 for a warp with no block
      total_sum = fmaf(warp_l[w][g], weight, total_sum);
      o = fmaf(warp_acc[w][g][d], weight, o);
    }
    const int64_t row = static_cast<int64_t>(seq) * num_heads + first_head + g;
    if constexpr (PARTITION_SIZE == 0) {
      if constexpr (FEATURES) {
        const float norm = softmax_normalizer(total_max, total_sum, features.sinks, first_head + g);
        out[row * HEAD_SIZE + d] = from_float<T>(o * norm);
      } else {
        out[row * HEAD_SIZE + d] = from_float<T>(o / total_sum);
      }
    } else {
      tmp_out[(row * max_num_partitions + partition) * HEAD_SIZE + d] = o / total_sum;
      if (d == 0) {
        max_logits[row * max_num_partitions + partition] = total_max;
        exp_sums[row * max_num_partitions + partition] = total_sum;
      }
    }
  }
}

}  // namespace pagedserve
