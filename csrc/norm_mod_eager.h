// The eager entry of the norm-modulate operators, for the library's Python fast path (norm_mod_python.cpp);
// defined in ln_modulate_binding.cpp beside the backward formula its graph node shares with the operators.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

namespace adaptiveload {

// y of rms_norm_modulate (rms) or layer_norm_modulate: the operator's CUDA kernel, then (where an input
// requires grad) one graph node whose backward is the operators' formula. shift and scale are viewed as
// (rows, D) tables below autograd (any shape of rows x D elements that the Python wrapper found to be such a
// table), their gradients returned in their own shapes.
at::Tensor norm_modulate_eager(bool rms, const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               int64_t rows, int64_t group_size, double eps);

// Direct launches the fast path has taken in this process, (forward, backward): calls that launched the
// kernel without the dispatcher (rules in norm_mod_direct.h). For tests and benchmarks.
std::pair<int64_t, int64_t> direct_launches();

// A new autograd node of type N in the pointer type this torch's graph edges hold: std::shared_ptr in older
// releases, c10::intrusive_ptr since pytorch#181782 (2.13). Also used by benchmarks/kernels/autograd_node_overhead.cpp.
template <typename N>
auto new_autograd_node() {
  if constexpr (std::is_same_v<decltype(torch::autograd::Edge::function), std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<N>(new N());
  } else {
    return c10::make_intrusive<N>();
  }
}

}  // namespace adaptiveload
