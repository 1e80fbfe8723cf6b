// The Python bindings every build shares (kernels.h declares them); each build's linear
// file defines the module, adding what is its own (AMX's request_amx).
#pragma once
#include <torch/extension.h>

#include "kernels.h"

inline void define_shared_kernels(pybind11::module& m) {
  m.def("linear", &linear);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_qkv", &rope_qkv);
  m.def("silu_mul", &silu_mul);
  m.def("cache_attention", &cache_attention);
  m.def("decoder_stack", &decoder_stack);
  m.def("quant_linear", &quant_linear);
}
