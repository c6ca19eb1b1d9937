// Host cost of the two ways a C++ op can enter the autograd graph (benchmarks/kernels/bench_autograd_node.py):
// torch::autograd::Function (a context with a string-keyed map, per-input and per-output records, output
// wrapping) against a Node subclass with SavedVariable members, the way generated code (and the norm-modulate
// fast path, csrc/ln_modulate_binding.cpp) does it. Both save what the norm-modulate forward saves (x, the
// scale table, two absent affine tensors, mean, rstd, the group size and the modulation shapes) around the
// same three allocations, on any device, with no kernel; "allocs" is those allocations alone.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/extension.h>

#include "norm_mod_eager.h"  // adaptiveload::new_autograd_node (csrc/)

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::tuple<at::Tensor, at::Tensor, at::Tensor> allocs(const at::Tensor& x) {
  const int64_t rows = x.numel() / x.size(-1);
  auto fopts = x.options().dtype(at::kFloat);
  return {at::empty_like(x), at::empty({rows}, fopts), at::empty({rows}, fopts)};
}

class ViaFunction : public torch::autograd::Function<ViaFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& shift,
                               const at::Tensor& scale, int64_t rows) {
    at::AutoDispatchBelowADInplaceOrView below;
    const at::Tensor scale_t = scale.reshape({rows, x.size(-1)});
    auto [y, mean, rstd] = allocs(x);
    ctx->save_for_backward({x, scale_t, at::Tensor(), at::Tensor(), mean, rstd});
    ctx->saved_data["group_size"] = c10::SymInt(x.numel() / x.size(-1) / rows);
    ctx->saved_data["shift_shape"] = shift.sizes().vec();
    ctx->saved_data["scale_shape"] = scale.sizes().vec();
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(saved[0]);
    return {dy, at::zeros(ctx->saved_data["shift_shape"].toIntVector(), saved[1].options()),
            at::zeros(ctx->saved_data["scale_shape"].toIntVector(), saved[1].options()), at::Tensor()};
  }
};

struct ViaNodeBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable x, scale_t, weight, bias, mean, rstd;
  c10::SymInt group_size;
  std::vector<int64_t> shift_shape, scale_shape;
  variable_list apply(variable_list&& grads) override {
    const at::Tensor xs = x.unpack(), st = scale_t.unpack();
    const at::Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(xs);
    return {dy, at::zeros(shift_shape, st.options()), at::zeros(scale_shape, st.options())};
  }
  std::string name() const override { return "ViaNodeBackward"; }
  void release_variables() override {
    x.reset_data();
    scale_t.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }
};

at::Tensor via_node(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale, int64_t rows) {
  at::Tensor y, mean, rstd, scale_t;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    scale_t = scale.reshape({rows, x.size(-1)});
    std::tie(y, mean, rstd) = allocs(x);
  }
  if (torch::autograd::compute_requires_grad(x, shift, scale)) {
    auto node = adaptiveload::new_autograd_node<ViaNodeBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, shift, scale));
    node->x = torch::autograd::SavedVariable(x, false);
    node->scale_t = torch::autograd::SavedVariable(scale_t, false);
    node->weight = torch::autograd::SavedVariable(at::Tensor(), false);
    node->bias = torch::autograd::SavedVariable(at::Tensor(), false);
    node->mean = torch::autograd::SavedVariable(mean, false);
    node->rstd = torch::autograd::SavedVariable(rstd, false);
    node->group_size = c10::SymInt(x.numel() / x.size(-1) / rows);
    node->shift_shape = shift.sizes().vec();
    node->scale_shape = scale.sizes().vec();
    torch::autograd::set_history(y, node);
  }
  return y;
}

template <typename F>
py::object call(F f, py::handle x, py::handle shift, py::handle scale, int64_t rows) {
  const at::Tensor xt = THPVariable_Unpack(x.ptr()), sh = THPVariable_Unpack(shift.ptr()),
                   sc = THPVariable_Unpack(scale.ptr());
  at::Tensor y;
  {
    py::gil_scoped_release no_gil;
    y = f(xt, sh, sc, rows);
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("via_function", [](py::handle x, py::handle s, py::handle c, int64_t rows) {
    return call([](const at::Tensor& a, const at::Tensor& b, const at::Tensor& d,
                   int64_t r) { return ViaFunction::apply(a, b, d, r)[0]; },
                x, s, c, rows);
  });
  m.def("via_node", [](py::handle x, py::handle s, py::handle c, int64_t rows) { return call(via_node, x, s, c, rows); });
  m.def("allocs", [](py::handle x, py::handle s, py::handle c, int64_t rows) {
    return call([](const at::Tensor& a, const at::Tensor&, const at::Tensor&,
                   int64_t) { return std::get<0>(allocs(a)); },
                x, s, c, rows);
  });
}
