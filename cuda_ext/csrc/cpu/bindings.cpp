// Python bindings of the native CPU ops. Every op releases the GIL while it runs.
#include <torch/extension.h>

#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve native CPU kernels; call them through cuda_ext.native_cpu";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention_decode", &pagedserve::paged_attention_decode, nogil, py::arg("out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0, py::arg("sinks") = py::none(),
        py::arg("kv_format") = 0);
  m.def("paged_attention_prefill", &pagedserve::paged_attention_prefill, nogil, py::arg("out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("kv_format") = 0);
  m.def("reshape_and_cache", &pagedserve::reshape_and_cache, nogil, py::arg("key"),
        py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("kv_format") = 0);
  m.def("copy_blocks", &pagedserve::copy_blocks, nogil, py::arg("key_caches"),
        py::arg("value_caches"), py::arg("block_mapping"));
  m.def("swap_blocks", &pagedserve::swap_blocks, nogil, py::arg("src"), py::arg("dst"),
        py::arg("block_mapping"));
  m.def("rms_norm", &pagedserve::rms_norm, nogil, py::arg("out"), py::arg("x"),
        py::arg("weight"), py::arg("eps"));
  m.def("fused_add_rms_norm", &pagedserve::fused_add_rms_norm, nogil, py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &pagedserve::silu_and_mul, nogil, py::arg("out"), py::arg("gate_up"));
  m.def("rotary_embedding", &pagedserve::rotary_embedding, nogil, py::arg("positions"),
        py::arg("query"), py::arg("key"), py::arg("cos"), py::arg("sin"));
  m.def("quantized_matmul", &pagedserve::quantized_matmul, nogil, py::arg("out"),
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("k"), py::arg("levels") = 2);
}
