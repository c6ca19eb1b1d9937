// The eager entry of the norm-modulate operators' autograd formula, for the library's Python fast path
// (norm_mod_python.cpp); defined in ln_modulate_binding.cpp beside the formula it enters.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace adaptiveload {

// y of rms_norm_modulate (rms) or layer_norm_modulate, the same autograd formula and kernels as a call of
// the operator; shift and scale are viewed as (rows, D) tables below autograd (any shape of rows x D
// elements that the Python wrapper found to be such a table), their gradients returned in their own shapes.
at::Tensor norm_modulate_eager(bool rms, const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               int64_t rows, int64_t group_size, double eps);

}  // namespace adaptiveload
