// Instantiates the bulk-copy-fed norm-modulate kernels (norm_mod_tma.cuh) for x of type float and the
// RMSNorm (one file per dtype and norm, so that ninja compiles them in parallel).
#include "norm_mod_tma.cuh"

namespace adaptiveload {
namespace detail {

const void* tma_fwd_kernel_fp32_rms(DType mod, int vpt, bool per_row, bool interleave) {
  return tma_fwd_for<float, true>(mod, vpt, per_row, interleave);
}

const void* tma_bwd_kernel_fp32_rms(DType mod, int vpt, bool affine, bool per_row, int rows, int regs) {
  return tma_bwd_for<float, true>(mod, vpt, affine, per_row, rows, regs);
}

const void* tma_bwd_tuned_kernel_fp32_rms(DType mod, int rows, int opt) {
  return tma_bwd_tuned_for<float, true>(mod, rows, opt);
}

}  // namespace detail
}  // namespace adaptiveload
