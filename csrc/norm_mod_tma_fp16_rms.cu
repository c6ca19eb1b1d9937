// Instantiates the bulk-copy-fed norm-modulate kernels (norm_mod_tma.cuh) for x of type __half and the
// RMSNorm (one file per dtype and norm, so that ninja compiles them in parallel).
#include "norm_mod_tma.cuh"

namespace adaptiveload {
namespace detail {

const void* tma_fwd_kernel_fp16_rms(DType mod, int vpt, bool per_row, bool interleave) {
  return tma_fwd_for<__half, true>(mod, vpt, per_row, interleave);
}

const void* tma_bwd_kernel_fp16_rms(DType mod, int vpt, bool affine, bool per_row, int rows, int regs) {
  return tma_bwd_for<__half, true>(mod, vpt, affine, per_row, rows, regs);
}

const void* tma_bwd_tuned_kernel_fp16_rms(DType mod, int rows, int opt) {
  return tma_bwd_tuned_for<__half, true>(mod, rows, opt);
}

}  // namespace detail
}  // namespace adaptiveload
