// The Python bindings every build shares (kernels.h declares them); each build's linear
// file defines the module, adding what is its own (AMX's request_amx).
#pragma once
#include <torch/extension.h>

#include "kernels.h"

inline void define_shared_kernels(pybind11::module& m) {
  // The kernels touch no Python object: other threads (a server's web layer) run while they do.
  const auto free_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("linear", &linear, free_gil);
  m.def("rms_norm", &rms_norm, free_gil);
  m.def("add_rms_norm", &add_rms_norm, free_gil);
  m.def("rope_qkv", &rope_qkv, free_gil);
  m.def("silu_mul", &silu_mul, free_gil);
  m.def("cache_attention", &cache_attention, free_gil);
  m.def("decoder_stack", &decoder_stack, free_gil);
  m.def("quant_linear", &quant_linear, free_gil);
  m.def("read_streams", &read_streams, free_gil);
  m.def("multiply_add_peak", &multiply_add_peak, free_gil);
}
