// Instantiates the fused LayerNorm-Modulate kernels for x of type float (one file per dtype so that ninja
// compiles them in parallel).
#include "ln_modulate_kernels.cuh"

namespace adaptiveload {
namespace detail {

const void* fwd_kernel_fp32(DType mod, int vpt, int kind) { return fwd_kernel_for<float>(mod, vpt, kind); }

const void* bwd_kernel_fp32(DType mod, int vpt, bool affine, bool per_row) {
  return bwd_kernel_for<float>(mod, vpt, affine, per_row);
}

}  // namespace detail
}  // namespace adaptiveload
