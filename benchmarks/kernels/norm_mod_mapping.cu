// Standalone benchmark of the bulk-copy norm-modulate kernels' launch choices (issue 59): the forward's row
// mapping (contiguous rows per CTA, the kernels before 2026-12-03, against rows interleaved over the CTAs),
// the register-fed LayerNorm forward (version 4), and the backward's register cap, beside cudaMemcpyAsync of
// the same bytes, for bf16 x and fp32 modulation, through the library's own launchers (csrc/ln_modulate.cu) with
// their benchmark overrides. Builds without torch, for bf16 x only (the other dtypes' tables are stubs):
//
//   bash benchmarks/kernels/build_norm_mod_mapping.sh /tmp/nm_mapping   # parallel nvcc, see there
//   /tmp/nm_mapping            # prints one line per shape and variant; nothing here asserts a time
//
// Variant kernels (norm_mod_variants.cu, 2026-12-03 second pass): the bulk-copy forward under register caps of
// 128/96/80/64 with the modulation in registers or read through L1, the LayerNorm forward's one-FMA
// normalisation, and the backward's fast dx, rows per iteration and caps; launched through the library's
// launchers (kernel_override), so with the library's plans and the backward's column-sum pass.
//
// Each variant's outputs are compared with the first variant's (forward y and backward dx bitwise: the
// same arithmetic per row; d_shift and d_scale relative, the column sums add in another order). Timing: 20
// back-to-back launches between CUDA events, median of 9 repeats after a warm-up.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "ln_modulate.h"
#include "norm_mod_tma.cuh"
#include "norm_mod_variants.h"

namespace adaptiveload {
namespace detail {
// The fp16 and fp32 tables are not built here.
const void* fwd_kernel_fp16(DType, int, int) { return nullptr; }
const void* fwd_kernel_fp32(DType, int, int) { return nullptr; }
const void* bwd_kernel_fp16(DType, int, bool, bool) { return nullptr; }
const void* bwd_kernel_fp32(DType, int, bool, bool) { return nullptr; }
#define STUB(tag)                                                                        \
  const void* tma_fwd_kernel_##tag(DType, int, bool, bool) { return nullptr; }                 \
  const void* tma_bwd_kernel_##tag(DType, int, bool, bool, int, int) { return nullptr; } \
  const void* tma_bwd_tuned_kernel_##tag(DType, int, int) { return nullptr; }
STUB(fp16_ln)
STUB(fp16_rms)
STUB(fp32_ln)
STUB(fp32_rms)
#undef STUB
}  // namespace detail
}  // namespace adaptiveload

using namespace adaptiveload;

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

__device__ uint32_t hash32(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>(z ^ (z >> 31));
}

// Roughly normal values (sum of 4 uniforms) with a per-row offset, scaled.
__global__ void fill_bf16(__nv_bfloat16* p, int64_t n, uint32_t seed, float scale, float offset) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < 4; ++k) s += (hash32(4 * i + k, seed) >> 8) * (1.f / 16777216.f) - 0.5f;
    p[i] = __float2bfloat16(s * 1.7f * scale + offset);
  }
}
__global__ void fill_f32(float* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < 4; ++k) s += (hash32(4 * i + k, seed) >> 8) * (1.f / 16777216.f) - 0.5f;
    p[i] = s * 1.7f * scale;
  }
}

float median_ms(const std::function<void()>& fn, int calls = 20, int reps = 9) {
  for (int i = 0; i < 3; ++i) fn();
  CK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < calls; ++i) fn();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / calls);
  }
  CK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

template <typename T>
std::vector<T> host(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Elements of two bf16 arrays that differ bitwise, and the largest |a - b| (floats >= 0 compare as ints).
__global__ void diff_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, unsigned long long* count,
                          unsigned int* maxabs) {
  unsigned long long c = 0;
  float m = 0.f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const unsigned short ua = reinterpret_cast<const unsigned short*>(a)[i];
    const unsigned short ub = reinterpret_cast<const unsigned short*>(b)[i];
    if (ua != ub) {
      ++c;
      const float d = fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i]));
      m = d == d ? fmaxf(m, d) : 1e30f;
    }
  }
  if (c) {
    atomicAdd(count, c);
    atomicMax(maxabs, __float_as_uint(m));
  }
}

struct Diff {
  unsigned long long count;
  float maxabs;
};

Diff gpu_diff(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n) {
  static unsigned long long* dc = nullptr;
  static unsigned int* dm = nullptr;
  if (!dc) {
    CK(cudaMalloc(&dc, 8));
    CK(cudaMalloc(&dm, 4));
  }
  CK(cudaMemset(dc, 0, 8));
  CK(cudaMemset(dm, 0, 4));
  diff_bf16<<<1024, 256>>>(a, b, n, dc, dm);
  CK(cudaGetLastError());
  Diff d;
  unsigned int m = 0;
  CK(cudaMemcpy(&d.count, dc, 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&m, dm, 4, cudaMemcpyDeviceToHost));
  std::memcpy(&d.maxabs, &m, 4);
  return d;
}

// Registers and local memory (spill) per thread of a kernel.
void kernel_res(const void* k, int* regs, int* local) {
  cudaFuncAttributes fa;
  *regs = *local = -1;
  if (k && cudaFuncGetAttributes(&fa, k) == cudaSuccess) {
    *regs = fa.numRegs;
    *local = static_cast<int>(fa.localSizeBytes);
  }
}

double rel_f32(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = (double)a[i] - b[i];
    num += d * d;
    den += (double)b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// A copy by the SMs (16-byte vectors, four in flight per thread, grid-stride), beside cudaMemcpyAsync: how close
// a kernel that reads x once and writes y once gets to the copy. CS: loads and stores with the .cs
// (streaming) cache operator.
template <bool CS>
__global__ void __launch_bounds__(256) sm_copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b,
                                                      int64_t n16) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = CS ? __ldcs(a + i + j * stride) : a[i + j * stride];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (CS) __stcs(b + i + j * stride, v[j]);
      else b[i + j * stride] = v[j];
    }
  }
  for (; i < n16; i += stride) b[i] = a[i];
}

// A copy by bulk copies: one thread per CTA moves chunks of `chunk` bytes global -> shared -> global through
// a ring of `stages` buffers (cp.async.bulk in both directions), the CTA's chunks interleaved over the grid.
// A stage is refilled once the store that read it has read it out (wait_group.read 1 keeps the latest store
// in flight).
__global__ void __launch_bounds__(32) tma_copy_kernel(const char* __restrict__ a, char* __restrict__ b, int64_t bytes,
                                                      int chunk, int stages) {
  using namespace adaptiveload::detail;
  extern __shared__ __align__(128) unsigned char sm[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(sm);
  unsigned char* buf = sm + 128;
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s) mbar_init(bars + s, 1);
  fence_mbar_init();
  const int64_t nchunks = (bytes + chunk - 1) / chunk;
  const int64_t mine = nchunks > blockIdx.x ? (nchunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto lo = [](int64_t u, int64_t v) { return u < v ? u : v; };
  auto issue = [&](int64_t k) {
    const int64_t c = blockIdx.x + k * gridDim.x;
    const uint32_t len = static_cast<uint32_t>(lo(chunk, bytes - c * chunk));
    const int s = static_cast<int>(k % stages);
    mbar_arrive_expect_tx(bars + s, len);
    bulk_g2s(buf + s * chunk, a + c * chunk, len, bars + s);
  };
  for (int64_t k = 0; k < lo(stages, mine); ++k) issue(k);
  for (int64_t k = 0; k < mine; ++k) {
    const int s = static_cast<int>(k % stages);
    mbar_wait(bars + s, static_cast<uint32_t>((k / stages) & 1));
    const int64_t c = blockIdx.x + k * gridDim.x;
    const uint32_t len = static_cast<uint32_t>(lo(chunk, bytes - c * chunk));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(b + c * chunk),
                 "r"(smem_u32(buf + s * chunk)), "r"(len)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    if (k >= 1 && k - 1 + stages < mine) issue(k - 1 + stages);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Shape {
  int64_t rows, D, group;
  const char* name;
};

int main(int argc, char** argv) {
  // --quick: two shapes; --fwd: the forward's library kernels only (no variant kernels, no backward);
  // --lib: the library's kernels only, forward and backward (no variant kernels).
  bool quick = false, fwd_only = false, lib_only = false;
  for (int i = 1; i < argc; ++i) {
    quick |= std::strcmp(argv[i], "--quick") == 0;
    fwd_only |= std::strcmp(argv[i], "--fwd") == 0;
    lib_only |= std::strcmp(argv[i], "--lib") == 0;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  std::vector<Shape> shapes = {
      {32760, 1152, 32760, "1x32760x1152 sample"}, {32760, 1536, 32760, "1x32760x1536 sample"},
      {32760, 3072, 32760, "1x32760x3072 sample"}, {32760, 5120, 32760, "1x32760x5120 sample"},
      {75600, 5120, 75600, "1x75600x5120 sample"}, {32768, 1536, 4096, "8x4096x1536 sample"},
      {32768, 5120, 4096, "8x4096x5120 sample"},   {32760, 1536, 1560, "1x21x1560x1536 frame"},
      {32760, 1536, 1, "1x32760x1536 token"},
  };
  if (quick) shapes.resize(2);
  // Warm the clocks: half a second of copies.
  {
    void *a, *b;
    CK(cudaMalloc(&a, 1 << 30));
    CK(cudaMalloc(&b, 1 << 30));
    for (int i = 0; i < 200; ++i) CK(cudaMemcpyAsync(b, a, 1 << 30, cudaMemcpyDeviceToDevice));
    CK(cudaDeviceSynchronize());
    CK(cudaFree(a));
    CK(cudaFree(b));
  }
  std::printf("%-24s %-10s %-26s %9s %8s %s\n", "shape", "op", "variant", "ms", "%copy", "check / plan");
  for (const Shape& sh : shapes) {
    const int64_t n = sh.rows * sh.D;
    const int64_t groups = sh.rows / sh.group;
    __nv_bfloat16 *x, *y, *y2, *dy, *dx, *dx2;
    float *shift, *scale, *mean, *rstd, *dsh, *dsc, *dsh2, *dsc2;
    void* ws;
    const size_t xb = n * sizeof(__nv_bfloat16), mb = groups * sh.D * sizeof(float);
    CK(cudaMalloc(&x, xb));
    CK(cudaMalloc(&y, xb));
    CK(cudaMalloc(&y2, xb));
    CK(cudaMalloc(&dy, xb));
    CK(cudaMalloc(&dx, xb));
    CK(cudaMalloc(&dx2, xb));
    CK(cudaMalloc(&shift, mb));
    CK(cudaMalloc(&scale, mb));
    CK(cudaMalloc(&dsh, mb));
    CK(cudaMalloc(&dsc, mb));
    CK(cudaMalloc(&dsh2, mb));
    CK(cudaMalloc(&dsc2, mb));
    CK(cudaMalloc(&mean, sh.rows * 4));
    CK(cudaMalloc(&rstd, sh.rows * 4));
    const size_t ws_bytes = 256u << 20;
    CK(cudaMalloc(&ws, ws_bytes));
    fill_bf16<<<1024, 256>>>(x, n, 1, 1.f, 0.3f);
    fill_bf16<<<1024, 256>>>(dy, n, 2, 1.f, 0.f);
    fill_f32<<<1024, 256>>>(shift, groups * sh.D, 3, 0.5f);
    fill_f32<<<1024, 256>>>(scale, groups * sh.D, 4, 0.5f);
    CK(cudaDeviceSynchronize());
    const float t_copy = median_ms([&] { CK(cudaMemcpyAsync(y2, x, xb, cudaMemcpyDeviceToDevice)); });
    std::printf("%-24s %-10s %-26s %9.4f %7.1f%% %.2f TB/s\n", sh.name, "copy", "cudaMemcpyAsync", t_copy, 100.f,
                2.0 * xb / (t_copy * 1e-3) / 1e12);
    {
      int per_sm = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, sm_copy_kernel<false>, 256, 0));
      const int grid = per_sm * prop.multiProcessorCount;
      const int64_t n16 = static_cast<int64_t>(xb / 16);
      for (int cs = 0; cs < 2; ++cs) {
        const float t = median_ms([&] {
          if (cs) sm_copy_kernel<true><<<grid, 256>>>(reinterpret_cast<const uint4*>(x), reinterpret_cast<uint4*>(y), n16);
          else sm_copy_kernel<false><<<grid, 256>>>(reinterpret_cast<const uint4*>(x), reinterpret_cast<uint4*>(y), n16);
        });
        CK(cudaGetLastError());
        std::printf("%-24s %-10s %-26s %9.4f %7.1f%% %.2f TB/s\n", sh.name, "copy", cs ? "SM copy kernel, .cs" : "SM copy kernel",
                    t, 100.f * t_copy / t, 2.0 * xb / (t * 1e-3) / 1e12);
      }
      const int tc[][2] = {{16384, 4}, {32768, 3}, {8192, 8}, {65536, 2}};
      for (const auto& q : tc) {
        const int smem = 128 + q[0] * q[1];
        if (cudaFuncSetAttribute(tma_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
          cudaGetLastError();
          continue;
        }
        int tper = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&tper, tma_copy_kernel, 32, smem));
        const int tgrid = tper * prop.multiProcessorCount;
        const float t = median_ms([&] {
          tma_copy_kernel<<<tgrid, 32, smem>>>(reinterpret_cast<const char*>(x), reinterpret_cast<char*>(y),
                                               static_cast<int64_t>(xb), q[0], q[1]);
        });
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        const Diff d = gpu_diff(y, x, n);
        char name[48];
        std::snprintf(name, sizeof name, "bulk copy %dK x%d (%d/SM)", q[0] >> 10, q[1], tper);
        std::printf("%-24s %-10s %-26s %9.4f %7.1f%% %.2f TB/s, %llu differ\n", sh.name, "copy", name, t,
                    100.f * t_copy / t, 2.0 * xb / (t * 1e-3) / 1e12, d.count);
      }
    }
    for (int rms = 0; rms < 2; ++rms) {
      const char* op = rms ? "rms" : "ln";
      LnModFwdArgs f;
      f.x = x;
      f.shift = shift;
      f.scale = scale;
      f.y = y;
      f.mean = mean;
      f.rstd = rstd;
      f.rows = sh.rows;
      f.D = sh.D;
      f.group_size = sh.group;
      f.shift_stride = sh.D;
      f.scale_stride = sh.D;
      f.rms = rms;
      // Forward variants: the library's kernels (path, interleave), then the variant kernels of
      // norm_mod_variants.cu (register cap, modulation through L1, one-FMA LayerNorm normalisation) at the
      // launcher's row mapping. Outputs compared with the first variant's on the GPU.
      struct FV {
        int path, inter;
        const void* kernel;
        char name[48];
        int stages;  // 0: the plan's
      };
      std::vector<FV> fvs;
      if (!rms) fvs.push_back(FV{2, 0, nullptr, "v4", 0});
      fvs.push_back(FV{4, 1, nullptr, "tma contiguous", 0});
      fvs.push_back(FV{4, 2, nullptr, "tma interleaved", 0});
      fvs.push_back(FV{0, 0, nullptr, "auto (launcher)", 0});
      {
        // The library's bulk-copy kernel at the plan's mapping with 3 and 4 stages (the plan takes 2, per
        // token 3).
        LnModFwdArgs q = f;
        q.path = kFwdTma;
        NormModFwdPlan pq;
        if (norm_mod_forward_plan(q, &pq) == cudaSuccess && pq.tma) {
          for (int st : {3, 4}) {
            FV v{4, pq.interleave ? 2 : 1, nullptr, "", st};
            std::snprintf(v.name, sizeof v.name, "tma %s st%d", pq.interleave ? "il" : "ct", st);
            fvs.push_back(v);
          }
        }
      }
      if (sh.group > 1 && !fwd_only && !lib_only) {
        LnModFwdArgs q = f;
        q.path = kFwdTma;
        NormModFwdPlan pq;
        if (norm_mod_forward_plan(q, &pq) == cudaSuccess && pq.tma && !pq.per_row) {
          for (int regs : {128, 96, 80, 64})
            for (int l1 = 0; l1 < 2; ++l1)
              for (int fma = 0; fma < (rms ? 1 : 2); ++fma) {
                const void* k = nmv::fwd(rms, pq.vpt, pq.interleave, regs, l1, fma);
                if (!k) continue;
                FV v{4, pq.interleave ? 2 : 1, k, "", 0};
                std::snprintf(v.name, sizeof v.name, "var %s r%d%s%s", pq.interleave ? "il" : "ct", regs,
                              l1 ? " modL1" : " modreg", fma ? " fma" : "");
                fvs.push_back(v);
              }
        }
      }
      bool have_ref = false;
      for (const FV& v : fvs) {
        if (v.path == 2 && sh.group == 1) continue;
        LnModFwdArgs a = f;
        a.path = v.path;
        a.interleave = v.inter;
        a.kernel_override = v.kernel;
        a.stages = v.stages;
        __nv_bfloat16* yo = have_ref ? y : y2;  // the first variant's output stays in y2
        CK(cudaMemsetAsync(yo, 0xff, xb));
        a.y = yo;
        cudaError_t e = ln_mod_forward(a, 0);
        if (e != cudaSuccess) {
          std::printf("%-24s %-10s %-26s refused (%s)\n", sh.name, op, v.name, cudaGetErrorString(e));
          cudaGetLastError();
          continue;
        }
        CK(cudaDeviceSynchronize());
        char check[96] = "reference";
        if (have_ref) {
          const Diff d = gpu_diff(yo, y2, n);
          std::snprintf(check, sizeof check, "%llu differ, max %.3g", d.count, d.maxabs);
        }
        have_ref = true;
        const float t = median_ms([&] { CK(ln_mod_forward(a, 0)); });
        NormModFwdPlan pl;
        CK(norm_mod_forward_plan(a, &pl));
        int nr = 0, nl = 0;
        kernel_res(v.kernel, &nr, &nl);
        std::printf("%-24s %-10s %-26s %9.4f %7.1f%% %s; plan tma %d thr %d st %d grid %d rpc %lld ctas/SM %d il %d regs %d local %d\n",
                    sh.name, rms ? "rms fwd" : "ln fwd", v.name, t, 100.f * t_copy / t, check, pl.tma, pl.threads,
                    pl.stages, pl.grid, (long long)pl.rows_per_cta, pl.ctas_per_sm, pl.interleave, nr, nl);
      }
      if (fwd_only) continue;
      // Backward variants, after a forward that filled mean and rstd.
      CK(ln_mod_forward(f, 0));
      LnModBwdArgs b;
      b.dy = dy;
      b.x = x;
      b.scale = scale;
      b.mean = rms ? nullptr : mean;
      b.rstd = rstd;
      b.dx = dx;
      b.dshift = dsh;
      b.dscale = dsc;
      b.rows = sh.rows;
      b.D = sh.D;
      b.group_size = sh.group;
      b.scale_stride = sh.D;
      b.rms = rms;
      struct BV {
        int rows, regs, stages;
        const void* kernel;
        char name[48];
      };
      // The backward's row mapping is fixed per kernel (interleaved for RMSNorm and per token). Then the
      // variant kernels (norm_mod_variants.cu): rows per iteration, register cap, the fast dx (16-bit x).
      std::vector<BV> bvs = {{0, 0, 0, nullptr, "auto (launcher)"}, {0, 96, 0, nullptr, "96 regs"}};
      if (sh.group > 1 && !lib_only) {
        // {rows per iteration, register cap, opt (bit 0 fast dx, bit 1 scale through L1, bit 2 late issue),
        // stages (0: the launcher's)}
        const int vlist[][4] = {{2, 96, 0, 0}, {2, 96, 1, 0}, {2, 96, 3, 0}, {2, 96, 4, 0}, {2, 96, 5, 0},
                                {2, 96, 5, 3}, {2, 96, 7, 0}, {2, 96, 7, 3}, {2, 80, 5, 0}, {2, 80, 5, 3},
                                {1, 96, 1, 0}, {1, 96, 5, 3}, {2, 112, 1, 0}, {2, 128, 0, 0}, {2, 128, 1, 0},
                                {2, 128, 5, 0}, {2, 128, 5, 3}};
        for (const auto& q : vlist) {
          const void* k = nmv::bwd(rms, q[0], q[1], q[2]);
          if (!k) continue;
          BV v{q[0], q[1], q[3], k, ""};
          std::snprintf(v.name, sizeof v.name, "var R%d r%d%s%s%s%s", q[0], q[1], q[2] & 1 ? " fast" : "",
                        q[2] & 2 ? " scL1" : "", q[2] & 4 ? " late" : "", q[3] == 3 ? " st3" : "");
          bvs.push_back(v);
        }
      }
      std::vector<float> dsh_ref, dsc_ref;
      for (const BV& v : bvs) {
        LnModBwdArgs a = b;
        a.path = kBwdTma;
        a.regs = v.kernel ? 0 : v.regs;
        a.slots = v.kernel ? v.rows : 0;
        a.kernel_override = v.kernel;
        a.stages = v.stages;
        LnModBwdPlan pl;
        cudaError_t e = ln_mod_backward_plan(a, &pl);
        if (e != cudaSuccess || pl.workspace_bytes > ws_bytes) {
          std::printf("%-24s %-10s %-26s refused (%s)\n", sh.name, op, v.name, cudaGetErrorString(e));
          cudaGetLastError();
          continue;
        }
        CK(cudaMemsetAsync(dx, 0xff, xb));
        CK(cudaMemsetAsync(dsh, 0xff, mb));
        CK(cudaMemsetAsync(dsc, 0xff, mb));
        CK(ln_mod_backward(a, pl, ws, 0));
        CK(cudaDeviceSynchronize());
        std::vector<float> dshh = host(dsh, groups * sh.D), dsch = host(dsc, groups * sh.D);
        char check[128] = "reference";
        bool nan = false;
        for (float v2 : dshh) nan |= !std::isfinite(v2);
        if (dsh_ref.empty()) {
          CK(cudaMemcpy(dx2, dx, xb, cudaMemcpyDeviceToDevice));
          dsh_ref = dshh;
          dsc_ref = dsch;
        } else {
          const Diff d = gpu_diff(dx, dx2, n);
          std::snprintf(check, sizeof check, "dx %llu differ max %.3g, dshift rel %.1e, dscale rel %.1e%s", d.count,
                        d.maxabs, rel_f32(dshh, dsh_ref), rel_f32(dsch, dsc_ref), nan ? " NaN" : "");
        }
        const float t = median_ms([&] { CK(ln_mod_backward(a, pl, ws, 0)); });
        int nr = 0, nl = 0;
        kernel_res(pl.kernel, &nr, &nl);
        std::printf("%-24s %-10s %-26s %9.4f %7.1f%% %s; plan thr %d R %d st %d grid %d items %lld chunks %lld il %d cap %d regs %d local %d\n",
                    sh.name, rms ? "rms bwd" : "ln bwd", v.name, t, 100.f * 1.5f * t_copy / t, check, pl.tpr,
                    pl.rows_per_iter, pl.stages, pl.grid, (long long)pl.num_items, (long long)pl.chunks,
                    pl.interleave, pl.regs, nr, nl);
      }
    }
    for (void* p : {(void*)x, (void*)y, (void*)y2, (void*)dy, (void*)dx, (void*)dx2, (void*)shift, (void*)scale,
                    (void*)dsh, (void*)dsc, (void*)dsh2, (void*)dsc2, (void*)mean, (void*)rstd, ws})
      CK(cudaFree(p));
  }
  return 0;
}
