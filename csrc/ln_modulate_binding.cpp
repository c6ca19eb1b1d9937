// The operator lightning_adaptiveload::layer_norm_modulate and its backward: schemas (TORCH_LIBRARY) and
// CUDA kernels (TORCH_LIBRARY_IMPL) registered with the dispatcher, as PyTorch's own extensions do.
// Python (lightning_adaptiveload/ops/layer_norm_modulate.py) adds the rest of the registration: the fake
// (shape) implementations, the autograd formula, and a plain-PyTorch implementation for other devices.
//
// The CUDA kernels here take any input the schema allows and prepare it for the launchers (ln_modulate.h):
// x contiguous and 16-byte aligned, shift and scale tables with aligned rows in one dtype (x's or fp32),
// weight and bias as an fp32 pair. Input they cannot serve (D not a multiple of 8, dtypes other than
// bf16/fp16/fp32) is an error that names the public function, which falls back to the reference instead.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ln_modulate.h"

namespace {

using adaptiveload::DType;

DType to_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "layer_norm_modulate: ", name, " must be float32, float16 or bfloat16, got ",
                  t, "; lightning_adaptiveload.ops.layer_norm_modulate computes other dtypes "
                  "with the plain-PyTorch reference");
  }
  return DType::kFloat32;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Contiguous and 16-byte aligned (a fresh allocation from the caching allocator always is).
at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

// A (groups, D) modulation table whose rows may stay strided (chunks of a (B, 6, D) table) when each row
// starts on a 16-byte boundary; otherwise an aligned copy.
at::Tensor aligned_table(const at::Tensor& m) {
  const bool ok = m.stride(1) == 1 && aligned16(m) &&
                  (m.size(0) <= 1 || (m.stride(0) * static_cast<int64_t>(m.element_size())) % 16 == 0);
  return ok ? m : aligned(m);
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "layer_norm_modulate: ", what, " failed: ", cudaGetErrorString(err));
}

void check_table(const at::Tensor& m, const at::Tensor& x, int64_t D, const char* name) {
  TORCH_CHECK(m.device() == x.device(), "layer_norm_modulate: ", name, " is on ", m.device(), " but x is on ",
              x.device());
  TORCH_CHECK(m.dim() == 2 && m.size(1) == D, "layer_norm_modulate: ", name, " must be a (groups, ", D,
              ") table, got ", m.sizes());
}

void check_affine(const std::optional<at::Tensor>& w, const at::Tensor& x, int64_t D, const char* name) {
  if (!w.has_value()) return;
  TORCH_CHECK(w->device() == x.device() && w->dim() == 1 && w->size(0) == D, "layer_norm_modulate: ", name,
              " must be a (", D, ",) tensor on ", x.device(), ", got ", w->sizes(), " on ", w->device());
}

// shift and scale in x's dtype when both have it, else in fp32 (the kernels read either).
at::ScalarType table_dtype(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type() ? x.scalar_type() : at::kFloat;
}

void check_kernel_input(int64_t D, DType xd, DType md) {
  const char* bad = adaptiveload::ln_mod_check(D, xd, md);
  TORCH_CHECK(bad == nullptr, "layer_norm_modulate: ", bad, " (D = ", D,
              "); lightning_adaptiveload.ops.layer_norm_modulate computes such input with the plain-PyTorch "
              "reference");
}

// The LayerNorm affine as the kernels take it: both or neither, fp32, contiguous and aligned.
std::pair<std::optional<at::Tensor>, std::optional<at::Tensor>> affine_pair(const std::optional<at::Tensor>& w,
                                                                            const std::optional<at::Tensor>& b,
                                                                            const at::Tensor& x, int64_t D) {
  if (!w.has_value() && !b.has_value()) return {std::nullopt, std::nullopt};
  const auto fopts = x.options().dtype(at::kFloat);
  at::Tensor wf = w.has_value() ? aligned(w->to(at::kFloat)) : at::ones({D}, fopts);
  at::Tensor bf = b.has_value() ? aligned(b->to(at::kFloat)) : at::zeros({D}, fopts);
  return {wf, bf};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& x_in, const at::Tensor& shift_in,
                                                       const at::Tensor& scale_in,
                                                       const std::optional<at::Tensor>& weight,
                                                       const std::optional<at::Tensor>& bias, int64_t group_size,
                                                       double eps) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() >= 1, "layer_norm_modulate: x must be a CUDA tensor of shape (..., D)");
  const int64_t D = x_in.size(-1);
  check_table(shift_in, x_in, D, "shift");
  check_table(scale_in, x_in, D, "scale");
  TORCH_CHECK(shift_in.size(0) == scale_in.size(0), "layer_norm_modulate: shift has ", shift_in.size(0),
              " rows but scale has ", scale_in.size(0));
  check_affine(weight, x_in, D, "weight");
  check_affine(bias, x_in, D, "bias");
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto stat_sizes = x_in.sizes().vec();
  stat_sizes.pop_back();
  const auto fopts = x_in.options().dtype(at::kFloat);
  const int64_t rows = D == 0 ? 0 : x_in.numel() / D;
  if (rows == 0) {  // (B, 0, D) and the like: nothing to compute, and no launch of an empty grid
    return {at::empty(x_in.sizes(), x_in.options()), at::empty(stat_sizes, fopts), at::empty(stat_sizes, fopts)};
  }
  const at::ScalarType mod_type = table_dtype(x_in, shift_in, scale_in);
  const DType xd = to_dtype(x_in.scalar_type(), "x");
  const DType md = to_dtype(mod_type, "shift and scale");
  check_kernel_input(D, xd, md);
  TORCH_CHECK(group_size >= 1 && shift_in.size(0) * group_size == rows, "layer_norm_modulate: ", shift_in.size(0),
              " modulation rows x group_size ", group_size, " != ", rows, " rows of x");

  const at::Tensor x = aligned(x_in);
  const at::Tensor shift = aligned_table(shift_in.to(mod_type));
  const at::Tensor scale = aligned_table(scale_in.to(mod_type));
  const auto [w, b] = affine_pair(weight, bias, x, D);
  auto y = at::empty(x.sizes(), x.options());
  auto mean = at::empty(stat_sizes, fopts);
  auto rstd = at::empty(stat_sizes, fopts);
  adaptiveload::LnModFwdArgs a;
  a.x = x.data_ptr();
  a.shift = shift.data_ptr();
  a.scale = scale.data_ptr();
  a.weight = w.has_value() ? w->data_ptr<float>() : nullptr;
  a.bias = b.has_value() ? b->data_ptr<float>() : nullptr;
  a.y = y.data_ptr();
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.rows = rows;
  a.D = D;
  a.group_size = group_size;
  a.shift_stride = shift.stride(0);
  a.scale_stride = scale.stride(0);
  a.eps = static_cast<float>(eps);
  a.x_dtype = xd;
  a.mod_dtype = md;
  check_cuda(adaptiveload::ln_mod_forward(a, c10::cuda::getCurrentCUDAStream()), "forward launch");
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& scale_in,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean_in,
    const at::Tensor& rstd_in, int64_t group_size) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() >= 1, "layer_norm_modulate: x must be a CUDA tensor of shape (..., D)");
  TORCH_CHECK(dy_in.sizes() == x_in.sizes(), "layer_norm_modulate: the gradient has shape ", dy_in.sizes(),
              " but x has ", x_in.sizes());
  const int64_t D = x_in.size(-1);
  check_table(scale_in, x_in, D, "scale");
  check_affine(weight, x_in, D, "weight");
  check_affine(bias, x_in, D, "bias");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t rows = D == 0 ? 0 : x_in.numel() / D;
  const auto fopts = x_in.options().dtype(at::kFloat);
  const auto table_opts = scale_in.options().memory_format(at::MemoryFormat::Contiguous);
  auto affine_grad = [&](const std::optional<at::Tensor>& t) {
    return t.has_value() ? at::zeros({D}, fopts) : at::empty({0}, fopts);
  };
  if (rows == 0) {  // no rows: empty dx, zero sums
    return {at::empty(x_in.sizes(), x_in.options()), at::zeros({scale_in.size(0), D}, table_opts),
            at::zeros({scale_in.size(0), D}, table_opts), affine_grad(weight), affine_grad(bias)};
  }
  const at::ScalarType mod_type = table_dtype(x_in, scale_in, scale_in);
  const DType xd = to_dtype(x_in.scalar_type(), "x");
  const DType md = to_dtype(mod_type, "scale");
  check_kernel_input(D, xd, md);
  TORCH_CHECK(group_size >= 1 && scale_in.size(0) * group_size == rows, "layer_norm_modulate: ", scale_in.size(0),
              " modulation rows x group_size ", group_size, " != ", rows, " rows of x");
  TORCH_CHECK(mean_in.numel() == rows && rstd_in.numel() == rows && mean_in.scalar_type() == at::kFloat &&
                  rstd_in.scalar_type() == at::kFloat,
              "layer_norm_modulate: mean and rstd must be the forward's float32 statistics, one per row of x");

  const at::Tensor x = aligned(x_in);
  const at::Tensor dy = aligned(dy_in.to(x.scalar_type()));
  const at::Tensor scale = aligned_table(scale_in.to(mod_type));
  const at::Tensor mean = mean_in.contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const auto [w, b] = affine_pair(weight, bias, x, D);
  const bool affine = w.has_value();

  adaptiveload::LnModBwdArgs a;
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.scale = scale.data_ptr();
  a.weight = affine ? w->data_ptr<float>() : nullptr;
  a.bias = affine ? b->data_ptr<float>() : nullptr;
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.rows = rows;
  a.D = D;
  a.group_size = group_size;
  a.scale_stride = scale.stride(0);
  a.x_dtype = xd;
  a.mod_dtype = md;
  auto dx = at::empty(x.sizes(), x.options());
  const auto mod_opts = scale.options().memory_format(at::MemoryFormat::Contiguous);
  auto dshift = at::empty({scale.size(0), D}, mod_opts);
  auto dscale = at::empty({scale.size(0), D}, mod_opts);
  auto dweight = affine ? at::empty({D}, fopts) : at::empty({0}, fopts);
  auto dbias = affine ? at::empty({D}, fopts) : at::empty({0}, fopts);
  a.dx = dx.data_ptr();
  a.dshift = dshift.data_ptr();
  a.dscale = dscale.data_ptr();
  a.dweight = affine ? dweight.data_ptr<float>() : nullptr;
  a.dbias = affine ? dbias.data_ptr<float>() : nullptr;
  adaptiveload::LnModBwdPlan plan;
  check_cuda(adaptiveload::ln_mod_backward_plan(a, &plan), "backward plan");
  auto workspace = at::empty({static_cast<int64_t>(plan.workspace_bytes) + 16}, x.options().dtype(at::kByte));
  check_cuda(adaptiveload::ln_mod_backward(a, plan, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()),
             "backward launch");
  // Gradients in their inputs' dtypes; a missing affine argument gets an empty gradient (the schema's
  // outputs are tensors, never None).
  const auto empty = at::empty({0}, fopts);
  return {dx, dshift.to(scale_in.scalar_type()), dscale.to(scale_in.scalar_type()),
          weight.has_value() ? dweight : empty, bias.has_value() ? dbias : empty};
}

}  // namespace

// The schemas. The tables are normalized by lightning_adaptiveload.ops.layer_norm_modulate: shift and
// scale are (groups, D), row g serving rows [g * group_size, (g + 1) * group_size) of x viewed as (rows, D).
// Returns y and the fp32 mean and rstd of each row (saved for the backward); the backward returns the
// gradients of x, shift, scale, weight and bias (the last two empty when the argument was None).
TORCH_LIBRARY(lightning_adaptiveload, m) {
  m.def(
      "layer_norm_modulate(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, "
      "SymInt group_size, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_modulate_backward(Tensor dy, Tensor x, Tensor scale, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, SymInt group_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lightning_adaptiveload, CUDA, m) {
  m.impl("layer_norm_modulate", &forward);
  m.impl("layer_norm_modulate_backward", &backward);
}
