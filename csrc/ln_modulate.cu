// Host side of the fused LayerNorm-Modulate op: input checks, launch plans, the launches, and the
// second (column-sum) pass of the backward.
#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "ln_modulate_kernels.cuh"

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

cudaError_t ln_mod_forward(const LnModFwdArgs& a, cudaStream_t stream) {
  if (ln_mod_check(a.D, a.x_dtype, a.mod_dtype) != nullptr || a.group_size < 1) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
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
  if (a.path < 0 || a.path > 3) return cudaErrorInvalidValue;
  const bool fits = vpt <= detail::kFwdPersistentMaxVpt && a.rows_per_cta <= 1;
  if (a.path >= 2 && !fits) return cudaErrorInvalidValue;
  const bool single_row_wins = a.group_size == a.rows && W == 2;
  const bool persistent = a.path >= 2 || (a.path == 0 && fits && a.group_size > 1 && !single_row_wins);
  const int kind = !persistent ? detail::kFwdSingleRow
                               : a.path == 3 ? detail::kFwdPersistentLowRegs : detail::kFwdPersistent;
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

cudaError_t ln_mod_backward_plan(const LnModBwdArgs& a, LnModBwdPlan* plan) {
  if (ln_mod_check(a.D, a.x_dtype, a.mod_dtype) != nullptr || a.group_size < 1) return cudaErrorInvalidValue;
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

cudaError_t ln_mod_backward(const LnModBwdArgs& a, const LnModBwdPlan& pl, void* workspace, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  const void* kernel = bwd_kernel(a.x_dtype, a.mod_dtype, pl.vpt, pl.affine, pl.per_row);
  if (kernel == nullptr || pl.rows_per_iter != detail::bwd_rows_per_iter(pl.vpt)) return cudaErrorInvalidValue;
  BwdParams p;
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

}  // namespace adaptiveload
