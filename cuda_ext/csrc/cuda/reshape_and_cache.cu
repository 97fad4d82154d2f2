// reshape_and_cache: writes each new token's K and V into its slot of the paged cache.
//
// One thread block per token; its threads copy the token's num_kv_heads * head_size
// elements, which are contiguous both in the source row and in the slot (house layout), so
// reads and writes coalesce. Padding tokens (slot < 0) write nothing.
#include "common.cuh"

namespace pagedserve {
namespace {

constexpr int kMaxThreads = 512;

template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key,    // [T, KVH, D] strided
                                         const T* __restrict__ value,  // [T, KVH, D] strided
                                         T* __restrict__ key_cache,    // [N, BS, KVH, D]
                                         T* __restrict__ value_cache,  // [N, BS, KVH, D]
                                         const int64_t* __restrict__ slot_mapping,  // [T]
                                         int64_t key_stride, int64_t value_stride,
                                         int row_size) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;
  const T* k = key + token * key_stride;
  const T* v = value + token * value_stride;
  T* k_dst = key_cache + slot * row_size;
  T* v_dst = value_cache + slot * row_size;
  for (int i = threadIdx.x; i < row_size; i += blockDim.x) {
    k_dst[i] = k[i];
    v_dst[i] = v[i];
  }
}

}  // namespace

cudaError_t launch_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int num_tokens, int64_t key_stride, int64_t value_stride,
                                     int num_kv_heads, int head_size, DType dtype,
                                     cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (num_tokens < 0 || num_kv_heads <= 0 || head_size <= 0) return cudaErrorInvalidValue;
  const int row_size = num_kv_heads * head_size;
  const int threads = row_size < kMaxThreads ? cdiv(row_size, kWarpSize) * kWarpSize
                                             : kMaxThreads;
  return dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    reshape_and_cache_kernel<T><<<num_tokens, threads, 0, stream>>>(
        static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(key_cache),
        static_cast<T*>(value_cache), slot_mapping, key_stride, value_stride, row_size);
    return cudaGetLastError();
  });
}

}  // namespace pagedserve
