// Standalone benchmark of the bulk-copy norm-modulate kernels' launch choices (issue 59): the forward's row
// mapping (contiguous rows per CTA, the kernels before 2026-12-03, against rows interleaved over the CTAs),
// the register-fed LayerNorm forward (version 4), and the backward's register cap, beside cudaMemcpyAsync of
// the same bytes, for bf16 x and fp32 modulation, through the library's own launchers (csrc/ln_modulate.cu) with
// their benchmark overrides. Builds without torch, for bf16 x only (the other dtypes' tables are stubs):
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Icsrc -o /tmp/nm_mapping \
//        benchmarks/kernels/norm_mod_mapping.cu csrc/ln_modulate.cu csrc/ln_modulate_bf16.cu \
//        csrc/norm_mod_tma_bf16_ln.cu csrc/norm_mod_tma_bf16_rms.cu
//   /tmp/nm_mapping            # prints one line per shape and variant; nothing here asserts a time
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

namespace adaptiveload {
namespace detail {
// The fp16 and fp32 tables are not built here.
const void* fwd_kernel_fp16(DType, int, int) { return nullptr; }
const void* fwd_kernel_fp32(DType, int, int) { return nullptr; }
const void* bwd_kernel_fp16(DType, int, bool, bool) { return nullptr; }
const void* bwd_kernel_fp32(DType, int, bool, bool) { return nullptr; }
#define STUB(tag)                                                                        \
  const void* tma_fwd_kernel_##tag(DType, int, bool, bool) { return nullptr; }                 \
  const void* tma_bwd_kernel_##tag(DType, int, bool, bool, int, int) { return nullptr; }
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

double rel_f32(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = (double)a[i] - b[i];
    num += d * d;
    den += (double)b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

struct Shape {
  int64_t rows, D, group;
  const char* name;
};

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
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
      // Forward variants: (path, interleave, stages).
      struct FV {
        int path, inter, stages;
        const char* name;
      };
      std::vector<FV> fvs = {{4, 1, 0, "tma contiguous"}, {4, 2, 0, "tma interleaved"}};
      if (!rms) {
        fvs.insert(fvs.begin(), FV{2, 0, 0, "v4 (regs, persistent)"});
      }
      fvs.push_back({0, 0, 0, "auto (launcher)"});
      std::vector<__nv_bfloat16> y_ref;
      for (const FV& v : fvs) {
        if (v.path == 2 && sh.group == 1) continue;
        LnModFwdArgs a = f;
        a.path = v.path;
        a.interleave = v.inter;
        a.stages = v.stages;
        CK(cudaMemsetAsync(y, 0xff, xb));
        cudaError_t e = ln_mod_forward(a, 0);
        if (e != cudaSuccess) {
          std::printf("%-24s %-10s %-26s refused (%s)\n", sh.name, op, v.name, cudaGetErrorString(e));
          cudaGetLastError();
          continue;
        }
        CK(cudaDeviceSynchronize());
        std::vector<__nv_bfloat16> yh = host(y, n);
        char check[64] = "reference";
        if (y_ref.empty()) {
          y_ref = yh;
        } else {
          size_t diff = 0;
          for (int64_t i = 0; i < n; ++i) diff += std::memcmp(&yh[i], &y_ref[i], 2) != 0;
          std::snprintf(check, sizeof check, "%zu elements differ", diff);
        }
        const float t = median_ms([&] { CK(ln_mod_forward(a, 0)); });
        NormModFwdPlan pl;
        CK(norm_mod_forward_plan(a, &pl));
        std::printf("%-24s %-10s %-26s %9.4f %7.1f%% %s; plan tma %d thr %d st %d grid %d rpc %lld ctas/SM %d il %d\n",
                    sh.name, rms ? "rms fwd" : "ln fwd", v.name, t, 100.f * t_copy / t, check, pl.tma, pl.threads,
                    pl.stages, pl.grid, (long long)pl.rows_per_cta, pl.ctas_per_sm, pl.interleave);
      }
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
        int inter, regs;
        const char* name;
      };
      // The backward's row mapping is fixed per kernel (interleaved for RMSNorm and per token).
      std::vector<BV> bvs = {{0, 96, "96 regs"}, {0, 0, "auto (launcher)"}};
      std::vector<__nv_bfloat16> dx_ref;
      std::vector<float> dsh_ref, dsc_ref;
      for (const BV& v : bvs) {
        LnModBwdArgs a = b;
        a.path = kBwdTma;
        a.regs = v.regs;
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
        std::vector<__nv_bfloat16> dxh = host(dx, n);
        std::vector<float> dshh = host(dsh, groups * sh.D), dsch = host(dsc, groups * sh.D);
        char check[96] = "reference";
        bool nan = false;
        for (float v2 : dshh) nan |= !std::isfinite(v2);
        if (dx_ref.empty()) {
          dx_ref = dxh;
          dsh_ref = dshh;
          dsc_ref = dsch;
        } else {
          size_t diff = 0;
          for (int64_t i = 0; i < n; ++i) diff += std::memcmp(&dxh[i], &dx_ref[i], 2) != 0;
          std::snprintf(check, sizeof check, "dx %zu differ, dshift rel %.1e, dscale rel %.1e%s", diff,
                        rel_f32(dshh, dsh_ref), rel_f32(dsch, dsc_ref), nan ? " NaN" : "");
        }
        const float t = median_ms([&] { CK(ln_mod_backward(a, pl, ws, 0)); });
        std::printf("%-24s %-10s %-26s %9.4f %7.1f%% %s; plan thr %d R %d st %d grid %d items %lld chunks %lld il %d regs %d\n",
                    sh.name, rms ? "rms bwd" : "ln bwd", v.name, t, 100.f * 1.5f * t_copy / t, check, pl.tpr,
                    pl.rows_per_iter, pl.stages, pl.grid, (long long)pl.num_items, (long long)pl.chunks,
                    pl.interleave, pl.regs);
      }
    }
    for (void* p : {(void*)x, (void*)y, (void*)y2, (void*)dy, (void*)dx, (void*)dx2, (void*)shift, (void*)scale,
                    (void*)dsh, (void*)dsc, (void*)dsh2, (void*)dsc2, (void*)mean, (void*)rstd, ws})
      CK(cudaFree(p));
  }
  return 0;
}
