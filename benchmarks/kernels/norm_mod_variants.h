// Variant kernels of the bulk-copy norm-modulate kernels for benchmarks/kernels/norm_mod_mapping.cu (bf16 x,
// fp32 modulation, per sample / per frame): the same bodies as the library's (csrc/norm_mod_tma.cuh) under
// other register caps and code-path switches. Built by norm_mod_variants.cu, once per NMV_PART (so that the
// parts compile in parallel); each part answers for its own variants and returns nullptr for the others.
#pragma once

namespace nmv {
// Forward: vpt 3 or 4, il the row mapping, regs the register cap (128, 96, 80, 64), l1 the modulation read
// through L1 (else in registers), fma the one-FMA LayerNorm normalisation.
const void* fwd_part1(bool rms, int vpt, bool il, int regs, bool l1, bool fma);
const void* fwd_part2(bool rms, int vpt, bool il, int regs, bool l1, bool fma);
const void* fwd_part3(bool rms, int vpt, bool il, int regs, bool l1, bool fma);
// Backward (one vector per thread, no affine, per sample): rows per iteration r, register cap, opt (bit 0
// the fast dx, bit 1 the scale row through L1).
const void* bwd_part4(bool rms, int r, int regs, int opt);
const void* bwd_part5(bool rms, int r, int regs, int opt);

inline const void* fwd(bool rms, int vpt, bool il, int regs, bool l1, bool fma) {
  if (const void* k = fwd_part1(rms, vpt, il, regs, l1, fma)) return k;
  if (const void* k = fwd_part2(rms, vpt, il, regs, l1, fma)) return k;
  return fwd_part3(rms, vpt, il, regs, l1, fma);
}
inline const void* bwd(bool rms, int r, int regs, int opt) {
  if (const void* k = bwd_part4(rms, r, regs, opt)) return k;
  return bwd_part5(rms, r, regs, opt);
}
}  // namespace nmv
