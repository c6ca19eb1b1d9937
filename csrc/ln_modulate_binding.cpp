// The operators lightning_adaptiveload::layer_norm_modulate and rms_norm_modulate and their backwards:
// schemas (TORCH_LIBRARY), CUDA kernels (TORCH_LIBRARY_IMPL CUDA) and the autograd formulas (TORCH_LIBRARY_IMPL
// Autograd) registered with the dispatcher, as PyTorch's own extensions do. Python
// (lightning_adaptiveload/ops/layer_norm_modulate.py, rms_norm_modulate.py) adds the fake (shape)
// implementations and a plain-PyTorch implementation for other devices.
//
// The autograd formula lives here, in C++, so that an eager call costs no Python autograd machinery: the
// Python registration of the same formula (torch.library.register_autograd) is what runs where this library
// is not loaded. Both call the backward operator; the CUDA tests check that the two agree.
//
// The CUDA kernels here take any input the schema allows and prepare it for the launchers (ln_modulate.h):
// x contiguous and 16-byte aligned, shift and scale tables with aligned rows in one dtype (x's or fp32),
// weight and bias as an fp32 pair. Input they cannot serve (D not a multiple of 8, dtypes other than
// bf16/fp16/fp32) is an error that names the public function, which falls back to the reference instead.
//
// adaptiveload::norm_modulate_eager (norm_mod_eager.h) serves the library's eager fast path
// (norm_mod_python.cpp): the modulation viewed as tables below autograd, the CUDA kernel, and a graph node of
// its own (NormModulateBackward) with the same backward formula (norm_backward_call).
//
// Three private operators (_norm_modulate_tuned, _norm_modulate_backward_tuned, _norm_modulate_plans) take
// the launchers' tuning overrides and report their plans, for benchmarks/kernels/ only; they have no
// autograd and no fake implementation.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <atomic>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ln_modulate.h"
#include "norm_mod_direct.h"
#include "norm_mod_eager.h"

namespace {

using adaptiveload::DType;

const char* op_name(bool rms) { return rms ? "rms_norm_modulate" : "layer_norm_modulate"; }

DType to_dtype(at::ScalarType t, const char* name, bool rms) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, op_name(rms), ": ", name, " must be float32, float16 or bfloat16, got ", t,
                  "; lightning_adaptiveload.ops.", op_name(rms),
                  " computes other dtypes with the plain-PyTorch reference");
  }
  return DType::kFloat32;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
bool aligned16(const at::Tensor& t) { return aligned16(t.data_ptr()); }

// A new contiguous CUDA tensor on `like`'s device, from the caching allocator without a dispatcher round
// trip: what at::empty's CUDA kernel does, here where the kernels already run on CUDA (the operators' CUDA
// kernels and the direct launch). Every output is written in full by the kernels before it is read.
at::Tensor fresh(c10::IntArrayRef sizes, at::ScalarType type, const at::Tensor& like) {
  return at::detail::empty_cuda(sizes, type, like.device(), std::nullopt);
}

// t in dtype `type`, without a dispatcher round trip when it already is (eager calls pay for every one).
at::Tensor as_type(const at::Tensor& t, at::ScalarType type) { return t.scalar_type() == type ? t : t.to(type); }

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

void check_cuda(cudaError_t err, const char* what, bool rms) {
  TORCH_CHECK(err == cudaSuccess, op_name(rms), ": ", what, " failed: ", cudaGetErrorString(err));
}

void check_table(const at::Tensor& m, const at::Tensor& x, int64_t D, const char* name, bool rms) {
  TORCH_CHECK(m.device() == x.device(), op_name(rms), ": ", name, " is on ", m.device(), " but x is on ",
              x.device(), "; move both to one device");
  TORCH_CHECK(m.dim() == 2 && m.size(1) == D, op_name(rms), ": ", name, " must be a (groups, ", D,
              ") table, got ", m.sizes());
}

void check_affine(const std::optional<at::Tensor>& w, const at::Tensor& x, int64_t D, const char* name, bool rms) {
  if (!w.has_value()) return;
  TORCH_CHECK(w->device() == x.device() && w->dim() == 1 && w->size(0) == D, op_name(rms), ": ", name,
              " must be a (", D, ",) tensor on ", x.device(), ", got ", w->sizes(), " on ", w->device());
}

// shift and scale in x's dtype when both have it, else in fp32 (the kernels read either).
at::ScalarType table_dtype(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type() ? x.scalar_type() : at::kFloat;
}

void check_kernel_input(int64_t D, DType xd, DType md, bool rms) {
  const char* bad = adaptiveload::ln_mod_check(D, xd, md);
  TORCH_CHECK(bad == nullptr, op_name(rms), ": ", bad, " (D = ", D, "); lightning_adaptiveload.ops.", op_name(rms),
              " computes such input with the plain-PyTorch reference");
}

// The affine as the kernels take it: both or neither, fp32, contiguous and aligned.
std::pair<std::optional<at::Tensor>, std::optional<at::Tensor>> affine_pair(const std::optional<at::Tensor>& w,
                                                                            const std::optional<at::Tensor>& b,
                                                                            const at::Tensor& x, int64_t D) {
  if (!w.has_value() && !b.has_value()) return {std::nullopt, std::nullopt};
  const auto fopts = x.options().dtype(at::kFloat);
  at::Tensor wf = w.has_value() ? aligned(as_type(*w, at::kFloat)) : at::ones({D}, fopts);
  at::Tensor bf = b.has_value() ? aligned(as_type(*b, at::kFloat)) : at::zeros({D}, fopts);
  return {wf, bf};
}

// Launch overrides of the private benchmark operators (all 0 for the public ones: the launchers choose).
struct Tuning {
  int path = 0;
  int threads = 0;  // forward: threads per row (a multiple of 32); backward: vectors per thread
  int rows = 0;     // backward: rows per iteration (bulk-copy path)
  int stages = 0;
};

// Returns (y, mean, rstd); mean is empty for RMSNorm.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_forward(const at::Tensor& x_in, const at::Tensor& shift_in,
                                                            const at::Tensor& scale_in,
                                                            const std::optional<at::Tensor>& weight,
                                                            const std::optional<at::Tensor>& bias, int64_t group_size,
                                                            double eps, bool rms, const Tuning& tune) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() >= 1, op_name(rms), ": x must be a CUDA tensor of shape (..., D)");
  const int64_t D = x_in.size(-1);
  check_table(shift_in, x_in, D, "shift", rms);
  check_table(scale_in, x_in, D, "scale", rms);
  TORCH_CHECK(shift_in.size(0) == scale_in.size(0), op_name(rms), ": shift has ", shift_in.size(0),
              " rows but scale has ", scale_in.size(0));
  check_affine(weight, x_in, D, "weight", rms);
  check_affine(bias, x_in, D, "bias", rms);
  const c10::cuda::CUDAGuard guard(x_in.device());
  auto stat_sizes = x_in.sizes().vec();
  stat_sizes.pop_back();
  const auto fopts = x_in.options().dtype(at::kFloat);
  const int64_t rows = D == 0 ? 0 : x_in.numel() / D;
  auto mean_for = [&](c10::IntArrayRef sizes) {
    return rms ? fresh({0}, at::kFloat, x_in) : fresh(sizes, at::kFloat, x_in);
  };
  if (rows == 0) {  // (B, 0, D) and the like: nothing to compute, and no launch of an empty grid
    return {at::empty(x_in.sizes(), x_in.options()), mean_for(stat_sizes), at::empty(stat_sizes, fopts)};
  }
  const at::ScalarType mod_type = table_dtype(x_in, shift_in, scale_in);
  const DType xd = to_dtype(x_in.scalar_type(), "x", rms);
  const DType md = to_dtype(mod_type, "shift and scale", rms);
  check_kernel_input(D, xd, md, rms);
  TORCH_CHECK(group_size >= 1 && shift_in.size(0) * group_size == rows, op_name(rms), ": ", shift_in.size(0),
              " modulation rows x group_size ", group_size, " != ", rows, " rows of x");

  const at::Tensor x = aligned(x_in);
  const at::Tensor shift = aligned_table(as_type(shift_in, mod_type));
  const at::Tensor scale = aligned_table(as_type(scale_in, mod_type));
  const auto [w, b] = affine_pair(weight, bias, x, D);
  auto y = fresh(x.sizes(), x.scalar_type(), x);
  auto mean = mean_for(stat_sizes);
  auto rstd = fresh(stat_sizes, at::kFloat, x);
  adaptiveload::LnModFwdArgs a;
  a.x = x.data_ptr();
  a.shift = shift.data_ptr();
  a.scale = scale.data_ptr();
  a.weight = w.has_value() ? w->data_ptr<float>() : nullptr;
  a.bias = b.has_value() ? b->data_ptr<float>() : nullptr;
  a.y = y.data_ptr();
  a.mean = rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.rows = rows;
  a.D = D;
  a.group_size = group_size;
  a.shift_stride = shift.stride(0);
  a.scale_stride = scale.stride(0);
  a.eps = static_cast<float>(eps);
  a.x_dtype = xd;
  a.mod_dtype = md;
  a.rms = rms;
  a.path = tune.path;
  a.warps_per_row = tune.threads / 32;
  a.stages = tune.stages;
  check_cuda(adaptiveload::ln_mod_forward(a, c10::cuda::getCurrentCUDAStream()), "forward launch", rms);
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& scale_in,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean_in, const at::Tensor& rstd_in, int64_t group_size, bool rms,
    const Tuning& tune, c10::IntArrayRef shift_sizes = {}, c10::IntArrayRef scale_sizes = {}) {
  TORCH_CHECK(x_in.is_cuda() && x_in.dim() >= 1, op_name(rms), ": x must be a CUDA tensor of shape (..., D)");
  TORCH_CHECK(dy_in.sizes() == x_in.sizes(), op_name(rms), ": the gradient has shape ", dy_in.sizes(),
              " but x has ", x_in.sizes());
  const int64_t D = x_in.size(-1);
  check_table(scale_in, x_in, D, "scale", rms);
  check_affine(weight, x_in, D, "weight", rms);
  check_affine(bias, x_in, D, "bias", rms);
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
  const DType xd = to_dtype(x_in.scalar_type(), "x", rms);
  const DType md = to_dtype(mod_type, "scale", rms);
  check_kernel_input(D, xd, md, rms);
  TORCH_CHECK(group_size >= 1 && scale_in.size(0) * group_size == rows, op_name(rms), ": ", scale_in.size(0),
              " modulation rows x group_size ", group_size, " != ", rows, " rows of x");
  TORCH_CHECK(rstd_in.numel() == rows && rstd_in.scalar_type() == at::kFloat &&
                  (rms || (mean_in.has_value() && mean_in->numel() == rows && mean_in->scalar_type() == at::kFloat)),
              op_name(rms), ": the saved statistics must be the forward's float32 ", rms ? "rstd" : "mean and rstd",
              ", one per row of x");

  const at::Tensor x = aligned(x_in);
  const at::Tensor dy = aligned(as_type(dy_in, x.scalar_type()));
  const at::Tensor scale = aligned_table(as_type(scale_in, mod_type));
  const at::Tensor mean = rms ? at::Tensor() : mean_in->contiguous();
  const at::Tensor rstd = rstd_in.contiguous();
  const auto [w, b] = affine_pair(weight, bias, x, D);
  const bool affine = w.has_value();

  adaptiveload::LnModBwdArgs a;
  a.dy = dy.data_ptr();
  a.x = x.data_ptr();
  a.scale = scale.data_ptr();
  a.weight = affine ? w->data_ptr<float>() : nullptr;
  a.bias = affine ? b->data_ptr<float>() : nullptr;
  a.mean = rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.rows = rows;
  a.D = D;
  a.group_size = group_size;
  a.scale_stride = scale.stride(0);
  a.x_dtype = xd;
  a.mod_dtype = md;
  a.rms = rms;
  a.path = tune.path;
  a.vectors_per_thread = tune.threads;
  a.slots = tune.rows;
  a.stages = tune.stages;
  auto dx = fresh(x.sizes(), x.scalar_type(), x);
  // The table gradients in the shapes the caller asked for (the fast path's node: its inputs' shapes),
  // else (groups, D); the kernels write them as (groups, D) rows either way.
  const std::vector<int64_t> table_sizes = {scale.size(0), D};
  auto dshift = fresh(shift_sizes.empty() ? c10::IntArrayRef(table_sizes) : shift_sizes, scale.scalar_type(), x);
  auto dscale = fresh(scale_sizes.empty() ? c10::IntArrayRef(table_sizes) : scale_sizes, scale.scalar_type(), x);
  TORCH_CHECK(dshift.numel() == scale.size(0) * D && dscale.numel() == scale.size(0) * D, op_name(rms),
              ": the requested gradient shapes ", shift_sizes, " / ", scale_sizes, " do not hold ", scale.size(0),
              " x ", D, " values");
  auto dweight = fresh({affine ? D : 0}, at::kFloat, x);
  auto dbias = fresh({affine ? D : 0}, at::kFloat, x);
  a.dx = dx.data_ptr();
  a.dshift = dshift.data_ptr();
  a.dscale = dscale.data_ptr();
  a.dweight = affine ? dweight.data_ptr<float>() : nullptr;
  a.dbias = affine ? dbias.data_ptr<float>() : nullptr;
  adaptiveload::LnModBwdPlan plan;
  check_cuda(adaptiveload::ln_mod_backward_plan(a, &plan), "backward plan", rms);
  at::Tensor workspace;
  void* ws = nullptr;
  if (plan.workspace_bytes > 0) {
    workspace = fresh({static_cast<int64_t>(plan.workspace_bytes) + 16}, at::kByte, x);
    ws = workspace.data_ptr();
  }
  check_cuda(adaptiveload::ln_mod_backward(a, plan, ws, c10::cuda::getCurrentCUDAStream()), "backward launch", rms);
  // Gradients in their inputs' dtypes; a missing affine argument gets an empty gradient (the schema's
  // outputs are tensors, never None).
  const auto empty = fresh({0}, at::kFloat, x);
  return {dx, as_type(dshift, scale_in.scalar_type()), as_type(dscale, scale_in.scalar_type()),
          weight.has_value() ? dweight : empty, bias.has_value() ? dbias : empty};
}

// ---------------------------------------------------------------------------------------------------------
// The public operators' CUDA kernels.

std::tuple<at::Tensor, at::Tensor, at::Tensor> ln_forward(const at::Tensor& x, const at::Tensor& shift,
                                                          const at::Tensor& scale,
                                                          const std::optional<at::Tensor>& weight,
                                                          const std::optional<at::Tensor>& bias, int64_t group_size,
                                                          double eps) {
  return norm_forward(x, shift, scale, weight, bias, group_size, eps, false, Tuning());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ln_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd, int64_t group_size) {
  return norm_backward(dy, x, scale, weight, bias, mean, rstd, group_size, false, Tuning());
}

std::tuple<at::Tensor, at::Tensor> rms_forward(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                                               const std::optional<at::Tensor>& weight,
                                               const std::optional<at::Tensor>& bias, int64_t group_size,
                                               double eps) {
  auto [y, mean, rstd] = norm_forward(x, shift, scale, weight, bias, group_size, eps, true, Tuning());
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rms_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& rstd, int64_t group_size) {
  return norm_backward(dy, x, scale, weight, bias, std::nullopt, rstd, group_size, true, Tuning());
}

// ---------------------------------------------------------------------------------------------------------
// The private benchmark operators.

std::tuple<at::Tensor, at::Tensor, at::Tensor> tuned_forward(const at::Tensor& x, const at::Tensor& shift,
                                                             const at::Tensor& scale,
                                                             const std::optional<at::Tensor>& weight,
                                                             const std::optional<at::Tensor>& bias,
                                                             int64_t group_size, double eps, bool rms, int64_t path,
                                                             int64_t threads, int64_t stages) {
  Tuning t;
  t.path = static_cast<int>(path);
  t.threads = static_cast<int>(threads);
  t.stages = static_cast<int>(stages);
  return norm_forward(x, shift, scale, weight, bias, group_size, eps, rms, t);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> tuned_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
    int64_t group_size, bool rms, int64_t path, int64_t vectors_per_thread, int64_t rows, int64_t stages) {
  Tuning t;
  t.path = static_cast<int>(path);
  t.threads = static_cast<int>(vectors_per_thread);
  t.rows = static_cast<int>(rows);
  t.stages = static_cast<int>(stages);
  return norm_backward(dy, x, scale, weight, bias, mean, rstd, group_size, rms, t);
}

// [forward: tma, threads, vpt, stages, per_row, grid, rows_per_cta, smem, ctas_per_sm;
//  backward: tma, threads, vpt, stages, per_row, grid, chunks, rows_per_chunk, items, smem, workspace,
//  rows per iteration]
std::vector<int64_t> plans(const at::Tensor& x, const at::Tensor& scale, int64_t group_size, bool rms, bool affine,
                           int64_t fwd_path, int64_t threads, int64_t fwd_stages, int64_t bwd_path,
                           int64_t vectors_per_thread, int64_t bwd_rows, int64_t bwd_stages) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 1 && x.numel() > 0, "_norm_modulate_plans: x must be a non-empty CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t D = x.size(-1);
  const DType xd = to_dtype(x.scalar_type(), "x", rms);
  const DType md = to_dtype(table_dtype(x, scale, scale), "scale", rms);
  check_kernel_input(D, xd, md, rms);
  static const float dummy = 0.f;  // plans read no data; the affine pointer only says whether there is one
  adaptiveload::LnModFwdArgs f;
  f.rows = x.numel() / D;
  f.D = D;
  f.group_size = group_size;
  f.x_dtype = xd;
  f.mod_dtype = md;
  f.rms = rms;
  f.weight = affine ? &dummy : nullptr;
  f.path = static_cast<int>(fwd_path);
  f.warps_per_row = static_cast<int>(threads / 32);
  f.stages = static_cast<int>(fwd_stages);
  adaptiveload::NormModFwdPlan fp;
  check_cuda(adaptiveload::norm_mod_forward_plan(f, &fp), "forward plan", rms);
  adaptiveload::LnModBwdArgs b;
  b.rows = f.rows;
  b.D = D;
  b.group_size = group_size;
  b.x_dtype = xd;
  b.mod_dtype = md;
  b.rms = rms;
  b.weight = f.weight;
  b.path = static_cast<int>(bwd_path);
  b.vectors_per_thread = static_cast<int>(vectors_per_thread);
  b.slots = static_cast<int>(bwd_rows);
  b.stages = static_cast<int>(bwd_stages);
  adaptiveload::LnModBwdPlan bp;
  check_cuda(adaptiveload::ln_mod_backward_plan(b, &bp), "backward plan", rms);
  return {fp.tma,        fp.threads,     fp.vpt,          fp.stages,    fp.per_row,
          fp.grid,       fp.rows_per_cta, static_cast<int64_t>(fp.smem_bytes), fp.ctas_per_sm,
          bp.tma,        bp.tpr * bp.slots, bp.vpt,       bp.stages,    bp.per_row,
          bp.grid,       bp.chunks,      bp.rows_per_chunk, bp.num_items, static_cast<int64_t>(bp.smem_bytes),
          static_cast<int64_t>(bp.workspace_bytes), bp.rows_per_iter};
}

// ---------------------------------------------------------------------------------------------------------
// Autograd: y's gradient through the backward operator; the statistics are not differentiable.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> opt(const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; }

c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, c10::SymInt, double)>&
ln_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lightning_adaptiveload::layer_norm_modulate", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, c10::SymInt, double)>();
  return op;
}

c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, c10::SymInt)>&
ln_bwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lightning_adaptiveload::layer_norm_modulate_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, c10::SymInt)>();
  return op;
}

c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, c10::SymInt, double)>&
rms_fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lightning_adaptiveload::rms_norm_modulate", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, c10::SymInt, double)>();
  return op;
}

c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const at::Tensor&, c10::SymInt)>&
rms_bwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("lightning_adaptiveload::rms_norm_modulate_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const at::Tensor&, c10::SymInt)>();
  return op;
}

// The backward formula, one place for both autograd paths below: dy through the backward operator, dy
// zeros where y's gradient is undefined (only the statistics were used).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_backward_call(
    bool rms, const at::Tensor& dy_or_undef, const at::Tensor& x, const at::Tensor& scale_t, const at::Tensor& weight,
    const at::Tensor& bias, const at::Tensor& mean, const at::Tensor& rstd, const c10::SymInt& group_size) {
  const at::Tensor dy = dy_or_undef.defined() ? dy_or_undef : at::zeros_like(x);
  if (rms) return rms_bwd_op().call(dy, x, scale_t, opt(weight), opt(bias), rstd, group_size);
  return ln_bwd_op().call(dy, x, scale_t, opt(weight), opt(bias), mean, rstd, group_size);
}

// Gradients for the autograd functions' inputs (x, shift, scale, weight, bias, group_size, eps).
variable_list input_grads(const at::Tensor& dx, const at::Tensor& dshift, const at::Tensor& dscale,
                          const at::Tensor& dweight, const at::Tensor& dbias, bool has_w, bool has_b) {
  return {dx, dshift, dscale, has_w ? dweight : at::Tensor(), has_b ? dbias : at::Tensor(), at::Tensor(),
          at::Tensor()};
}

// The operators' Autograd kernels (the dispatcher's path: torch.ops calls, torch.compile, functorch).
class LayerNormModulateFn : public torch::autograd::Function<LayerNormModulateFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& shift,
                               const at::Tensor& scale, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, c10::SymInt group_size, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, mean, rstd] = ln_fwd_op().call(x, shift, scale, weight, bias, group_size, eps);
    ctx->save_for_backward({x, scale, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["group_size"] = std::move(group_size);
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dshift, dscale, dweight, dbias] = norm_backward_call(
        false, grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], saved[5],
        ctx->saved_data["group_size"].toSymInt());
    return input_grads(dx, dshift, dscale, dweight, dbias, saved[2].defined(), saved[3].defined());
  }
};

class RmsNormModulateFn : public torch::autograd::Function<RmsNormModulateFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& shift,
                               const at::Tensor& scale, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, c10::SymInt group_size, double eps) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [y, rstd] = rms_fwd_op().call(x, shift, scale, weight, bias, group_size, eps);
    ctx->save_for_backward({x, scale, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), rstd});
    ctx->saved_data["group_size"] = std::move(group_size);
    ctx->mark_non_differentiable({rstd});
    return {y, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dx, dshift, dscale, dweight, dbias] = norm_backward_call(
        true, grads[0], saved[0], saved[1], saved[2], saved[3], at::Tensor(), saved[4],
        ctx->saved_data["group_size"].toSymInt());
    return input_grads(dx, dshift, dscale, dweight, dbias, saved[2].defined(), saved[3].defined());
  }
};

// ---------------------------------------------------------------------------------------------------------
// The direct launch of the eager fast path (rules in norm_mod_direct.h).

std::atomic<int64_t> g_direct_fwd{0}, g_direct_bwd{0};  // launches taken, for tests and benchmarks

// Whether a profiler (or another RecordFunction callback) would see an operator call: then the call goes
// through the dispatcher, which reports it.
bool observed() { return at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION).has_value(); }

c10::DispatchKeySet keys_of(std::initializer_list<const at::Tensor*> ts) {
  c10::DispatchKeySet ks;
  for (const at::Tensor* t : ts) {
    if (t->defined()) ks = ks | t->key_set();
  }
  return ks;
}

bool direct_dispatch_ok(std::initializer_list<const at::Tensor*> ts) {
  return adaptiveload::direct::dispatcher_adds_nothing(keys_of(ts)) && !observed();
}

bool kernel_dtype(at::ScalarType t, DType* out) {
  switch (t) {
    case at::kFloat: *out = DType::kFloat32; return true;
    case at::kHalf: *out = DType::kFloat16; return true;
    case at::kBFloat16: *out = DType::kBFloat16; return true;
    default: return false;
  }
}

// The affine pair as the kernels read it in place (both or neither, fp32, contiguous, aligned, (D,)).
bool direct_affine(const at::Tensor& w, const at::Tensor& b, const at::Tensor& x, int64_t D) {
  if (!w.defined() && !b.defined()) return true;
  if (!w.defined() || !b.defined()) return false;
  for (const at::Tensor* t : {&w, &b}) {
    if (t->scalar_type() != at::kFloat || t->dim() != 1 || t->size(0) != D || !t->is_contiguous() ||
        t->device() != x.device() || !aligned16(t->data_ptr())) {
      return false;
    }
  }
  return true;
}

// y (and mean, rstd) of the operator launched without the dispatcher, or false where the rules do not
// allow it (the caller then takes the dispatcher).
bool direct_forward(bool rms, const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                    const at::Tensor& w, const at::Tensor& b, int64_t rows, int64_t group_size, double eps,
                    at::Tensor* y, at::Tensor* mean, at::Tensor* rstd) {
  const int64_t D = x.size(-1);
  if (D < 1 || x.numel() == 0 || x.numel() / D != rows * group_size || !x.is_contiguous() ||
      !aligned16(x.data_ptr())) {
    return false;
  }
  const at::ScalarType mt = table_dtype(x, shift, scale);
  DType xd, md;
  if (shift.scalar_type() != mt || scale.scalar_type() != mt || !kernel_dtype(x.scalar_type(), &xd) ||
      !kernel_dtype(mt, &md) || adaptiveload::ln_mod_check(D, xd, md) != nullptr) {
    return false;
  }
  if (shift.device() != x.device() || scale.device() != x.device() || !direct_affine(w, b, x, D)) return false;
  const int64_t ss = adaptiveload::direct::table_stride(shift.sizes(), shift.strides(), rows, D);
  const int64_t cs = adaptiveload::direct::table_stride(scale.sizes(), scale.strides(), rows, D);
  const int64_t es = static_cast<int64_t>(c10::elementSize(mt));
  if (ss < 0 || cs < 0 || !aligned16(shift.data_ptr()) || !aligned16(scale.data_ptr()) ||
      (rows > 1 && ((ss * es) % 16 != 0 || (cs * es) % 16 != 0))) {
    return false;
  }
  if (!direct_dispatch_ok({&x, &shift, &scale, &w, &b})) return false;

  const c10::cuda::CUDAGuard guard(x.device());
  const c10::IntArrayRef stat_sizes(x.sizes().data(), x.dim() - 1);
  *y = fresh(x.sizes(), x.scalar_type(), x);
  *rstd = fresh(stat_sizes, at::kFloat, x);
  if (!rms) *mean = fresh(stat_sizes, at::kFloat, x);
  adaptiveload::LnModFwdArgs a;
  a.x = x.data_ptr();
  a.shift = shift.data_ptr();
  a.scale = scale.data_ptr();
  a.weight = w.defined() ? w.data_ptr<float>() : nullptr;
  a.bias = b.defined() ? b.data_ptr<float>() : nullptr;
  a.y = y->data_ptr();
  a.mean = rms ? nullptr : mean->data_ptr<float>();
  a.rstd = rstd->data_ptr<float>();
  a.rows = x.numel() / D;
  a.D = D;
  a.group_size = group_size;
  a.shift_stride = ss;
  a.scale_stride = cs;
  a.eps = static_cast<float>(eps);
  a.x_dtype = xd;
  a.mod_dtype = md;
  a.rms = rms;
  check_cuda(adaptiveload::ln_mod_forward(a, c10::cuda::getCurrentCUDAStream(x.device().index())),
             "forward launch", rms);
  g_direct_fwd.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// t's elements as a (rows, D) table at row stride `stride` (direct::table_stride), made without the
// dispatcher: an alias of t's storage for the kernels to read, with no autograd history.
at::Tensor table_alias(const at::Tensor& t, int64_t rows, int64_t D, int64_t stride) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(t.storage()),
                                                   c10::DispatchKeySet(c10::DispatchKey::CUDA), t.dtype());
  const int64_t sizes[2] = {rows, D}, strides[2] = {stride, 1};
  impl->set_sizes_and_strides(c10::IntArrayRef(sizes), c10::IntArrayRef(strides),
                              std::optional<int64_t>(t.storage_offset()));
  return at::Tensor(std::move(impl));
}

// The eager fast path's graph node (norm_modulate_eager): what generated autograd code builds for a native
// op, a Node with its saved variables as members, with none of torch::autograd::Function's per-call
// bookkeeping (the context's string-keyed map, per-output info, output wrapping): on a CPU build that
// bookkeeping measured about 3x the cost of the node (docs/fused_op.md, "fourth pass (host)"). The same
// backward formula as the Functions below; the gradients of shift and scale leave in the shapes given.
// scale is saved as given (its version checked by SavedVariable) and read as its (rows, D) table here.
// Without grad mode (no double backward) and where the rules allow, the backward kernel is launched
// without the dispatcher too.
struct NormModulateBackward : public torch::autograd::Node {
  bool rms = false;
  bool has_w = false, has_b = false;
  torch::autograd::SavedVariable x, scale, weight, bias, mean, rstd;
  int64_t rows = 0;
  int64_t group_size = 1;
  std::vector<int64_t> shift_shape, scale_shape;

  variable_list apply(variable_list&& grads) override {
    // unpack() of a freed graph (a second backward without retain_graph) raises torch's own error.
    const at::Tensor x_ = x.unpack(), scale_ = scale.unpack(), w = weight.unpack(), b = bias.unpack();
    const at::Tensor mean_ = mean.unpack(), rstd_ = rstd.unpack();
    const at::Tensor& dy = grads[0];
    const int64_t D = x_.size(-1);
    if (!at::GradMode::is_enabled() && dy.defined() && x_.is_cuda() &&
        direct_dispatch_ok({&dy, &x_, &scale_, &w, &b, &mean_, &rstd_})) {
      const int64_t stride = adaptiveload::direct::table_stride(scale_.sizes(), scale_.strides(), rows, D);
      if (stride >= 0) {
        auto [dx, dshift, dscale, dweight, dbias] =
            norm_backward(dy, x_, table_alias(scale_, rows, D, stride), opt(w), opt(b),
                          rms ? std::nullopt : opt(mean_), rstd_, group_size, rms, Tuning(), shift_shape, scale_shape);
        g_direct_bwd.fetch_add(1, std::memory_order_relaxed);
        return {dx, dshift, dscale, has_w ? dweight : at::Tensor(), has_b ? dbias : at::Tensor()};
      }
    }
    auto [dx, dshift, dscale, dweight, dbias] = norm_backward_call(
        rms, dy, x_, scale_.reshape({rows, D}), w, b, mean_, rstd_, c10::SymInt(group_size));
    return {dx, dshift.reshape(shift_shape), dscale.reshape(scale_shape), has_w ? dweight : at::Tensor(),
            has_b ? dbias : at::Tensor()};
  }
  std::string name() const override { return rms ? "RmsNormModulateBackward" : "LayerNormModulateBackward"; }
  void release_variables() override {
    x.reset_data();
    scale.reset_data();
    weight.reset_data();
    bias.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> ln_autograd(const at::Tensor& x, const at::Tensor& shift,
                                                           const at::Tensor& scale,
                                                           const std::optional<at::Tensor>& weight,
                                                           const std::optional<at::Tensor>& bias,
                                                           c10::SymInt group_size, double eps) {
  auto out = LayerNormModulateFn::apply(x, shift, scale, weight, bias, std::move(group_size), eps);
  return {out[0], out[1], out[2]};
}

std::tuple<at::Tensor, at::Tensor> rms_autograd(const at::Tensor& x, const at::Tensor& shift,
                                                const at::Tensor& scale, const std::optional<at::Tensor>& weight,
                                                const std::optional<at::Tensor>& bias, c10::SymInt group_size,
                                                double eps) {
  auto out = RmsNormModulateFn::apply(x, shift, scale, weight, bias, std::move(group_size), eps);
  return {out[0], out[1]};
}

}  // namespace

namespace adaptiveload {

at::Tensor norm_modulate_eager(bool rms, const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale,
                               const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                               int64_t rows, int64_t group_size, double eps) {
  TORCH_CHECK(rows >= 1 && group_size >= 1, op_name(rms), ": the fast path needs rows and group_size >= 1");
  const at::Tensor w = weight.value_or(at::Tensor()), b = bias.value_or(at::Tensor());
  at::Tensor y, mean, rstd;
  if (!direct_forward(rms, x, shift, scale, w, b, rows, group_size, eps, &y, &mean, &rstd)) {
    // Below autograd: the table views and the operator through the dispatcher, no graph nodes.
    at::AutoDispatchBelowADInplaceOrView below;
    const int64_t D = x.size(-1);
    const c10::SymInt group(group_size);
    const at::Tensor shift_t = shift.reshape({rows, D}), scale_t = scale.reshape({rows, D});
    if (rms) {
      std::tie(y, rstd) = rms_fwd_op().call(x, shift_t, scale_t, weight, bias, group, eps);
    } else {
      std::tie(y, mean, rstd) = ln_fwd_op().call(x, shift_t, scale_t, weight, bias, group, eps);
    }
  }
  if (torch::autograd::compute_requires_grad(x, shift, scale, w, b)) {
    auto node = adaptiveload::new_autograd_node<NormModulateBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x, shift, scale, w, b));
    node->rms = rms;
    node->has_w = w.defined();
    node->has_b = b.defined();
    node->x = torch::autograd::SavedVariable(x, false);
    node->scale = torch::autograd::SavedVariable(scale, false);
    node->weight = torch::autograd::SavedVariable(w, false);
    node->bias = torch::autograd::SavedVariable(b, false);
    node->mean = torch::autograd::SavedVariable(mean, false);
    node->rstd = torch::autograd::SavedVariable(rstd, false);
    node->rows = rows;
    node->group_size = group_size;
    node->shift_shape = shift.sizes().vec();
    node->scale_shape = scale.sizes().vec();
    torch::autograd::set_history(y, node);
  }
  return y;
}

std::pair<int64_t, int64_t> direct_launches() {
  return {g_direct_fwd.load(std::memory_order_relaxed), g_direct_bwd.load(std::memory_order_relaxed)};
}

}  // namespace adaptiveload

// The schemas. The tables are normalized by lightning_adaptiveload.ops.layer_norm_modulate: shift and
// scale are (groups, D), row g serving rows [g * group_size, (g + 1) * group_size) of x viewed as (rows, D).
// The LayerNorm forward returns y and the fp32 mean and rstd of each row (saved for the backward), the
// RMSNorm forward y and rstd; the backwards return the gradients of x, shift, scale, weight and bias (the
// last two empty when the argument was None).
TORCH_LIBRARY(lightning_adaptiveload, m) {
  m.def(
      "layer_norm_modulate(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, "
      "SymInt group_size, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_modulate_backward(Tensor dy, Tensor x, Tensor scale, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, SymInt group_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "rms_norm_modulate(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, "
      "SymInt group_size, float eps) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_modulate_backward(Tensor dy, Tensor x, Tensor scale, Tensor? weight, Tensor? bias, "
      "Tensor rstd, SymInt group_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Private, for benchmarks/kernels/ (no autograd, no fake implementation).
  m.def(
      "_norm_modulate_tuned(Tensor x, Tensor shift, Tensor scale, Tensor? weight, Tensor? bias, "
      "int group_size, float eps, bool rms, int path, int threads, int stages) -> (Tensor, Tensor, Tensor)");
  m.def(
      "_norm_modulate_backward_tuned(Tensor dy, Tensor x, Tensor scale, Tensor? weight, Tensor? bias, "
      "Tensor? mean, Tensor rstd, int group_size, bool rms, int path, int vectors_per_thread, int rows, "
      "int stages) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "_norm_modulate_plans(Tensor x, Tensor scale, int group_size, bool rms, bool affine, int fwd_path, "
      "int threads, int fwd_stages, int bwd_path, int vectors_per_thread, int bwd_rows, int bwd_stages) -> int[]");
}

TORCH_LIBRARY_IMPL(lightning_adaptiveload, CUDA, m) {
  m.impl("layer_norm_modulate", &ln_forward);
  m.impl("layer_norm_modulate_backward", &ln_backward);
  m.impl("rms_norm_modulate", &rms_forward);
  m.impl("rms_norm_modulate_backward", &rms_backward);
  m.impl("_norm_modulate_tuned", &tuned_forward);
  m.impl("_norm_modulate_backward_tuned", &tuned_backward);
  m.impl("_norm_modulate_plans", &plans);
}

TORCH_LIBRARY_IMPL(lightning_adaptiveload, Autograd, m) {
  m.impl("layer_norm_modulate", &ln_autograd);
  m.impl("rms_norm_modulate", &rms_autograd);
}
