// See norm_mod_variants.h. Compile once per part: nvcc ... -DNMV_PART=k -c norm_mod_variants.cu (k = 1..5).
#include <cuda_bf16.h>

#include "norm_mod_tma.cuh"
#include "norm_mod_variants.h"

#ifndef NMV_PART
#error "define NMV_PART (1..5)"
#endif

namespace nmv {
using adaptiveload::detail::TmaBwdParams;
using adaptiveload::detail::TmaFwdParams;
using T = __nv_bfloat16;
using M = float;

template <int VPT, bool RMS, bool IL, int REGS, bool L1, bool FMA>
__global__ void __maxnreg__(REGS) var_fwd(const TmaFwdParams p) {
  adaptiveload::detail::nm_fwd_tma_body<T, M, VPT, RMS, false, IL, L1, FMA>(p);
}

template <int VPT, bool RMS, bool IL>
const void* fwd_pick(int regs, bool l1, bool fma) {
#define NMV_F(R_, L_, F_)                                                  \
  if (regs == R_ && l1 == L_ && fma == F_)                                \
    return reinterpret_cast<const void*>(&var_fwd<VPT, RMS, IL, R_, L_, F_>);
#define NMV_FR(R_)   \
  NMV_F(R_, false, false) \
  NMV_F(R_, true, false)  \
  if constexpr (!RMS) {   \
    NMV_F(R_, false, true) \
    NMV_F(R_, true, true)  \
  }
  NMV_FR(128)
  NMV_FR(96)
  NMV_FR(80)
  NMV_FR(64)
#undef NMV_FR
#undef NMV_F
  return nullptr;
}

template <bool RMS, int VPT>
const void* fwd_il(bool il, int regs, bool l1, bool fma) {
  return il ? fwd_pick<VPT, RMS, true>(regs, l1, fma) : fwd_pick<VPT, RMS, false>(regs, l1, fma);
}

#if NMV_PART == 1
const void* fwd_part1(bool rms, int vpt, bool il, int regs, bool l1, bool fma) {
  return !rms && vpt == 3 ? fwd_il<false, 3>(il, regs, l1, fma) : nullptr;
}
#elif NMV_PART == 2
const void* fwd_part2(bool rms, int vpt, bool il, int regs, bool l1, bool fma) {
  return !rms && vpt == 4 ? fwd_il<false, 4>(il, regs, l1, fma) : nullptr;
}
#elif NMV_PART == 3
const void* fwd_part3(bool rms, int vpt, bool il, int regs, bool l1, bool fma) {
  if (!rms || fma) return nullptr;
  if (vpt == 3) return fwd_il<true, 3>(il, regs, l1, false);
  if (vpt == 4) return fwd_il<true, 4>(il, regs, l1, false);
  return nullptr;
}
#else
template <bool RMS>
const void* bwd_pick(int r, int regs, int opt) {
  using adaptiveload::detail::nm_bwd_tma_kernel;
#define NMV_B(R_, G_, F_) \
  if (r == R_ && regs == G_ && opt == F_) return reinterpret_cast<const void*>(&nm_bwd_tma_kernel<T, M, 1, RMS, false, false, R_, G_, F_>);
  NMV_B(2, 96, 0)
  NMV_B(2, 96, 1)
  NMV_B(2, 96, 3)
  NMV_B(2, 96, 4)
  NMV_B(2, 96, 5)
  NMV_B(2, 96, 7)
  NMV_B(2, 80, 5)
  NMV_B(1, 96, 1)
  NMV_B(1, 96, 5)
  NMV_B(2, 112, 1)
  NMV_B(2, 128, 0)
  NMV_B(2, 128, 1)
  NMV_B(2, 128, 5)
#undef NMV_B
  return nullptr;
}
#if NMV_PART == 4
const void* bwd_part4(bool rms, int r, int regs, int opt) { return rms ? nullptr : bwd_pick<false>(r, regs, opt); }
#elif NMV_PART == 5
const void* bwd_part5(bool rms, int r, int regs, int opt) { return rms ? bwd_pick<true>(r, regs, opt) : nullptr; }
#endif
#endif
}  // namespace nmv
