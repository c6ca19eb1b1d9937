// Benchmark-only binding of the fused LayerNorm-Modulate kernels: the launchers' tuning overrides (warps
// per row, rows per CTA, forward kernel path, backward vectors per thread and row slots) and the backward's
// launch plan, as a pybind module. Built by benchmarks/modulate_variants.py from the kernel sources in
// csrc/ with ADAPTIVELOAD_BENCH_VARIANTS defined, which adds kernel variants the shipped build leaves out
// (the persistent forward under an 80-register cap, path 3). The shipped operator is csrc/ln_modulate_binding.cpp.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

#include "ln_modulate.h"

#ifndef ADAPTIVELOAD_BENCH_VARIANTS
#error "build with -DADAPTIVELOAD_BENCH_VARIANTS (benchmarks/modulate_variants.py)"
#endif

namespace {

using adaptiveload::DType;

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "layer_norm_modulate: ", name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "layer_norm_modulate: ", what, " failed: ", cudaGetErrorString(err));
}

// A (groups, D) modulation table: last dim contiguous, rows 16-byte aligned.
void check_mod(const at::Tensor& m, const at::Tensor& x, int64_t D, const char* name) {
  TORCH_CHECK(m.device() == x.device(), "layer_norm_modulate: ", name, " is on ", m.device(), " but x is on ", x.device());
  TORCH_CHECK(m.dim() == 2 && m.size(1) == D, "layer_norm_modulate: ", name, " must be (groups, ", D, "), got ", m.sizes());
  TORCH_CHECK(m.stride(1) == 1 && aligned16(m) && (m.size(0) <= 1 || (m.stride(0) * m.element_size()) % 16 == 0),
              "layer_norm_modulate: ", name, " rows must be 16-byte aligned with a contiguous last dim (strides ",
              m.strides(), ")");
}

void check_affine(const std::optional<at::Tensor>& w, const at::Tensor& x, int64_t D, const char* name) {
  if (!w.has_value()) return;
  TORCH_CHECK(w->device() == x.device() && w->scalar_type() == at::kFloat && w->dim() == 1 && w->size(0) == D &&
                  w->is_contiguous() && aligned16(*w),
              "layer_norm_modulate: ", name, " must be a contiguous float32 (", D, ",) tensor on ", x.device());
}

std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                                const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                int64_t group_size, double eps, int64_t warps_per_row, int64_t rows_per_cta,
                                int64_t path) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1, "layer_norm_modulate: x must be a CUDA tensor");
  TORCH_CHECK(x.is_contiguous() && aligned16(x), "layer_norm_modulate: x must be contiguous and 16-byte aligned");
  const int64_t D = x.size(-1);
  const DType xd = to_dtype(x, "x");
  const DType md = to_dtype(shift, "shift");
  TORCH_CHECK(scale.scalar_type() == shift.scalar_type(), "layer_norm_modulate: shift and scale dtypes differ");
  const char* bad = adaptiveload::ln_mod_check(D, xd, md);
  TORCH_CHECK(bad == nullptr, "layer_norm_modulate: ", bad, " (D = ", D, ")");
  check_mod(shift, x, D, "shift");
  check_mod(scale, x, D, "scale");
  TORCH_CHECK(shift.size(0) == scale.size(0), "layer_norm_modulate: shift and scale have different group counts");
  TORCH_CHECK(weight.has_value() == bias.has_value(), "layer_norm_modulate: pass weight and bias together");
  check_affine(weight, x, D, "weight");
  check_affine(bias, x, D, "bias");
  const int64_t rows = D == 0 ? 0 : x.numel() / D;
  TORCH_CHECK(group_size >= 1 && shift.size(0) * group_size == rows, "layer_norm_modulate: ", shift.size(0),
              " modulation rows x group_size ", group_size, " != ", rows, " rows of x");

  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  auto stat_sizes = x.sizes().vec();
  stat_sizes.pop_back();
  auto mean = at::empty(stat_sizes, x.options().dtype(at::kFloat));
  auto rstd = at::empty(stat_sizes, x.options().dtype(at::kFloat));
  adaptiveload::LnModFwdArgs a;
  a.x = x.data_ptr();
  a.shift = shift.data_ptr();
  a.scale = scale.data_ptr();
  a.weight = weight.has_value() ? weight->data_ptr<float>() : nullptr;
  a.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
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
  a.warps_per_row = static_cast<int>(warps_per_row);
  a.rows_per_cta = static_cast<int>(rows_per_cta);
  a.path = static_cast<int>(path);
  check_cuda(adaptiveload::ln_mod_forward(a, c10::cuda::getCurrentCUDAStream()), "forward launch");
  return {y, mean, rstd};
}

adaptiveload::LnModBwdArgs bwd_args(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                    const at::Tensor& mean, const at::Tensor& rstd, int64_t group_size,
                                    int64_t vectors_per_thread, int64_t slots) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && aligned16(x), "layer_norm_modulate: x must be contiguous CUDA");
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type() && dy.is_contiguous() && aligned16(dy),
              "layer_norm_modulate: the gradient must be contiguous with x's shape and dtype");
  const int64_t D = x.size(-1);
  const DType xd = to_dtype(x, "x");
  const DType md = to_dtype(scale, "scale");
  const char* bad = adaptiveload::ln_mod_check(D, xd, md);
  TORCH_CHECK(bad == nullptr, "layer_norm_modulate: ", bad, " (D = ", D, ")");
  check_mod(scale, x, D, "scale");
  check_affine(weight, x, D, "weight");
  check_affine(bias, x, D, "bias");
  TORCH_CHECK(weight.has_value() == bias.has_value(), "layer_norm_modulate: pass weight and bias together");
  const int64_t rows = x.numel() / D;
  TORCH_CHECK(mean.is_contiguous() && rstd.is_contiguous() && mean.numel() == rows && rstd.numel() == rows &&
                  mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat,
              "layer_norm_modulate: mean and rstd must be the forward's contiguous float32 statistics");
  TORCH_CHECK(group_size >= 1 && scale.size(0) * group_size == rows, "layer_norm_modulate: ", scale.size(0),
              " modulation rows x group_size ", group_size, " != ", rows, " rows of x");
  adaptiveload::LnModBwdArgs a;
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.scale = scale.data_ptr();
  a.weight = weight.has_value() ? weight->data_ptr<float>() : nullptr;
  a.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.rows = rows;
  a.D = D;
  a.group_size = group_size;
  a.scale_stride = scale.stride(0);
  a.x_dtype = xd;
  a.mod_dtype = md;
  a.vectors_per_thread = static_cast<int>(vectors_per_thread);
  a.slots = static_cast<int>(slots);
  a.path = adaptiveload::kBwdRegs;  // this module times the register-fed backward (version 5: the library's
                                    // private _norm_modulate_backward_tuned operator)
  return a;
}

std::vector<at::Tensor> backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale,
                                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                                 const at::Tensor& mean, const at::Tensor& rstd, int64_t group_size,
                                 int64_t vectors_per_thread, int64_t slots) {
  const c10::cuda::CUDAGuard guard(x.device());
  auto a = bwd_args(dy, x, scale, weight, bias, mean, rstd, group_size, vectors_per_thread, slots);
  auto dx = at::empty_like(x);
  auto dshift = at::empty({scale.size(0), a.D}, scale.options().memory_format(at::MemoryFormat::Contiguous));
  auto dscale = at::empty({scale.size(0), a.D}, scale.options().memory_format(at::MemoryFormat::Contiguous));
  auto fopts = x.options().dtype(at::kFloat);
  auto dweight = weight.has_value() ? at::empty({a.D}, fopts) : at::empty({0}, fopts);
  auto dbias = weight.has_value() ? at::empty({a.D}, fopts) : at::empty({0}, fopts);
  if (a.rows == 0) {
    dshift.zero_();
    dscale.zero_();
    dweight.zero_();
    dbias.zero_();
    return {dx, dshift, dscale, dweight, dbias};
  }
  a.dx = dx.data_ptr();
  a.dshift = dshift.data_ptr();
  a.dscale = dscale.data_ptr();
  a.dweight = weight.has_value() ? dweight.data_ptr<float>() : nullptr;
  a.dbias = weight.has_value() ? dbias.data_ptr<float>() : nullptr;
  adaptiveload::LnModBwdPlan plan;
  check_cuda(adaptiveload::ln_mod_backward_plan(a, &plan), "backward plan");
  auto workspace = at::empty({static_cast<int64_t>(plan.workspace_bytes) + 16}, x.options().dtype(at::kByte));
  check_cuda(adaptiveload::ln_mod_backward(a, plan, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()),
             "backward launch");
  return {dx, dshift, dscale, dweight, dbias};
}

// The backward's launch plan, for benchmarks and tests: {vpt, rows_per_iter, tpr, slots, grid, chunks,
// rows_per_chunk, num_items, smem_bytes, workspace_bytes}.
std::vector<int64_t> backward_plan(const at::Tensor& x, const at::Tensor& scale, bool affine, int64_t group_size,
                                   int64_t vectors_per_thread, int64_t slots) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t D = x.size(-1);
  adaptiveload::LnModBwdArgs a;
  a.rows = x.numel() / D;
  a.D = D;
  a.group_size = group_size;
  a.x_dtype = to_dtype(x, "x");
  a.mod_dtype = to_dtype(scale, "scale");
  static float dummy = 0.f;
  a.weight = affine ? &dummy : nullptr;
  a.vectors_per_thread = static_cast<int>(vectors_per_thread);
  a.slots = static_cast<int>(slots);
  a.path = adaptiveload::kBwdRegs;  // this module times the register-fed backward (version 5: the library's
                                    // private _norm_modulate_backward_tuned operator)
  adaptiveload::LnModBwdPlan p;
  check_cuda(adaptiveload::ln_mod_backward_plan(a, &p), "backward plan");
  return {p.vpt, p.rows_per_iter, p.tpr, p.slots, p.grid, p.chunks, p.rows_per_chunk, p.num_items,
          static_cast<int64_t>(p.smem_bytes), static_cast<int64_t>(p.workspace_bytes)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused LayerNorm-Modulate kernels with tuning overrides (benchmarks only)";
  m.def("forward", &forward,
        "y, mean, rstd = forward(x, shift, scale, weight, bias, group_size, eps, warps_per_row, rows_per_cta, "
        "path=0); path: 0 choose, 1 single-row kernel, 2 persistent kernel, 3 persistent at 80 registers (benchmarks)",
        pybind11::arg("x"), pybind11::arg("shift"), pybind11::arg("scale"), pybind11::arg("weight"),
        pybind11::arg("bias"), pybind11::arg("group_size"), pybind11::arg("eps"), pybind11::arg("warps_per_row"),
        pybind11::arg("rows_per_cta"), pybind11::arg("path") = 0);
  m.def("backward", &backward,
        "dx, dshift, dscale, dweight, dbias = backward(dy, x, scale, weight, bias, mean, rstd, group_size, vpt, slots)");
  m.def("backward_plan", &backward_plan, "launch plan of the backward (benchmarks)");
}
