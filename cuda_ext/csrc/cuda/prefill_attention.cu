// prefill_attention: causal attention of each sequence's new tokens over its paged context.
//
// Our own kernel, not a composition: it reads K/V through the block table directly, so no
// contiguous workspace is gathered. It is a plain SIMT flash-attention (online softmax over
// key tiles, float32 math in shared memory, no tensor cores): correct for any mix of prefill
// chunks and decodes, but a production prefill path should use a tensor-core kernel.
//
// Grid (query tile, head, sequence); 128 threads own kTileQ = 16 query rows, 8 lanes per
// row (the 8 lanes of a row sit in one warp). A sequence with q_len new tokens and context
// seq_len puts query i at position seq_len - q_len + i, seeing keys at positions <= that.
// Per key tile of kTileK = 16 tokens:
//   1. all threads load the tile's K and V (through the block table) into shared memory;
//   2. lane j of a row scores keys j and j + 8, masks the causal future, and the row's 8
//      lanes agree on the new running max and sum (shuffles within the row);
//   3. the row's probabilities go through shared memory, and lane j accumulates
//      p * V into the dims j, j + 8, j + 16, ... that it owns.
// Rows and K/V tiles are padded by one float so the row-parallel reads hit distinct banks.
// FEATURES (AttentionFeatures): soft-capped logits; a sliding window, whose key tiles start
// at the query tile's first window and load no position before it (so no block wholly
// before the step's first window is read), a row that sees no key of a tile leaving its
// softmax as it was; sinks in each row's normalizer.
#include "common.cuh"

namespace pagedserve {
namespace {

constexpr int kPrefillThreads = 128;
constexpr int kTileQ = 16;
constexpr int kTileK = 16;
constexpr int kLanesPerRow = kPrefillThreads / kTileQ;  // 8
constexpr int kKeysPerLane = kTileK / kLanesPerRow;     // 2
static_assert(kWarpSize % kLanesPerRow == 0, "a row's lanes share a warp");

__host__ __device__ constexpr int prefill_smem_floats(int head_size) {
  return (kTileQ + kTileK) * (head_size + 1) + kTileK * head_size + kTileQ * (kTileK + 1);
}

// HEAD_SIZE == 0 is the generic path: head_size_rt <= kMaxHeadSize at run time.
template <typename T, int HEAD_SIZE, bool FEATURES>
__global__ void __launch_bounds__(kPrefillThreads) prefill_attention_kernel(
    T* __restrict__ out,                   // [num_tokens, num_heads, head_size]
    const T* __restrict__ query,           // [num_tokens, num_heads, head_size], strided
    int64_t query_stride,                  //
    const T* __restrict__ key_cache,       // [num_blocks, block_size, num_kv_heads, D]
    const T* __restrict__ value_cache,     // [num_blocks, block_size, num_kv_heads, D]
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks_per_seq]
    const int* __restrict__ query_start_loc,  // [num_seqs + 1]
    const int* __restrict__ seq_lens,         // [num_seqs]
    int max_blocks_per_seq, int num_kv_heads, int block_size, int head_size_rt,
    float scale, AttentionFeatures features) {
  constexpr bool kGeneric = HEAD_SIZE == 0;
  constexpr int kDimsPerLane = cdiv(kGeneric ? kMaxHeadSize : HEAD_SIZE, kLanesPerRow);
  const int head_size = kGeneric ? head_size_rt : HEAD_SIZE;

  const int tile = blockIdx.x;
  const int head = blockIdx.y;
  const int seq = blockIdx.z;
  const int num_heads = gridDim.y;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int q_begin = query_start_loc[seq];
  const int q_len = query_start_loc[seq + 1] - q_begin;
  const int row0 = tile * kTileQ;
  if (row0 >= q_len) return;
  const int seq_len = seq_lens[seq];
  const int context = seq_len - q_len;  // tokens before this step's first query
  const int rows = min(kTileQ, q_len - row0);
  const int kv_end = context + row0 + rows;  // the tile's last query sees keys < kv_end
  // The tile's first query sees keys >= kv_begin; tiles of keys start at a multiple of
  // kTileK, but no position before kv_begin is loaded.
  const int kv_begin = FEATURES ? window_start(context + row0, features.sliding_window) : 0;

  const int row = threadIdx.x / kLanesPerRow;
  const int j = threadIdx.x % kLanesPerRow;
  const int q_pos = context + row0 + row;  // past seq_len for padding rows (never written)

  extern __shared__ float smem[];
  const int padded = head_size + 1;
  float* sq = smem;                     // [kTileQ][padded], scaled queries
  float* sk = sq + kTileQ * padded;     // [kTileK][padded]
  float* sv = sk + kTileK * padded;     // [kTileK][head_size]
  float* sp = sv + kTileK * head_size;  // [kTileQ][kTileK + 1], probabilities

  for (int idx = threadIdx.x; idx < kTileQ * head_size; idx += kPrefillThreads) {
    const int r = idx / head_size;
    const int d = idx % head_size;
    float x = 0.f;
    if (r < rows) {
      const int64_t token = q_begin + row0 + r;
      x = to_float(query[token * query_stride + static_cast<int64_t>(head) * head_size + d]);
    }
    sq[r * padded + d] = x * scale;
  }

  float m = kNegInfinity;
  float l = 0.f;
  float acc[kDimsPerLane];
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) acc[i] = 0.f;

  const int* table = block_tables + static_cast<int64_t>(seq) * max_blocks_per_seq;
  for (int kv0 = kv_begin / kTileK * kTileK; kv0 < kv_end; kv0 += kTileK) {
    __syncthreads();  // the previous tile is consumed (and, first time, sq is written)
    for (int idx = threadIdx.x; idx < kTileK * head_size; idx += kPrefillThreads) {
      const int t = idx / head_size;
      const int d = idx % head_size;
      const int pos = kv0 + t;
      float kx = 0.f;
      float vx = 0.f;
      if (pos < kv_end && (!FEATURES || pos >= kv_begin)) {
        const int64_t slot =
            static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
        const int64_t at = (slot * num_kv_heads + kv_head) * head_size + d;
        kx = to_float(key_cache[at]);
        vx = to_float(value_cache[at]);
      }
      sk[t * padded + d] = kx;
      sv[t * head_size + d] = vx;
    }
    __syncthreads();

    float s[kKeysPerLane];
    float tile_max = kNegInfinity;
#pragma unroll
    for (int c = 0; c < kKeysPerLane; ++c) {
      const int key = j + c * kLanesPerRow;
      const float* qr = sq + row * padded;
      const float* kr = sk + key * padded;
      float dot = 0.f;
      for (int d = 0; d < head_size; ++d) dot = fmaf(qr[d], kr[d], dot);
      const int pos = kv0 + key;
      if constexpr (FEATURES) {
        const bool seen = pos <= q_pos && pos < kv_end &&
                          pos >= window_start(q_pos, features.sliding_window);
        s[c] = seen ? soft_capped(dot, features.soft_cap) : kNegInfinity;
      } else {
        s[c] = (pos <= q_pos && pos < kv_end) ? dot : kNegInfinity;
      }
      tile_max = fmaxf(tile_max, s[c]);
    }
    // Finite for real rows: each row's first tile holds key 0. Padding rows score zeros.
    // With a window a row may have seen no key yet (m_new = -inf): its exponents are then
    // taken from 0, so that p = 0 and the rescale of its empty sums is 0.
    const float m_new = fmaxf(m, group_max<kLanesPerRow>(tile_max));
    const float m_ref = FEATURES && m_new == kNegInfinity ? 0.f : m_new;
    float p_sum = 0.f;
#pragma unroll
    for (int c = 0; c < kKeysPerLane; ++c) {
      const float p = __expf(s[c] - m_ref);
      sp[row * (kTileK + 1) + j + c * kLanesPerRow] = p;
      p_sum += p;
    }
    const float rescale = __expf(m - m_ref);  // 0 on the first tile
    l = l * rescale + group_sum<kLanesPerRow>(p_sum);
    m = m_new;
    __syncwarp();  // the row's probabilities, written by lanes of this warp

#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[i] *= rescale;
    const float* pr = sp + row * (kTileK + 1);
    for (int key = 0; key < kTileK; ++key) {
      const float p = pr[key];
      const float* vr = sv + key * head_size;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = j + i * kLanesPerRow;
        if (kGeneric ? d < head_size : true) acc[i] = fmaf(p, vr[d], acc[i]);
      }
    }
  }

  if (row >= rows) return;
  const float inv_sum = FEATURES ? softmax_normalizer(m, l, features.sinks, head) : 1.f / l;
  T* o = out + (static_cast<int64_t>(q_begin + row0 + row) * num_heads + head) * head_size;
#pragma unroll
  for (int i = 0; i < kDimsPerLane; ++i) {
    const int d = j + i * kLanesPerRow;
    if (d < head_size) o[d] = from_float<T>(acc[i] * inv_sum);
  }
}

}  // namespace

cudaError_t launch_prefill_attention(void* out, const void* query, int64_t query_stride,
                                     const void* key_cache, const void* value_cache,
                                     const int* block_tables, const int* query_start_loc,
                                     const int* seq_lens, int num_seqs, int max_query_len,
                                     int num_heads, int num_kv_heads, int head_size,
                                     int block_size, int max_blocks_per_seq, float scale,
                                     const AttentionFeatures& features, DType dtype,
                                     cudaStream_t stream) {
  if (num_seqs == 0 || max_query_len == 0) return cudaSuccess;
  if (num_seqs < 0 || num_seqs > 65535 || num_heads > 65535 || max_query_len < 0 ||
      num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0 ||
      features.sliding_window < 0 || !(features.soft_cap >= 0.f)) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(cdiv(max_query_len, kTileQ), num_heads, num_seqs);
  const int smem = prefill_smem_floats(head_size) * static_cast<int>(sizeof(float));
  return dispatch_bool(features.any(), [&](auto features_tag) {
  constexpr bool kFeatures = decltype(features_tag)::value;
  return dispatch_dtype(dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    return dispatch_head_size(head_size, [&](auto head_tag) {
      constexpr int kHead = decltype(head_tag)::value;
      auto kernel = prefill_attention_kernel<T, kHead, kFeatures>;
      if (smem > 48 * 1024) {
        const cudaError_t err =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err != cudaSuccess) return err;
      }
      kernel<<<grid, kPrefillThreads, smem, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(query), query_stride,
          static_cast<const T*>(key_cache), static_cast<const T*>(value_cache), block_tables,
          query_start_loc, seq_lens, max_blocks_per_seq, num_kv_heads, block_size, head_size,
          scale, features);
      return cudaGetLastError();
    });
  });
  });
}

}  // namespace pagedserve
