// Python bindings of the native CPU ops. Every op releases the GIL while it runs.
#include <torch/extension.h>

#include "ops.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve native CPU kernels; call them through cuda_ext.native_cpu";
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_attention_decode", &pagedserve::paged_attention_decode, nogil, py::arg("out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("scale"));
}
