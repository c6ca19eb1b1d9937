// Host side of the fused norm-modulate ops (LayerNorm and RMSNorm): input checks, launch plans, the
// launches, and the second (column-sum) pass of the backward.
#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "ln_modulate_kernels.cuh"
#include "norm_mod_tma.cuh"

namespace adaptiveload {
namespace {

using detail::BwdParams;
using detail::ColsumParams;
using detail::FwdParams;

int vec_width(DType t) { return t == DType::kFloat32 ? 4 : 8; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

cudaError_t sm_count(int* out) {
  // Cached per device: cudaGetDeviceProperties is slow enough to show up in a training step.
  static int counts[64] = {0};
  static std::mutex mu;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 64 && counts[dev] > 0) {
    *out = counts[dev];
    return cudaSuccess;
  }
  int n = 0;
  err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  if (dev < 64) counts[dev] = n;
  *out = n;
  return cudaSuccess;
}

const void* fwd_kernel(DType x, DType mod, int vpt, int kind) {
  switch (x) {
    case DType::kBFloat16: return detail::fwd_kernel_bf16(mod, vpt, kind);
    case DType::kFloat16: return detail::fwd_kernel_fp16(mod, vpt, kind);
    case DType::kFloat32: return detail::fwd_kernel_fp32(mod, vpt, kind);
  }
  return nullptr;
}

const void* bwd_kernel(DType x, DType mod, int vpt, bool affine, bool per_row) {
  switch (x) {
    case DType::kBFloat16: return detail::bwd_kernel_bf16(mod, vpt, affine, per_row);
    case DType::kFloat16: return detail::bwd_kernel_fp16(mod, vpt, affine, per_row);
    case DType::kFloat32: return detail::bwd_kernel_fp32(mod, vpt, affine, per_row);
  }
  return nullptr;
}

const void* colsum_kernel(DType mod) {
  switch (mod) {
    case DType::kBFloat16: return reinterpret_cast<const void*>(&detail::ln_mod_colsum_kernel<__nv_bfloat16>);
    case DType::kFloat16: return reinterpret_cast<const void*>(&detail::ln_mod_colsum_kernel<__half>);
    case DType::kFloat32: return reinterpret_cast<const void*>(&detail::ln_mod_colsum_kernel<float>);
  }
  return nullptr;
}

const void* tma_fwd_kernel(DType x, DType mod, bool rms, int vpt, bool per_row, bool il) {
  switch (x) {
    case DType::kBFloat16:
      return rms ? detail::tma_fwd_kernel_bf16_rms(mod, vpt, per_row, il) : detail::tma_fwd_kernel_bf16_ln(mod, vpt, per_row, il);
    case DType::kFloat16:
      return rms ? detail::tma_fwd_kernel_fp16_rms(mod, vpt, per_row, il) : detail::tma_fwd_kernel_fp16_ln(mod, vpt, per_row, il);
    case DType::kFloat32:
      return rms ? detail::tma_fwd_kernel_fp32_rms(mod, vpt, per_row, il) : detail::tma_fwd_kernel_fp32_ln(mod, vpt, per_row, il);
  }
  return nullptr;
}

const void* tma_bwd_kernel(DType x, DType mod, bool rms, int vpt, bool affine, bool per_row, int rows, int regs) {
  switch (x) {
    case DType::kBFloat16:
      return rms ? detail::tma_bwd_kernel_bf16_rms(mod, vpt, affine, per_row, rows, regs)
                 : detail::tma_bwd_kernel_bf16_ln(mod, vpt, affine, per_row, rows, regs);
    case DType::kFloat16:
      return rms ? detail::tma_bwd_kernel_fp16_rms(mod, vpt, affine, per_row, rows, regs)
                 : detail::tma_bwd_kernel_fp16_ln(mod, vpt, affine, per_row, rows, regs);
    case DType::kFloat32:
      return rms ? detail::tma_bwd_kernel_fp32_rms(mod, vpt, affine, per_row, rows, regs)
                 : detail::tma_bwd_kernel_fp32_ln(mod, vpt, affine, per_row, rows, regs);
  }
  return nullptr;
}

const void* tma_bwd_tuned_kernel(DType x, DType mod, bool rms, int rows, int opt) {
  switch (x) {
    case DType::kBFloat16:
      return rms ? detail::tma_bwd_tuned_kernel_bf16_rms(mod, rows, opt) : detail::tma_bwd_tuned_kernel_bf16_ln(mod, rows, opt);
    case DType::kFloat16:
      return rms ? detail::tma_bwd_tuned_kernel_fp16_rms(mod, rows, opt) : detail::tma_bwd_tuned_kernel_fp16_ln(mod, rows, opt);
    case DType::kFloat32:
      return nullptr;
  }
  return nullptr;
}

int elt_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// The device's opt-in limit of dynamic shared memory per CTA, cached per device.
cudaError_t smem_optin(int* out) {
  static int limits[64] = {0};
  static std::mutex mu;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 64 && limits[dev] > 0) {
    *out = limits[dev];
    return cudaSuccess;
  }
  int n = 0;
  err = cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return err;
  if (dev < 64) limits[dev] = n;
  *out = n;
  return cudaSuccess;
}

// Whether the current device has the bulk copy engine (compute capability 9.0 and newer), cached.
bool tma_supported() {
  static int major[64] = {0};
  static std::mutex mu;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 64 && major[dev] > 0) return major[dev] >= 9;
  int m = 0;
  if (cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
  if (dev < 64) major[dev] = m;
  return m >= 9;
}

// Resident CTAs per SM of a bulk-copy kernel at a block size and dynamic shared memory, cached. The first
// query of a kernel on a device raises its dynamic shared-memory limit to the opt-in maximum.
std::mutex g_tma_mu;
std::map<std::tuple<const void*, int, size_t, int>, int> g_tma_occ;
std::set<std::pair<const void*, int>> g_tma_attr;

cudaError_t tma_occupancy(const void* kernel, int threads, size_t smem, int* out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const auto key = std::make_tuple(kernel, threads, smem, dev);
  std::lock_guard<std::mutex> lock(g_tma_mu);
  auto it = g_tma_occ.find(key);
  if (it != g_tma_occ.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  if (g_tma_attr.insert({kernel, dev}).second) {
    int optin = 0;
    err = smem_optin(&optin);
    if (err != cudaSuccess) return err;
    cudaFuncAttributes fa;
    err = cudaFuncGetAttributes(&fa, kernel);
    if (err != cudaSuccess) return err;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               optin - static_cast<int>(fa.sharedSizeBytes));
    if (err != cudaSuccess) return err;
  }
  int occ = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, smem);
  if (err != cudaSuccess) return err;
  if (occ < 1) return cudaErrorInvalidConfiguration;
  g_tma_occ[key] = occ;
  *out = occ;
  return cudaSuccess;
}

// Stages of a bulk-copy kernel: `want` (0: enough for about `target` bytes per CTA, within [lo, 8]),
// reduced down to `floor` until the ring fits the opt-in shared memory; 0 when not even `floor` stages fit,
// or when an explicit `want` does not fit (or is under `floor`).
int tma_stages(int want, uint32_t stage_bytes, size_t target, int lo, int floor, int optin) {
  // 1 KB below the limit: the runtime reserves some shared memory per CTA.
  auto fits = [&](int s) {
    return static_cast<size_t>(s) * stage_bytes + detail::tma_extra_smem(s) + 1024 <= static_cast<size_t>(optin);
  };
  if (want > 0) return want >= floor && want <= 16 && fits(want) ? want : 0;
  int s = static_cast<int>(std::min<size_t>(8, std::max<size_t>(lo, (target + stage_bytes - 1) / stage_bytes)));
  while (s > floor && !fits(s)) --s;
  return fits(s) ? s : 0;
}

// The bulk-copy forward's plan (version 5). Fails (cudaErrorInvalidValue) where it cannot run: overrides
// out of range, or a row that does not fit shared memory even once.
cudaError_t tma_fwd_plan(const LnModFwdArgs& a, NormModFwdPlan* out, const void** kernel_out) {
  if (!tma_supported()) return cudaErrorNotSupported;
  const int64_t nvec = a.D / vec_width(a.x_dtype);
  int threads = 0, vpt = 0;
  if (a.warps_per_row > 0) {
    threads = 32 * a.warps_per_row;
    vpt = static_cast<int>(ceil_div(nvec, threads));
    if (threads > detail::kTmaMaxThreads || ceil_div(nvec, threads) > 8) return cudaErrorInvalidValue;
  } else {
    // The fewest warps that keep a thread within 4 vectors (8 for the widest fp32 rows), the modulation in
    // registers. Measured on an H200 (benchmarks/kernels/bench_norm_modulate_limit.py --sweep): the rows in
    // flight per SM, not the bytes in flight, bound the kernel (stages beyond 2 did not help); more threads
    // per row were slower (fewer CTAs per SM), and one warp per row with 5-8 vectors reading the
    // modulation through L1 was 5-10% slower than this.
    int W = static_cast<int>(ceil_div(nvec, 32 * 4));
    vpt = static_cast<int>(ceil_div(nvec, 32 * W));
    if (32 * W > detail::kTmaMaxThreads) {
      W = static_cast<int>(ceil_div(nvec, 32 * 8));
      vpt = static_cast<int>(ceil_div(nvec, 32 * W));
    }
    threads = 32 * W;
    if (threads > detail::kTmaMaxThreads) return cudaErrorInvalidValue;
  }
  if (vpt == 7) vpt = 8;  // instantiated: 1-6 and 8
  int optin = 0;
  cudaError_t err = smem_optin(&optin);
  if (err != cudaSuccess) return err;
  const uint32_t xbytes = static_cast<uint32_t>(a.D) * elt_bytes(a.x_dtype);
  const uint32_t mbytes = static_cast<uint32_t>(a.D) * elt_bytes(a.mod_dtype);
  bool per_row = a.group_size == 1;
  uint32_t stage_bytes = per_row ? xbytes + 2 * mbytes : xbytes;
  // Two stages by default (more did not help on an H200: the rows in flight bound the kernel, and smaller
  // rings leave room for more CTAs); per token 3 (a stage is released one row late there, so 2 at least).
  int stages = per_row ? tma_stages(a.stages, stage_bytes, 1, 3, 2, optin)
                       : tma_stages(a.stages, stage_bytes, 1, 2, 1, optin);
  if (stages == 0 && per_row) {  // too wide to carry the modulation rows: read them through L1
    per_row = false;
    stage_bytes = xbytes;
    stages = tma_stages(a.stages, stage_bytes, 1, 2, 1, optin);
  }
  if (stages == 0) return cudaErrorInvalidValue;
  const void* kernel = tma_fwd_kernel(a.x_dtype, a.mod_dtype, a.rms, vpt, per_row, false);
  if (a.kernel_override != nullptr) {
    if (a.interleave != 1 && a.interleave != 2) return cudaErrorInvalidValue;
    kernel = a.kernel_override;
  }
  if (kernel == nullptr) return cudaErrorInvalidValue;
  const size_t smem = static_cast<size_t>(stages) * stage_bytes + detail::tma_extra_smem(stages);
  int occ = 0, sms = 0;
  err = tma_occupancy(kernel, threads, smem, &occ);
  if (err != cudaSuccess) return err;
  err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  const int64_t resident = static_cast<int64_t>(occ) * sms;
  const int64_t grid0 = std::max<int64_t>(1, std::min<int64_t>(a.rows, resident));
  // Row mapping: interleaved (CTA b takes rows b, b + grid, ...) where the modulation travels with its row
  // (per token) or changes rarely along a CTA's rows; contiguous ranges otherwise (many small groups: a
  // CTA's rows then share their modulation row). Interleaved, the CTAs read one contiguous front of memory
  // at a time, as a copy does.
  // Measured on an H200 (benchmarks/kernels/norm_mod_mapping.cu, 2026-12-03): interleaved rows were 2-3%
  // faster for rows of up to 4 KB (D = 1152 and 1536 in bf16, per sample and per token) and 4-6% slower
  // for 6 and 10 KB rows (D = 3072, 5120); per frame with groups of 1,560 rows and ~1,000 CTAs (a group
  // change, so a modulation reload, every other row) 20% slower. So: rows of up to 4 KB, and groups of at
  // least three rows per CTA.
  bool interleave = xbytes <= 4096 && (per_row || a.group_size >= 3 * grid0);
  if (a.interleave == 1) interleave = false;
  if (a.interleave == 2) interleave = true;
  if (interleave && !detail::tma_fwd_has_interleaved(vpt)) {
    if (a.interleave == 2) return cudaErrorInvalidValue;
    interleave = false;
  }
  int64_t grid1 = grid0;
  if (interleave) {
    kernel = a.kernel_override != nullptr ? a.kernel_override
                                          : tma_fwd_kernel(a.x_dtype, a.mod_dtype, a.rms, vpt, per_row, true);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    err = tma_occupancy(kernel, threads, smem, &occ);
    if (err != cudaSuccess) return err;
    grid1 = std::max<int64_t>(1, std::min<int64_t>(a.rows, static_cast<int64_t>(occ) * sms));
  }
  const int64_t rpc = ceil_div(std::max<int64_t>(a.rows, 1), grid0);
  const int64_t grid = interleave ? grid1 : ceil_div(std::max<int64_t>(a.rows, 1), rpc);
  if (grid > 0x7fffffff) return cudaErrorInvalidValue;
  out->tma = true;
  out->threads = threads;
  out->vpt = vpt;
  out->stages = stages;
  out->per_row = per_row;
  out->grid = static_cast<int>(grid);
  out->rows_per_cta = rpc;
  out->smem_bytes = smem;
  out->ctas_per_sm = occ;
  out->interleave = interleave;
  *kernel_out = kernel;
  return cudaSuccess;
}

cudaError_t tma_forward(const LnModFwdArgs& a, const NormModFwdPlan& pl, const void* kernel, cudaStream_t stream) {
  detail::TmaFwdParams p;
  p.x = a.x;
  p.shift = a.shift;
  p.scale = a.scale;
  p.weight = a.weight;
  p.bias = a.bias;
  p.y = a.y;
  p.mean = a.mean;
  p.rstd = a.rstd;
  p.rows = a.rows;
  p.group_size = a.group_size;
  p.shift_stride = a.shift_stride;
  p.scale_stride = a.scale_stride;
  p.rows_per_cta = pl.rows_per_cta;
  p.D = static_cast<int>(a.D);
  p.stages = pl.stages;
  p.stage_bytes = static_cast<uint32_t>(a.D) * elt_bytes(a.x_dtype) +
                  (pl.per_row ? 2u * static_cast<uint32_t>(a.D) * elt_bytes(a.mod_dtype) : 0u);
  p.eps = a.eps;
  void* args[] = {&p};
  cudaError_t err = cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(pl.grid)), dim3(pl.threads), args,
                                     pl.smem_bytes, stream);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

struct PlanKey {
  const void* kernel;
  int tpr;
  int64_t D;
  int slots_override;
  int device;
  bool operator<(const PlanKey& o) const {
    return std::tie(kernel, tpr, D, slots_override, device) <
           std::tie(o.kernel, o.tpr, o.D, o.slots_override, o.device);
  }
};
std::mutex g_plan_mu;
std::map<PlanKey, std::pair<int, int>> g_plan_cache;  // -> (slots, CTAs per SM)

// Bytes of shared memory the backward's first pass may use for the slot combine.
constexpr size_t kCombineBudget = 40 * 1024;

// Resident CTAs per SM of a forward kernel at a block size and shared memory, cached: the persistent
// forward sizes its grid by it on every call.
std::mutex g_fwd_occ_mu;
std::map<std::tuple<const void*, int, size_t, int>, int> g_fwd_occ_cache;

cudaError_t fwd_occupancy(const void* kernel, int threads, size_t smem, int* out) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const auto key = std::make_tuple(kernel, threads, smem, dev);
  {
    std::lock_guard<std::mutex> lock(g_fwd_occ_mu);
    auto it = g_fwd_occ_cache.find(key);
    if (it != g_fwd_occ_cache.end()) {
      *out = it->second;
      return cudaSuccess;
    }
  }
  int occ = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, smem);
  if (err != cudaSuccess) return err;
  if (occ < 1) return cudaErrorInvalidConfiguration;
  {
    std::lock_guard<std::mutex> lock(g_fwd_occ_mu);
    g_fwd_occ_cache[key] = occ;
  }
  *out = occ;
  return cudaSuccess;
}

}  // namespace

const char* ln_mod_check(int64_t D, DType x_dtype, DType mod_dtype) {
  if (D < 8 || D % 8 != 0) return "the feature size D must be a positive multiple of 8";
  if (D > kMaxD) return "the feature size D must be at most 16384";
  if (mod_dtype != x_dtype && mod_dtype != DType::kFloat32)
    return "shift and scale must be float32 or have x's dtype";
  return nullptr;
}

// LayerNorm, per sample or per frame, the host's choice: the register-fed persistent kernel (version 4)
// where its two row buffers fit (up to 4 vectors per thread). Measured on an H200 (--sweep, 2026-12-02):
// 84-85% of a copy at D = 1536 and 5120 against 70-80% for the bulk-copy kernel, whose LayerNorm rows
// take longer than RMSNorm's (the mean). Per token, RMSNorm, and wider rows per thread: bulk copies.
bool ln_prefers_v4(const LnModFwdArgs& a) {
  if (a.rms || a.path != kFwdAuto || a.group_size <= 1 || a.warps_per_row > 0 || a.rows_per_cta > 0) return false;
  const int64_t nvec = a.D / vec_width(a.x_dtype);
  int W = 1;
  while (ceil_div(nvec, 32 * W) > 4 && 32 * (W + 1) <= detail::kFwdMaxThreads) ++W;
  const int vpt = static_cast<int>(ceil_div(nvec, 32 * W));
  if (vpt > detail::kFwdPersistentMaxVpt) return false;
  // Version 4 walks rows at a stride of its grid, so groups of fewer rows than it has CTAs (per frame)
  // reload their modulation rows nearly every row: there the contiguous bulk-copy kernel wins (measured on
  // an H200, 1 x 21 x 1,560 x 1,536 with ~1,600 CTAs, 2026-12-03: 0.063 against 0.067 ms; at 8 x 4,096 x
  // 1,536 the two were equal, at 1 x 32,760 x 1,152 version 4 11% faster).
  const void* kernel = fwd_kernel(a.x_dtype, a.mod_dtype, vpt, detail::kFwdPersistent);
  int occ = 0, sms = 0;
  if (kernel == nullptr || fwd_occupancy(kernel, 32 * W, sizeof(float) * 3 * W, &occ) != cudaSuccess ||
      sm_count(&sms) != cudaSuccess) {
    return true;
  }
  return a.group_size >= static_cast<int64_t>(occ) * sms;
}

cudaError_t norm_mod_forward_plan(const LnModFwdArgs& a, NormModFwdPlan* plan) {
  if (ln_mod_check(a.D, a.x_dtype, a.mod_dtype) != nullptr || a.group_size < 1) return cudaErrorInvalidValue;
  *plan = NormModFwdPlan();
  if (a.path != kFwdAuto && a.path != kFwdTma) return cudaSuccess;  // a register-fed kernel: tma = false
  if (ln_prefers_v4(a)) return cudaSuccess;
  const void* kernel = nullptr;
  cudaError_t err = tma_fwd_plan(a, plan, &kernel);
  if (err != cudaSuccess && a.path == kFwdAuto && !a.rms) {
    *plan = NormModFwdPlan();
    return cudaSuccess;
  }
  return err;
}

cudaError_t ln_mod_forward(const LnModFwdArgs& a, cudaStream_t stream) {
  if (ln_mod_check(a.D, a.x_dtype, a.mod_dtype) != nullptr || a.group_size < 1) return cudaErrorInvalidValue;
  if (a.path < kFwdAuto || a.path > kFwdTma) return cudaErrorInvalidValue;
  if (a.rms && a.path != kFwdAuto && a.path != kFwdTma) return cudaErrorInvalidValue;  // version 5 only
  if (a.rows == 0) return cudaSuccess;
  const bool v4 = ln_prefers_v4(a);
  // Auto: LayerNorm per sample and per frame takes version 4 where it fits (ln_prefers_v4); everything
  // else the bulk-copy kernel, and LayerNorm falls back to the register-fed kernels where that cannot run.
  if ((a.path == kFwdAuto && !v4) || a.path == kFwdTma) {
    // Version 5 wherever a row fits shared memory (every width the checks allow, in practice).
    NormModFwdPlan pl;
    const void* kernel = nullptr;
    cudaError_t err = tma_fwd_plan(a, &pl, &kernel);
    if (err == cudaSuccess) return tma_forward(a, pl, kernel, stream);
    if (a.path == kFwdTma || a.rms) return err;
  }
  const int old_path = v4 ? kFwdV4 : a.path == kFwdTma ? 0 : a.path;
  const int64_t nvec = a.D / vec_width(a.x_dtype);
  // Fewest warps per row that keep a row within 4 vectors per thread (no spill under the 80-register cap),
  // and CTAs of about 128 threads. Measured on an H100 (benchmarks/NOTES_modulate.md): D = 1536, 2 warps x
  // 2 rows: 89% of the copy bandwidth, against 72-79% for 1 warp or 256-thread CTAs; D = 5120, 5 warps x
  // 1 row: 86%, against 63-83% for 3, 4, 8 or 10 warps and 2 or 3 rows.
  constexpr int kPreferredVpt = 4;
  int W = a.warps_per_row;
  if (W <= 0) {
    W = 1;
    while (ceil_div(nvec, 32 * W) > kPreferredVpt && 32 * (W + 1) <= detail::kFwdMaxThreads) ++W;
    while (ceil_div(nvec, 32 * W) > detail::kFwdMaxVpt) ++W;
  }
  const int vpt = static_cast<int>(ceil_div(nvec, 32 * W));
  if (vpt < 1 || vpt > detail::kFwdMaxVpt || 32 * W > detail::kFwdMaxThreads) return cudaErrorInvalidValue;
  // Persistent row slots with the next row's loads in flight (version 4) where a thread's two row buffers
  // fit (at most 4 vectors) and modulation rows are shared by several x rows. Per token (group size 1) the
  // modulation rows stream from memory like x itself, and the single-row kernel, which issues them with
  // more freedom, is already at the speed of light (NOTES_modulate.md, version 3). The persistent kernel
  // has one row slot per CTA; a rows_per_cta override above 1 selects the single-row kernel.
  // Measured on an H100 side by side (NOTES_modulate.md, version 4): persistent 91-92% of the copy
  // bandwidth at D = 5120 (single-row: 87%) and 88% at 8 x 4096 x 1536 (77%), but 87% against the
  // single-row kernel's 88% at 1 x 32760 x 1536: with one modulation group and 2 warps per row the
  // single-row kernel stays.
  const bool fits = vpt <= detail::kFwdPersistentMaxVpt && a.rows_per_cta <= 1;
  if (old_path >= 2 && !fits) return cudaErrorInvalidValue;
  const bool single_row_wins = a.group_size == a.rows && W == 2;
  const bool persistent = old_path >= 2 || (old_path == 0 && fits && a.group_size > 1 && !single_row_wins);
  // Version 4 keeps two reductions per row (a one-reduction version measured 4-12% slower on an H200 at
  // every width, 2026-12-03 second pass, and was removed).
  const int kind = !persistent      ? detail::kFwdSingleRow
                   : old_path == 3 ? detail::kFwdPersistentLowRegs
                                   : detail::kFwdPersistent;
  const int rows_per_cta = persistent ? 1 : a.rows_per_cta > 0 ? a.rows_per_cta : std::max(1, 128 / (32 * W));
  if (32 * W * rows_per_cta > detail::kFwdMaxThreads) return cudaErrorInvalidValue;
  const void* kernel = fwd_kernel(a.x_dtype, a.mod_dtype, vpt, kind);
  if (kernel == nullptr) return cudaErrorInvalidValue;

  FwdParams p;
  p.x = a.x;
  p.shift = a.shift;
  p.scale = a.scale;
  p.weight = a.weight;
  p.bias = a.bias;
  p.y = a.y;
  p.mean = a.mean;
  p.rstd = a.rstd;
  p.rows = a.rows;
  p.group_size = a.group_size;
  p.shift_stride = a.shift_stride;
  p.scale_stride = a.scale_stride;
  p.D = static_cast<int>(a.D);
  p.warps_per_row = W;
  p.rows_per_cta = rows_per_cta;
  p.eps = a.eps;
  const size_t smem = sizeof(float) * 3 * W * rows_per_cta;
  int64_t grid = ceil_div(a.rows, rows_per_cta);
  if (persistent) {
    // One wave: every CTA resident at once, each row slot walking rows at a stride of all slots.
    int occ = 0, sms = 0;
    cudaError_t err = fwd_occupancy(kernel, 32 * W * rows_per_cta, smem, &occ);
    if (err != cudaSuccess) return err;
    err = sm_count(&sms);
    if (err != cudaSuccess) return err;
    grid = std::min<int64_t>(grid, static_cast<int64_t>(occ) * sms);
  }
  if (grid > 0x7fffffff) return cudaErrorInvalidValue;
  void* args[] = {&p};
  cudaError_t err = cudaLaunchKernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(32 * W * rows_per_cta),
                                     args, smem, stream);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

namespace {

// The bulk-copy backward's plan (version 5); fails where it cannot run (see tma_fwd_plan).
cudaError_t tma_bwd_plan(const LnModBwdArgs& a, LnModBwdPlan* plan) {
  if (!tma_supported()) return cudaErrorNotSupported;
  const int64_t nvec = a.D / vec_width(a.x_dtype);
  auto threads_for = [&](int v) { return static_cast<int>(ceil_div(ceil_div(nvec, v), 32) * 32); };
  int vpt = a.vectors_per_thread;
  if (vpt <= 0) {
    // One 16-byte vector per thread (8 fp32 column accumulators of each kind, the fewest registers) where a
    // CTA stays within its thread limit; 2, 4, then 8 (fp32 rows over 8192 values) for wider rows.
    // Measured on an H200 (--sweep): one vector beat two and four at every width.
    vpt = 1;
    while (vpt < 8 && threads_for(vpt) > detail::tma_bwd_max_threads(vpt)) vpt *= 2;
  }
  if (vpt != 1 && vpt != 2 && vpt != 4 && vpt != 8) return cudaErrorInvalidValue;
  const int threads = threads_for(vpt);
  if (threads > detail::tma_bwd_max_threads(vpt)) return cudaErrorInvalidValue;
  // Rows per iteration: 2 by default (two rows in flight per barrier) up to 2 vectors per thread.
  int rows_per_iter = a.slots > 0 ? a.slots : (vpt <= 2 ? 2 : 1);  // may change below (tuned kernels)
  if (rows_per_iter != 1 && rows_per_iter != 2 && rows_per_iter != 4) return cudaErrorInvalidValue;
  if (vpt > 2 && rows_per_iter != 1) return cudaErrorInvalidValue;
  int optin = 0;
  cudaError_t err = smem_optin(&optin);
  if (err != cudaSuccess) return err;
  const uint32_t xbytes = static_cast<uint32_t>(a.D) * elt_bytes(a.x_dtype);
  const uint32_t mbytes = static_cast<uint32_t>(a.D) * elt_bytes(a.mod_dtype);
  bool per_row = a.group_size == 1;
  const bool affine = a.weight != nullptr;
  const uint32_t R = static_cast<uint32_t>(rows_per_iter);
  uint32_t stage_bytes = per_row ? R * (2 * xbytes + mbytes) : R * 2 * xbytes;  // may change below
  // 2 stages of 2 rows by default (measured on an H200, --sweep: 1 vector per thread, 2 rows, 2 stages was
  // the fastest or within 1% at every width); per token 3 (a stage is released one block late there).
  int stages = per_row ? tma_stages(a.stages, stage_bytes, 1, 3, 2, optin)
                       : tma_stages(a.stages, stage_bytes, 1, 2, 1, optin);
  if (stages == 0 && per_row) {  // too wide to carry the scale rows: one-row items, scale through L1
    per_row = false;
    stage_bytes = R * 2 * xbytes;
    stages = tma_stages(a.stages, stage_bytes, 1, 2, 1, optin);
  }
  if (stages == 0) return cudaErrorInvalidValue;
  const void* kernel = tma_bwd_kernel(a.x_dtype, a.mod_dtype, a.rms, vpt, affine, per_row, rows_per_iter, 0);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  size_t smem = static_cast<size_t>(stages) * stage_bytes + detail::tma_extra_smem(stages);
  int occ = 0, sms = 0;
  err = tma_occupancy(kernel, threads, smem, &occ);
  if (err != cudaSuccess) return err;
  // The register cap: the highest built one (tma_bwd_has_cap) that keeps the CTAs per SM of the default cap.
  int regs = detail::tma_bwd_max_registers(vpt);
  if (a.regs > 0) {
    if (!detail::tma_bwd_has_cap(vpt, rows_per_iter, a.regs)) return cudaErrorInvalidValue;
    regs = a.regs;
  } else {
    for (int cap : {128, 112}) {
      if (cap <= regs || !detail::tma_bwd_has_cap(vpt, rows_per_iter, cap)) continue;
      const void* k2 = tma_bwd_kernel(a.x_dtype, a.mod_dtype, a.rms, vpt, affine, per_row, rows_per_iter, cap);
      int occ2 = 0;
      if (k2 != nullptr && tma_occupancy(k2, threads, smem, &occ2) == cudaSuccess && occ2 >= occ) {
        regs = cap;
        break;
      }
    }
  }
  if (regs != detail::tma_bwd_max_registers(vpt)) {
    kernel = tma_bwd_kernel(a.x_dtype, a.mod_dtype, a.rms, vpt, affine, per_row, rows_per_iter, regs);
    if (kernel == nullptr) return cudaErrorInvalidValue;
    err = tma_occupancy(kernel, threads, smem, &occ);
    if (err != cudaSuccess) return err;
  }
  if (a.kernel_override != nullptr) {
    kernel = a.kernel_override;
    err = tma_occupancy(kernel, threads, smem, &occ);
    if (err != cudaSuccess) return err;
  }
  // Tuned kernels (2026-12-03, second pass): 16-bit x, one vector per thread, per sample or per frame, no
  // affine, no tuning overrides. Both issue the next block's copies after the second pass (no spill at 96
  // registers, where issuing it after the row sums spilled 48 bytes per thread for LayerNorm, 24 for RMSNorm);
  // LayerNorm also takes the fast dx (norm_mod_tma.cuh, FAST). One row per iteration (80 registers, 3 stages)
  // where that fits more CTAs per SM than two rows do (LayerNorm), or twice as many (RMSNorm); else two rows,
  // RMSNorm only where two or more CTAs share an SM (one 640-thread CTA at D = 5120 was 0-10% slower
  // issuing late). Measured on an H200, bf16 x (benchmarks/kernels/norm_mod_mapping.cu,
  // benchmarks/results/norm_mod_mapping_nvidia-h200_2026-12-03_s33_run1.txt, _run2.txt), LayerNorm against the kernel
  // before: 1 x 32,760 x 1,152 0.079 -> 0.0725 ms, 1,536 0.101 -> 0.0885, 3,072 0.190 -> 0.167, 5,120
  // 0.293 -> 0.2725, per frame 0.112 -> 0.097; RMSNorm 1,536 0.086 -> 0.083, 3,072 0.175 -> 0.163.
  if (a.kernel_override == nullptr && a.slots == 0 && a.stages == 0 && a.regs == 0 && a.vectors_per_thread == 0 &&
      vpt == 1 && !affine && !per_row && elt_bytes(a.x_dtype) == 2) {
    const void* k1 = tma_bwd_tuned_kernel(a.x_dtype, a.mod_dtype, a.rms, 1, 5);
    const void* k2 = tma_bwd_tuned_kernel(a.x_dtype, a.mod_dtype, a.rms, 2, a.rms ? 4 : 5);
    const int st1 = tma_stages(3, 2 * xbytes, 1, 1, 1, optin);
    const int st2 = tma_stages(a.rms ? 2 : 3, 4 * xbytes, 1, 1, 1, optin);
    const size_t sm1 = static_cast<size_t>(st1) * 2 * xbytes + detail::tma_extra_smem(st1);
    const size_t sm2 = static_cast<size_t>(st2) * 4 * xbytes + detail::tma_extra_smem(st2);
    int occ1 = 0, occ2 = 0;
    if (k1 != nullptr && k2 != nullptr && st1 > 0 && st2 > 0 &&
        tma_occupancy(k1, threads, sm1, &occ1) == cudaSuccess &&
        tma_occupancy(k2, threads, sm2, &occ2) == cudaSuccess) {
      const bool one_row = a.rms ? occ1 >= 2 * occ2 : occ1 > occ2;
      const bool two_rows = !one_row && (!a.rms || occ2 >= 2);
      if (one_row || two_rows) {
        rows_per_iter = one_row ? 1 : 2;
        kernel = one_row ? k1 : k2;
        stages = one_row ? st1 : st2;
        stage_bytes = static_cast<uint32_t>(rows_per_iter) * 2 * xbytes;
        smem = one_row ? sm1 : sm2;
        occ = one_row ? occ1 : occ2;
        regs = 96;
      }
    }
  }
  err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  const int64_t resident = static_cast<int64_t>(occ) * sms;
  const int64_t rows = std::max<int64_t>(a.rows, 1);
  LnModBwdPlan pl;
  pl.tma = true;
  pl.vpt = vpt;
  pl.rows_per_iter = rows_per_iter;
  pl.tpr = threads;
  pl.slots = 1;
  pl.per_row = per_row;
  pl.affine = affine;
  pl.stages = stages;
  pl.stage_bytes = stage_bytes;
  pl.smem_bytes = smem;
  // Row mapping: interleaved for RMSNorm and per token (an item's blocks of rows_per_iter rows alternate
  // with those of the other items of its group, so that the CTAs read one contiguous front of memory).
  pl.regs = regs;
  pl.kernel = kernel;
  // The row mapping is the kernel's own (detail::tma_bwd_interleaved, measured there).
  pl.interleave = detail::tma_bwd_interleaved(a.rms, per_row);
  const int64_t blocks = ceil_div(rows, rows_per_iter);  // per token; per group below
  if (per_row && pl.interleave) {
    pl.chunks = 1;
    pl.num_items = std::min(resident, blocks);
    pl.rows_per_chunk = ceil_div(rows, pl.num_items);
  } else if (per_row) {
    pl.chunks = 1;
    pl.rows_per_chunk = ceil_div(rows, std::min(resident, rows));
    pl.num_items = ceil_div(rows, pl.rows_per_chunk);
  } else if (pl.interleave) {
    // One wave of CTAs: a group takes as many items as the CTAs it would leave idle otherwise, each with at
    // least one block of rows.
    const int64_t groups = std::max<int64_t>(1, a.rows / a.group_size);
    int64_t chunks = groups >= resident ? 1 : resident / groups;
    chunks = std::max<int64_t>(1, std::min(chunks, ceil_div(a.group_size, rows_per_iter)));
    pl.chunks = chunks;
    pl.rows_per_chunk = ceil_div(a.group_size, chunks);
    pl.num_items = groups * chunks;
  } else {
    // One wave of CTAs: a group takes as many chunks (items) as the CTAs it would leave idle otherwise.
    const int64_t groups = std::max<int64_t>(1, a.rows / a.group_size);
    int64_t chunks = groups >= resident ? 1 : resident / groups;
    chunks = std::max<int64_t>(1, std::min(chunks, a.group_size));
    pl.rows_per_chunk = ceil_div(a.group_size, chunks);
    pl.chunks = ceil_div(a.group_size, pl.rows_per_chunk);
    pl.num_items = groups * pl.chunks;
  }
  pl.grid = static_cast<int>(std::min<int64_t>(pl.num_items, resident));
  size_t ws = 0;
  if (!pl.per_row && pl.chunks > 1) ws += 2 * sizeof(float) * static_cast<size_t>(pl.num_items) * a.D;
  if (pl.affine) ws += 2 * sizeof(float) * static_cast<size_t>(pl.grid) * a.D;
  pl.workspace_bytes = ws;
  *plan = pl;
  return cudaSuccess;
}

}  // namespace

cudaError_t ln_mod_backward_plan(const LnModBwdArgs& a, LnModBwdPlan* plan) {
  if (ln_mod_check(a.D, a.x_dtype, a.mod_dtype) != nullptr || a.group_size < 1) return cudaErrorInvalidValue;
  if (a.path < kBwdAuto || a.path > kBwdTma) return cudaErrorInvalidValue;
  if (a.rms && a.path == kBwdRegs) return cudaErrorInvalidValue;  // version 5 only
  // Auto: the bulk-copy kernel (both norms); LayerNorm falls back to the register-fed kernel where a row
  // does not fit its shared memory.
  if (a.path == kBwdTma || a.path == kBwdAuto) {
    const cudaError_t err = tma_bwd_plan(a, plan);
    if (err == cudaSuccess || a.path == kBwdTma || a.rms) return err;
  }
  LnModBwdPlan pl;
  const int64_t nvec = a.D / vec_width(a.x_dtype);
  int vpt = a.vectors_per_thread;
  if (vpt <= 0) {
    // Prefer one 16-byte vector per thread (fewest fp32 column accumulators per thread) while a row
    // slot stays within 512 threads.
    // Two vectors per thread where a row slot stays within 512 threads: measured on an H100 at D = 1536,
    // 79% of the copy bandwidth against 74% with one (smaller row slots, so cheaper per-row barriers).
    vpt = 8;
    for (int v : {2, 4, 8}) {
      if (ceil_div(nvec, v) <= 512) {
        vpt = v;
        break;
      }
    }
  }
  if (vpt != 1 && vpt != 2 && vpt != 4 && vpt != 8) return cudaErrorInvalidValue;
  pl.vpt = vpt;
  pl.rows_per_iter = detail::bwd_rows_per_iter(vpt);
  pl.tpr = static_cast<int>(ceil_div(ceil_div(nvec, vpt), 32) * 32);
  if (pl.tpr > detail::kBwdMaxThreads) return cudaErrorInvalidValue;
  pl.per_row = a.group_size == 1;
  pl.affine = a.weight != nullptr;
  const bool combine = !pl.per_row || pl.affine;
  const int W = pl.tpr / 32;
  const void* kernel = bwd_kernel(a.x_dtype, a.mod_dtype, vpt, pl.affine, pl.per_row);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  auto smem_for = [&](int s) {
    size_t b = sizeof(float) * detail::bwd_reduce_floats(s, pl.rows_per_iter, W);
    if (combine) b += sizeof(float) * static_cast<size_t>(s - 1) * a.D;
    return b;
  };
  // Slots per CTA: the most resident warps per SM (registers decide), then the fewest CTAs (each writes
  // a row of partials). Slot-combine shared memory stays within kCombineBudget.
  int max_slots = std::min(15, detail::kBwdMaxThreads / pl.tpr);  // named barriers 1..15
  if (combine) {
    max_slots = static_cast<int>(
        std::min<int64_t>(max_slots, 1 + static_cast<int64_t>(kCombineBudget / (sizeof(float) * a.D))));
  }
  max_slots = std::max(max_slots, 1);
  cudaError_t err;
  int slots = a.slots, occ = 0;
  int dev = 0;
  err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  // Occupancy queries cost microseconds each; a training step repeats the same few shapes.
  const PlanKey key{kernel, pl.tpr, a.D, a.slots, dev};
  {
    std::lock_guard<std::mutex> lock(g_plan_mu);
    auto it = g_plan_cache.find(key);
    if (it != g_plan_cache.end()) {
      slots = it->second.first;
      occ = it->second.second;
    }
  }
  if (occ > 0) {
    // cached
  } else if (slots > 0) {
    if (slots > 15 || slots * pl.tpr > detail::kBwdMaxThreads) return cudaErrorInvalidValue;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, slots * pl.tpr, smem_for(slots));
    if (err != cudaSuccess) return err;
  } else {
    int best_warps = -1;
    for (int s = 1; s <= max_slots; ++s) {
      int o = 0;
      err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, kernel, s * pl.tpr, smem_for(s));
      if (err != cudaSuccess) return err;
      if (o * s * W >= best_warps && o > 0) {
        best_warps = o * s * W;
        slots = s;
        occ = o;
      }
    }
  }
  if (occ < 1 || slots < 1) return cudaErrorInvalidConfiguration;
  {
    std::lock_guard<std::mutex> lock(g_plan_mu);
    g_plan_cache[key] = {slots, occ};
  }
  pl.slots = slots;
  pl.smem_bytes = smem_for(slots);
  int sms = 0;
  err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  const int64_t resident = static_cast<int64_t>(sms) * occ;
  // One wave of persistent CTAs, but no CTA with less than two iterations of rows: every CTA writes a
  // partial row per item, which the second pass reads again.
  const int64_t rows_per_cta_min = 2LL * slots * pl.rows_per_iter;
  const int64_t target = std::max<int64_t>(1, std::min(resident, ceil_div(std::max<int64_t>(a.rows, 1), rows_per_cta_min)));

  if (pl.per_row) {
    pl.chunks = 1;
    pl.rows_per_chunk = std::max<int64_t>(1, ceil_div(a.rows, target));
    pl.num_items = std::max<int64_t>(1, ceil_div(a.rows, pl.rows_per_chunk));
  } else {
    const int64_t groups = a.rows / a.group_size;
    int64_t chunks = groups >= target ? 1 : target / groups;
    chunks = std::max<int64_t>(1, std::min(chunks, ceil_div(a.group_size, static_cast<int64_t>(slots) * pl.rows_per_iter)));
    pl.rows_per_chunk = ceil_div(a.group_size, chunks);
    pl.chunks = ceil_div(a.group_size, pl.rows_per_chunk);
    pl.num_items = groups * pl.chunks;
  }
  pl.grid = static_cast<int>(std::min<int64_t>(pl.num_items, resident));
  size_t ws = 0;
  if (!pl.per_row && pl.chunks > 1) ws += 2 * sizeof(float) * static_cast<size_t>(pl.num_items) * a.D;
  if (pl.affine) ws += 2 * sizeof(float) * static_cast<size_t>(pl.grid) * a.D;
  pl.workspace_bytes = ws;
  *plan = pl;
  return cudaSuccess;
}

namespace {

cudaError_t ln_mod_colsum(const LnModBwdArgs& a, const LnModBwdPlan& pl, const BwdParams& p, cudaStream_t stream);

// The bulk-copy backward's first pass; `p` gets the partial-row pointers the column-sum pass reads.
cudaError_t tma_backward(const LnModBwdArgs& a, const LnModBwdPlan& pl, void* workspace, BwdParams* p_out,
                         cudaStream_t stream) {
  const void* kernel = pl.kernel != nullptr ? pl.kernel
                                            : tma_bwd_kernel(a.x_dtype, a.mod_dtype, a.rms, pl.vpt, pl.affine,
                                                             pl.per_row, pl.rows_per_iter, pl.regs);
  if (kernel == nullptr) return cudaErrorInvalidValue;
  detail::TmaBwdParams p;
  p.dy = a.dy;
  p.x = a.x;
  p.scale = a.scale;
  p.weight = a.weight;
  p.bias = a.bias;
  p.mean = a.mean;
  p.rstd = a.rstd;
  p.dx = a.dx;
  p.dshift = a.dshift;
  p.dscale = a.dscale;
  float* ws = static_cast<float*>(workspace);
  p.part_shift = p.part_scale = p.part_weight = p.part_bias = nullptr;
  if (!pl.per_row && pl.chunks > 1) {
    p.part_shift = ws;
    ws += pl.num_items * a.D;
    p.part_scale = ws;
    ws += pl.num_items * a.D;
  }
  if (pl.affine) {
    p.part_weight = ws;
    ws += static_cast<int64_t>(pl.grid) * a.D;
    p.part_bias = ws;
  }
  p.rows = a.rows;
  p.group_size = a.group_size;
  p.scale_stride = a.scale_stride;
  p.chunks = pl.chunks;
  p.rows_per_chunk = pl.rows_per_chunk;
  p.num_items = pl.num_items;
  p.D = static_cast<int>(a.D);
  p.stages = pl.stages;
  p.stage_bytes = pl.stage_bytes;
  void* args[] = {&p};
  cudaError_t err =
      cudaLaunchKernel(kernel, dim3(pl.grid), dim3(pl.tpr), args, pl.smem_bytes, stream);
  if (err != cudaSuccess) return err;
  p_out->part_shift = p.part_shift;
  p_out->part_scale = p.part_scale;
  p_out->part_weight = p.part_weight;
  p_out->part_bias = p.part_bias;
  p_out->D = p.D;
  return cudaGetLastError();
}

}  // namespace

cudaError_t ln_mod_backward(const LnModBwdArgs& a, const LnModBwdPlan& pl, void* workspace, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  BwdParams p;
  if (pl.tma) {
    cudaError_t err = tma_backward(a, pl, workspace, &p, stream);
    if (err != cudaSuccess) return err;
    return ln_mod_colsum(a, pl, p, stream);
  }
  const void* kernel = bwd_kernel(a.x_dtype, a.mod_dtype, pl.vpt, pl.affine, pl.per_row);
  if (kernel == nullptr || pl.rows_per_iter != detail::bwd_rows_per_iter(pl.vpt)) return cudaErrorInvalidValue;
  p.dy = a.dy;
  p.x = a.x;
  p.scale = a.scale;
  p.weight = a.weight;
  p.bias = a.bias;
  p.mean = a.mean;
  p.rstd = a.rstd;
  p.dx = a.dx;
  p.dshift = a.dshift;
  p.dscale = a.dscale;
  float* ws = static_cast<float*>(workspace);
  p.part_shift = p.part_scale = p.part_weight = p.part_bias = nullptr;
  if (!pl.per_row && pl.chunks > 1) {
    p.part_shift = ws;
    ws += pl.num_items * a.D;
    p.part_scale = ws;
    ws += pl.num_items * a.D;
  }
  if (pl.affine) {
    p.part_weight = ws;
    ws += static_cast<int64_t>(pl.grid) * a.D;
    p.part_bias = ws;
  }
  p.rows = a.rows;
  p.group_size = a.group_size;
  p.scale_stride = a.scale_stride;
  p.chunks = pl.chunks;
  p.rows_per_chunk = pl.rows_per_chunk;
  p.num_items = pl.num_items;
  p.D = static_cast<int>(a.D);
  p.tpr = pl.tpr;
  p.slots = pl.slots;
  void* args[] = {&p};
  cudaError_t err = cudaLaunchKernel(kernel, dim3(pl.grid), dim3(pl.tpr * pl.slots), args, pl.smem_bytes, stream);
  if (err != cudaSuccess) return err;
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return ln_mod_colsum(a, pl, p, stream);
}

namespace {

// The backward's second pass: the partial rows of each group (and of d_weight, d_bias) added in order.
cudaError_t ln_mod_colsum(const LnModBwdArgs& a, const LnModBwdPlan& pl, const BwdParams& p, cudaStream_t stream) {
  cudaError_t err;
  ColsumParams c;
  int njobs = 0;
  int64_t max_out = 0;
  if (!pl.per_row && pl.chunks > 1) {
    const int64_t groups = a.rows / a.group_size;
    c.jobs[njobs++] = {p.part_shift, a.dshift, pl.chunks, groups, 1};
    c.jobs[njobs++] = {p.part_scale, a.dscale, pl.chunks, groups, 1};
    max_out = groups;
  }
  if (pl.affine) {
    c.jobs[njobs++] = {p.part_weight, a.dweight, pl.grid, 1, 0};
    c.jobs[njobs++] = {p.part_bias, a.dbias, pl.grid, 1, 0};
    max_out = std::max<int64_t>(max_out, 1);
  }
  if (njobs == 0) return cudaSuccess;
  if (max_out > 65535) return cudaErrorInvalidValue;  // cannot happen: chunks > 1 only when groups < grid
  c.D = p.D;
  void* cargs[] = {&c};
  const dim3 cgrid(static_cast<unsigned>(ceil_div(a.D, detail::kColsumX)), static_cast<unsigned>(max_out), njobs);
  err = cudaLaunchKernel(colsum_kernel(a.mod_dtype), cgrid, dim3(detail::kColsumX, detail::kColsumY), cargs, 0,
                         stream);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace

}  // namespace adaptiveload
