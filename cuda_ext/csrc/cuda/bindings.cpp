// Torch bindings of the launchers (launchers.h): tensors in, raw pointers, sizes and the
// current CUDA stream out. Built on a GPU machine by torch.utils.cpp_extension.load (see
// cuda_ext/native_cuda.py, whose wrappers check shapes, dtypes, devices and contiguity with
// errors that name the argument); the TORCH_CHECKs here only guard the C++ entry points.
#include <torch/extension.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launchers.h"

namespace {

using pagedserve::DType;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "unsupported dtype ", t.scalar_type(),
                  "; the CUDA kernels take float16, bfloat16 or float32");
  }
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, " failed: ", cudaGetErrorString(err));
}

int to_int(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= INT32_MAX, what, " = ", v, " does not fit the kernels' int32");
  return static_cast<int>(v);
}

// The optional attention features; sinks, when given, is float32 [num_heads] on the query's
// device (checked by native_cuda.py).
pagedserve::AttentionFeatures features_of(int64_t sliding_window, double soft_cap,
                                          const std::optional<at::Tensor>& sinks) {
  pagedserve::AttentionFeatures features;
  features.sliding_window = to_int(sliding_window, "sliding_window");
  features.soft_cap = static_cast<float>(soft_cap);
  features.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  return features;
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const c10::cuda::CUDAGuard guard(key.device());
  check(pagedserve::launch_reshape_and_cache(
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            slot_mapping.data_ptr<int64_t>(), to_int(key.size(0), "num_tokens"),
            key.stride(0), value.stride(0), to_int(key.size(1), "num_kv_heads"),
            to_int(key.size(2), "head_size"), dtype_of(key), current_stream()),
        "reshape_and_cache");
}

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                        double soft_cap, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  check(pagedserve::launch_paged_attention_v1(
            out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), block_tables.data_ptr<int>(), seq_lens.data_ptr<int>(),
            to_int(query.size(0), "num_seqs"), to_int(query.size(1), "num_heads"),
            to_int(key_cache.size(2), "num_kv_heads"), to_int(query.size(2), "head_size"),
            to_int(key_cache.size(1), "block_size"),
            to_int(block_tables.size(1), "max_blocks_per_seq"), static_cast<float>(scale),
            features_of(sliding_window, soft_cap, sinks), dtype_of(query), current_stream()),
        "paged_attention_v1");
}

void paged_attention_v2(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, double scale, at::Tensor& exp_sums,
                        at::Tensor& max_logits, at::Tensor& tmp_out, int64_t sliding_window,
                        double soft_cap, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  check(pagedserve::launch_paged_attention_v2(
            out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), block_tables.data_ptr<int>(), seq_lens.data_ptr<int>(),
            exp_sums.data_ptr<float>(), max_logits.data_ptr<float>(),
            tmp_out.data_ptr<float>(), to_int(exp_sums.size(2), "max_num_partitions"),
            to_int(query.size(0), "num_seqs"), to_int(query.size(1), "num_heads"),
            to_int(key_cache.size(2), "num_kv_heads"), to_int(query.size(2), "head_size"),
            to_int(key_cache.size(1), "block_size"),
            to_int(block_tables.size(1), "max_blocks_per_seq"), static_cast<float>(scale),
            features_of(sliding_window, soft_cap, sinks), dtype_of(query), current_stream()),
        "paged_attention_v2");
}

void prefill_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables,
                       const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       int64_t max_query_len, double scale, int64_t sliding_window,
                       double soft_cap, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  check(pagedserve::launch_prefill_attention(
            out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), block_tables.data_ptr<int>(),
            query_start_loc.data_ptr<int>(), seq_lens.data_ptr<int>(),
            to_int(seq_lens.size(0), "num_seqs"), to_int(max_query_len, "max_query_len"),
            to_int(query.size(1), "num_heads"), to_int(key_cache.size(2), "num_kv_heads"),
            to_int(query.size(2), "head_size"), to_int(key_cache.size(1), "block_size"),
            to_int(block_tables.size(1), "max_blocks_per_seq"), static_cast<float>(scale),
            features_of(sliding_window, soft_cap, sinks), dtype_of(query), current_stream()),
        "prefill_attention");
}

// key_cache_ptrs, value_cache_ptrs: [num_layers] int64 addresses on the caches' device.
void copy_blocks(const at::Tensor& key_cache_ptrs, const at::Tensor& value_cache_ptrs,
                 const at::Tensor& block_mapping, int64_t block_bytes) {
  const c10::cuda::CUDAGuard guard(block_mapping.device());
  check(pagedserve::launch_copy_blocks(
            key_cache_ptrs.data_ptr<int64_t>(), value_cache_ptrs.data_ptr<int64_t>(),
            block_mapping.data_ptr<int64_t>(), to_int(key_cache_ptrs.size(0), "num_layers"),
            to_int(block_mapping.size(0), "num_pairs"), block_bytes, current_stream()),
        "copy_blocks");
}

// block_mapping: [num_pairs, 2] int64 on the host. One of src, dst is on a CUDA device.
void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const at::Device device = src.is_cuda() ? src.device() : dst.device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaMemcpyKind kind = src.is_cuda() && dst.is_cuda() ? cudaMemcpyDeviceToDevice
                              : src.is_cuda()                ? cudaMemcpyDeviceToHost
                                                             : cudaMemcpyHostToDevice;
  const int64_t block_bytes = src[0].numel() * src.element_size();
  check(pagedserve::launch_swap_blocks(src.data_ptr(), dst.data_ptr(),
                                       block_mapping.data_ptr<int64_t>(),
                                       to_int(block_mapping.size(0), "num_pairs"),
                                       block_bytes, kind, current_stream()),
        "swap_blocks");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve paged KV cache CUDA kernels (use cuda_ext.native_cuda, not this)";
  m.def("reshape_and_cache", &reshape_and_cache);
  m.def("paged_attention_v1", &paged_attention_v1);
  m.def("paged_attention_v2", &paged_attention_v2);
  m.def("prefill_attention", &prefill_attention);
  m.def("copy_blocks", &copy_blocks);
  m.def("swap_blocks", &swap_blocks);
}
