// Device helpers shared by the kernels: storage <-> float conversion, vector loads, warp and
// block reductions, and the dispatch from runtime sizes to template instantiations.
// CUDA headers only (see launchers.h).
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launchers.h"

namespace pagedserve {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kNegInfinity = -INFINITY;  // usable on host and device (CUDART_INF_F is not)

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// Storage types hold the cache; all arithmetic is float32.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// VEC consecutive elements, aligned so that one load instruction fetches them all.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// Loads ptr[0, VEC) as floats; ptr must be aligned to sizeof(T) * VEC.
template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* ptr, float (&out)[VEC]) {
  const Vec<T, VEC> x = *reinterpret_cast<const Vec<T, VEC>*>(ptr);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = to_float(x.v[i]);
}

// Elements per lane per load (4: 8 bytes of float16, 16 of float32) when a head of
// HEAD_SIZE elements tiles a warp with no remainder; 1 (scalar loads) otherwise.
__host__ __device__ constexpr int lane_vec_width(int head_size) {
  return head_size % (kWarpSize * 4) == 0 ? 4 : head_size % (kWarpSize * 2) == 0 ? 2 : 1;
}

// Reductions over lanes xor-adjacent within groups of WIDTH lanes (a power of two <= 32):
// every lane of the group gets the result.
template <int WIDTH = kWarpSize>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask >>= 1) x += __shfl_xor_sync(kFullMask, x, mask);
  return x;
}

template <int WIDTH = kWarpSize>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(kFullMask, x, mask));
  }
  return x;
}

// Reductions over the whole thread block (blockDim.x a multiple of 32); every thread gets
// the result. `scratch` holds >= blockDim.x / 32 floats and may be reused right after.
__device__ __forceinline__ float block_max(float x, float* scratch) {
  x = group_max(x);
  __syncthreads();  // earlier readers of scratch are done
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / kWarpSize); ++w) x = fmaxf(x, scratch[w]);
  return x;
}

__device__ __forceinline__ float block_sum(float x, float* scratch) {
  x = group_sum(x);
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = x;
  __syncthreads();
  x = scratch[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / kWarpSize); ++w) x += scratch[w];
  return x;
}

// The optional features (AttentionFeatures, launchers.h) as the kernels apply them.
// A logit after the soft cap (cap > 0) or unchanged (cap == 0): cap * tanh(logit / cap),
// with tanh(t) = 1 - 2 / (1 + exp(2t)) from the fast exponential and division (tanhf's
// accurate path cost decode 1.3-1.45x on an H200). Its absolute error is about 2e-7 times
// the cap; t is clamped where tanh is 1 in float32, so the division's argument stays finite.
__device__ __forceinline__ float soft_capped(float logit, float cap) {
  if (cap <= 0.f) return logit;
  const float e = __expf(2.f * fminf(__fdividef(logit, cap), 40.f));
  return cap * (1.f - __fdividef(2.f, 1.f + e));
}

// The first key position a query at `position` sees (0 without a window).
__device__ __forceinline__ int window_start(int position, int sliding_window) {
  return sliding_window > 0 ? max(0, position - sliding_window + 1) : 0;
}

// What multiplies an unnormalized softmax output (sum of exp(logit - m) * v) to give the
// attention output: 1 / l, or with a sink logit s in the denominator, with the max moved
// to M = max(m, s) so that no exponent overflows: exp(m - M) / (l exp(m - M) + exp(s - M)).
__device__ __forceinline__ float softmax_normalizer(float m, float l, const float* sinks,
                                                    int head) {
  if (sinks == nullptr) return 1.f / l;
  const float sink = sinks[head];
  const float top = fmaxf(m, sink);
  const float kept = __expf(m - top);
  return kept / fmaf(l, kept, __expf(sink - top));
}

// Dispatch: calls f(BoolConst<B>{}) with B = flag.
template <bool B>
struct BoolConst {
  static constexpr bool value = B;
};

template <typename F>
cudaError_t dispatch_bool(bool flag, F&& f) {
  return flag ? f(BoolConst<true>{}) : f(BoolConst<false>{});
}

// Dispatch: calls f(T{}) with the storage type named by `dtype`.
template <typename F>
cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat16:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

template <int N>
struct IntConst {
  static constexpr int value = N;
};

// Calls f(IntConst<HEAD_SIZE>{}) for a specialized head size, f(IntConst<0>{}) (the generic
// path) for any other size up to kMaxHeadSize.
template <typename F>
cudaError_t dispatch_head_size(int head_size, F&& f) {
  switch (head_size) {
    case 64:
      return f(IntConst<64>{});
    case 80:
      return f(IntConst<80>{});
    case 96:
      return f(IntConst<96>{});
    case 128:
      return f(IntConst<128>{});
    default:
      if (head_size <= 0 || head_size > kMaxHeadSize) return cudaErrorInvalidValue;
      return f(IntConst<0>{});
  }
}

template <typename F>
cudaError_t dispatch_block_size(int block_size, F&& f) {
  switch (block_size) {
    case 8:
      return f(IntConst<8>{});
    case 16:
      return f(IntConst<16>{});
    case 32:
      return f(IntConst<32>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace pagedserve
