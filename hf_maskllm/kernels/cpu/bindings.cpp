// The Python module of the CPU kernels: its functions, bound with pybind11, and the kernels of two registered torch
// ops. The kernels live in the other files (common.h says which); this is the only file that includes pybind11,
// torch's Python bindings and torch/library.h.

#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

// nm_linear.cpp: float32 / bfloat16 / float16 kept values (format version 1), and the instruction-set switch.
at::Tensor nm_linear(const at::Tensor& x, const at::Tensor& values, const at::Tensor& meta, int64_t n, int64_t m,
                     const std::optional<at::Tensor>& bias);
at::Tensor nm_expand(const at::Tensor& values, const at::Tensor& meta, int64_t n, int64_t m, int64_t in_features,
                     at::Tensor dense);
int64_t set_isa(int64_t level);
int64_t isa();
// nm_linear_quant.cpp: int8 / int4 kept values (format version 2).
at::Tensor nm_linear_q(const at::Tensor& x, const at::Tensor& qvalues, const at::Tensor& scales, const at::Tensor& meta,
                       int64_t n, int64_t m, int64_t bits, int64_t group_size, const std::optional<at::Tensor>& bias);
at::Tensor nm_expand_q(const at::Tensor& qvalues, const at::Tensor& scales, const at::Tensor& meta, int64_t n,
                       int64_t m, int64_t bits, int64_t group_size, int64_t in_features, at::Tensor dense);
std::string nm_linear_q_route(int64_t n, int64_t m, int64_t group_size);
// int8_linear.cpp: a dense layer stored as int8 codes with one float16 scale per row.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);
std::string int8_linear_route();
// decode_attention.cpp: attention over the unmasked positions of a KV cache.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& mask, double scale);

// The kernels of the registered ops hf_maskllm::sparse_decode_q (schema and fake implementation in
// hf_maskllm/kernels/route.py) and hf_maskllm::decode_attention (in hf_maskllm/kernels/attention.py): a compiled
// decode step calls them without a Python frame.
TORCH_LIBRARY_IMPL(hf_maskllm, CPU, lib) {
  lib.impl("sparse_decode_q", &nm_linear_q);
  lib.impl("decode_attention", &decode_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // The kernels touch no Python object: other Python threads run meanwhile.
  module.def("nm_linear", &nm_linear, "N:M sparse linear from the compressed weight (decode, small batches)",
             py::call_guard<py::gil_scoped_release>());
  module.def("nm_expand", &nm_expand, "Expand the compressed weight into a dense buffer",
             py::call_guard<py::gil_scoped_release>());
  module.def("nm_linear_q", &nm_linear_q, "N:M sparse linear from int8 / int4 kept values (decode, small batches)",
             py::call_guard<py::gil_scoped_release>());
  module.def("nm_expand_q", &nm_expand_q, "Dequantize the compressed int8 / int4 weight into a dense buffer",
             py::call_guard<py::gil_scoped_release>());
  module.def("nm_linear_q_route", &nm_linear_q_route,
             "Which nm_linear_q route runs for (n, m, group_size): 'vnni', 'avx2_q8', 'avx2' or 'scalar'");
  module.def("int8_linear", &int8_linear, "Dense linear from int8 codes with one scale per row (decode)",
             py::call_guard<py::gil_scoped_release>());
  module.def("decode_attention", &decode_attention,
             "Attention of a few query tokens over the cache positions the boolean mask lets through",
             py::call_guard<py::gil_scoped_release>());
  module.def("int8_linear_route", &int8_linear_route, "Which int8_linear route runs: 'vnni', 'avx2_q8' or 'scalar'");
  module.def("set_isa", &set_isa, "Cap the instruction set (0 scalar, 1 AVX2, 2 AVX-512, 3 AVX-512 BF16)");
  module.def("isa", &isa, "The instruction-set level in use");
}
