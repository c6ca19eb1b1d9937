// Kernels of the fused LayerNorm-Modulate op. Included by the per-dtype .cu files, which instantiate them,
// so that ninja compiles the instantiations in parallel.
//
// Numerics: statistics and arithmetic in fp32. The forward uses the corrected two-pass algorithm (mean,
// then the sums of d = x - mean and d^2 in one more reduction), so rows far from zero (|x| ~ 1e4) and
// constant rows keep full fp32 accuracy. All reductions have a fixed order: results are bitwise
// reproducible run to run, and no kernel uses atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ln_modulate.h"

namespace adaptiveload {
namespace detail {

// ---------------------------------------------------------------------------------------------------
// Element conversion and 16-byte vector access.

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 16 bytes of T.
template <typename T>
struct alignas(16) Pack {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  // Read-only, no L1 allocation: every byte of x and dy is read exactly once.
  Pack<T> out;
  uint4 u;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(p));
  *reinterpret_cast<uint4*>(&out) = u;
  return out;
}

template <typename T>
__device__ __forceinline__ Pack<T> load_pack_cached(const T* p) {
  // Modulation rows, weight and bias: re-read by many rows, so let them live in L1.
  Pack<T> out;
  *reinterpret_cast<uint4*>(&out) = __ldg(reinterpret_cast<const uint4*>(p));
  return out;
}

// A copy of `v` the compiler cannot prove equal to `v`. The backward converts x and dy to fp32 twice, on
// either side of a barrier; laundering the second use keeps only the packed 16-bit values live across
// the barrier (half the registers) instead of the fp32 conversions of the first use.
template <typename T>
__device__ __forceinline__ Pack<T> launder(const Pack<T>& v) {
  Pack<T> out;
  const uint32_t* in = reinterpret_cast<const uint32_t*>(&v);
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) asm volatile("mov.b32 %0, %1;" : "=r"(o[j]) : "r"(in[j]));
  return out;
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& v) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&v);
}

// N consecutive values of type M (N * sizeof(M) a multiple of 16) into fp32 registers.
template <typename M, int N>
__device__ __forceinline__ void load_floats(const M* p, float (&out)[N]) {
  constexpr int P = Pack<M>::N;
  static_assert(N % P == 0, "vector width");
#pragma unroll
  for (int j = 0; j < N / P; ++j) {
    Pack<M> pk = load_pack_cached(p + j * P);
#pragma unroll
    for (int k = 0; k < P; ++k) out[j * P + k] = to_float(pk.v[k]);
  }
}

template <typename M, int N>
__device__ __forceinline__ void store_floats(M* p, const float (&in)[N]) {
  constexpr int P = Pack<M>::N;
  static_assert(N % P == 0, "vector width");
#pragma unroll
  for (int j = 0; j < N / P; ++j) {
    Pack<M> pk;
#pragma unroll
    for (int k = 0; k < P; ++k) pk.v[k] = from_float<M>(in[j * P + k]);
    store_pack(p + j * P, pk);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane ends with the same, order-fixed sum.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ void named_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// ---------------------------------------------------------------------------------------------------
// Forward. A row slot of 32 * warps_per_row threads holds one row in registers (VPT 16-byte vectors per
// thread, interleaved so that each load instruction of a warp covers 512 contiguous bytes).

struct FwdParams {
  const void* x;
  const void* shift;
  const void* scale;
  const float* weight;
  const float* bias;
  void* y;
  float* mean;
  float* rstd;
  int64_t rows;
  int64_t group_size;
  int64_t shift_stride;
  int64_t scale_stride;
  int D;
  int warps_per_row;
  int rows_per_cta;
  float eps;
};

constexpr int kFwdMaxThreads = 512;
// Register cap of the forward: 80 gives six 128-thread CTAs per SM; no spill up to 4 vectors per thread
// (the host's default), 20 to 88 bytes (L1-resident) at 5 to 8.

// Sums `v` over the row slot; `buf` is this row slot's [warps_per_row] scratch in shared memory.
__device__ __forceinline__ float row_sum(float v, float* buf, int W, int warp, int lane) {
  v = warp_sum(v);
  if (W == 1) return v;
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < W; ++w) s += buf[w];
  return s;
}

template <typename T, typename M, int VPT>
__global__ void __maxnreg__(80) ln_mod_fwd_kernel(const FwdParams p) {
  constexpr int VEC = Pack<T>::N;
  extern __shared__ float fwd_smem[];
  const int W = p.warps_per_row;
  const int TPR = 32 * W;
  const int rslot = threadIdx.x / TPR;
  const int t = threadIdx.x - rslot * TPR;
  const int warp = t >> 5;
  const int lane = t & 31;
  const int nvec = p.D / VEC;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * p.rows_per_cta + rslot;
  const bool row_ok = row < p.rows;
  const T* xr = static_cast<const T*>(p.x) + row * p.D;

  // The row stays in registers as loaded (16-bit values packed two to a register): half the registers of
  // fp32 copies, so more rows in flight per SM. Each pass converts again (launder keeps the compiler from
  // holding fp32 copies across passes instead).
  Pack<T> xp[VPT];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = t + i * TPR;
    if (row_ok && v < nvec) {
      xp[i] = load_pack(xr + v * VEC);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) xp[i].v[k] = from_float<T>(0.f);
    }
  }

  const float inv_d = 1.f / static_cast<float>(p.D);
  float* buf = fwd_smem + rslot * 3 * W;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) s += to_float(xp[i].v[k]);
  const float mean0 = row_sum(s, buf, W, warp, lane) * inv_d;

  // Corrected two-pass: the sum of d corrects the rounding of mean0, the sum of d^2 gives the variance.
  float sd = 0.f, sdd = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (t + i * TPR < nvec) {
      const Pack<T> q = launder(xp[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = to_float(q.v[k]) - mean0;
        sd += d;
        sdd += d * d;
      }
    }
  }
  sd = warp_sum(sd);
  sdd = warp_sum(sdd);
  if (W > 1) {
    if (lane == 0) {
      buf[W + warp] = sd;
      buf[2 * W + warp] = sdd;
    }
    __syncthreads();
    sd = 0.f;
    sdd = 0.f;
    for (int w = 0; w < W; ++w) {
      sd += buf[W + w];
      sdd += buf[2 * W + w];
    }
  }
  const float corr = sd * inv_d;
  const float var = fmaxf(sdd * inv_d - corr * corr, 0.f);
  const float rstd = rsqrtf(var + p.eps);
  const float ncr = -corr * rstd;
  if (!row_ok) return;
  if (t == 0) {
    p.mean[row] = mean0 + corr;
    p.rstd[row] = rstd;
  }

  const int64_t g = p.group_size == 1 ? row : row / p.group_size;
  const M* shr = static_cast<const M*>(p.shift) + g * p.shift_stride;
  const M* scr = static_cast<const M*>(p.scale) + g * p.scale_stride;
  T* yr = static_cast<T*>(p.y) + row * p.D;
  const bool affine = p.weight != nullptr;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = t + i * TPR;
    if (v < nvec) {
      float sh[VEC], sc[VEC];
      load_floats<M, VEC>(shr + v * VEC, sh);
      load_floats<M, VEC>(scr + v * VEC, sc);
      float n[VEC];
      const Pack<T> q = launder(xp[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) n[k] = fmaf(to_float(q.v[k]) - mean0, rstd, ncr);  // ((x - mean0) - corr) * rstd
      if (affine) {
        float w[VEC], b[VEC];
        load_floats<float, VEC>(p.weight + v * VEC, w);
        load_floats<float, VEC>(p.bias + v * VEC, b);
#pragma unroll
        for (int k = 0; k < VEC; ++k) n[k] = fmaf(n[k], w[k], b[k]);
      }
      Pack<T> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(fmaf(n[k], 1.f + sc[k], sh[k]));
      store_pack(yr + v * VEC, out);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Forward, persistent (version 4). The same row slots and per-row arithmetic as ln_mod_fwd_kernel, but the
// grid is one wave of resident CTAs and each row slot walks the rows gslot, gslot + nslots, ... with a
// two-stage software pipeline in registers: the next row's 16-byte loads are issued before the current
// row is reduced and written, so a slot keeps a row in flight through its barriers and stores instead of
// relying on other CTAs alone to hide the load latency. One row slot per CTA (32 * W threads): the slot's
// barriers are __syncthreads, no slot waits for another's row, and the kernel uses one hardware barrier
// (named barriers with a run-time id make ptxas reserve all 16, which may limit the CTAs per SM beyond
// what the occupancy API reports).

// Register cap of the persistent forward: two row buffers of VPT vectors (4 registers each) besides the
// single-row kernel's working set. ptxas 13.0 (sm_90): up to 3 vectors per thread fit 80 registers with no
// spill (24-25 warps per SM); 4 vectors need 88 (no spill at 88 or 96; 40 bytes of spill at 80). 96 and 88
// give the same 4 CTAs of 160 threads per SM at D = 5120; LOW_REGS (a benchmark variant) caps 4 vectors at
// 80 for 5 CTAs per SM with the spill.
__host__ __device__ constexpr int fwd_persistent_max_registers(int vpt, bool low_regs) {
  return (low_regs || vpt <= 3) ? 80 : 96;
}

// An int the compiler cannot see through: column offsets derived from it are recomputed per row (a few
// integer operations) instead of being hoisted out of the row loop as 64-bit addresses held in registers.
__device__ __forceinline__ int opaque(int v) {
  int out;
  asm volatile("mov.b32 %0, %1;" : "=r"(out) : "r"(v));
  return out;
}

__device__ __forceinline__ uint4 launder_u4(const uint4& v) {
  uint4 o;
  asm volatile("mov.b32 %0, %1;" : "=r"(o.x) : "r"(v.x));
  asm volatile("mov.b32 %0, %1;" : "=r"(o.y) : "r"(v.y));
  asm volatile("mov.b32 %0, %1;" : "=r"(o.z) : "r"(v.z));
  asm volatile("mov.b32 %0, %1;" : "=r"(o.w) : "r"(v.w));
  return o;
}

// 16 bytes of x, volatile: the compiler keeps it ahead of the current row's barriers (volatile asm is not
// moved across __syncthreads) rather than sinking it towards the next row's first use.
__device__ __forceinline__ uint4 ld_stream_v(const void* p) {
  uint4 u;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(p));
  return u;
}

// Modulation, weight and bias reads and the output stores, as volatile asm: their order is fixed, so each
// 16-byte output vector is read, computed and stored before the next one's inputs are read. Otherwise the
// compiler hoists the inputs of all VPT vectors (16 registers each with fp32 modulation) and spills.
__device__ __forceinline__ uint4 ld_cached_v(const void* p) {
  uint4 u;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(p));
  return u;
}

template <typename M, int N>
__device__ __forceinline__ void load_floats_v(const M* p, float (&out)[N]) {
  constexpr int P = Pack<M>::N;
  static_assert(N % P == 0, "vector width");
#pragma unroll
  for (int j = 0; j < N / P; ++j) {
    Pack<M> pk;
    *reinterpret_cast<uint4*>(&pk) = ld_cached_v(p + j * P);
#pragma unroll
    for (int k = 0; k < P; ++k) out[j * P + k] = to_float(pk.v[k]);
  }
}

// Streaming stores (st.global.cs: evict first from L2; each line of y is written once and not read back
// here): version 4's y, where they measured 1-6% faster on an H200 at all but the largest shape
// (docs/fused_op.md, "fourth pass"). The bulk-copy kernels keep plain stores: there .cs stores, an L2
// evict-first policy on the bulk copies, or both measured neutral or slower. ADAPTIVELOAD_NM_CS=0 builds
// version 4 with plain stores (a benchmark switch).
#ifndef ADAPTIVELOAD_NM_CS
#define ADAPTIVELOAD_NM_CS 1
#endif

__device__ __forceinline__ void st_v(void* p, const uint4& u) {
#if ADAPTIVELOAD_NM_CS
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w)
               : "memory");
#else
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w)
               : "memory");
#endif
}

// Modulation row of `row`; 32-bit division where the operands fit (a 64-bit one is a slow library call).
__device__ __forceinline__ int64_t group_of(int64_t row, int64_t group_size) {
  if (group_size == 1) return row;
  if (((row | group_size) >> 31) == 0)
    return static_cast<int64_t>(static_cast<uint32_t>(row) / static_cast<uint32_t>(group_size));
  return row / group_size;
}

// Issues the loads of one row into `xp` (16-byte words as loaded); vectors past the row end are zeros,
// which is 0.0 in every supported type, and enter the sums as such.
template <typename T, int VPT>
__device__ __forceinline__ void fwd_issue_row(uint4 (&xp)[VPT], const T* xr, int t, int tpr, int nvec) {
  constexpr int VEC = Pack<T>::N;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = t + i * tpr;
    xp[i] = v < nvec ? ld_stream_v(xr + v * VEC) : make_uint4(0u, 0u, 0u, 0u);
  }
}

template <typename T>
__device__ __forceinline__ Pack<T> as_pack(const uint4& u) {
  Pack<T> q;
  *reinterpret_cast<uint4*>(&q) = launder_u4(u);
  return q;
}

// Statistics, mean/rstd and the output row for the row held in `xp` (ln_mod_fwd_kernel's arithmetic).
// buf: the CTA's 3 * W floats; the two reductions use disjoint parts, and each part's next write (next
// row) comes after the other's barrier, which every warp reaches only after reading this one.
template <typename T, typename M, int VPT>
__device__ __forceinline__ void fwd_finish_row(const FwdParams& p, const uint4 (&xp)[VPT], int64_t row, int t0,
                                               int tpr, int W, int warp, int lane, float* buf, int nvec,
                                               float inv_d) {
  constexpr int VEC = Pack<T>::N;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const Pack<T> q = as_pack<T>(xp[i]);
#pragma unroll
    for (int k = 0; k < VEC; ++k) s += to_float(q.v[k]);
  }
  s = warp_sum(s);
  if (W > 1) {
    // The W (<= 16) warp sums are added by a butterfly across lanes: one shared-memory load per lane, a
    // fixed order, and no loop over W loads that the compiler unrolls into many registers.
    if (lane == 0) buf[warp] = s;
    __syncthreads();
    s = warp_sum(lane < W ? buf[lane] : 0.f);
  }
  const float mean0 = s * inv_d;

  // Corrected two-pass: the sum of d corrects the rounding of mean0, the sum of d^2 gives the variance.
  const int t = opaque(t0);
  float sd = 0.f, sdd = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (t + i * tpr < nvec) {
      const Pack<T> q = as_pack<T>(xp[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float d = to_float(q.v[k]) - mean0;
        sd += d;
        sdd += d * d;
      }
    }
  }
  sd = warp_sum(sd);
  sdd = warp_sum(sdd);
  if (W > 1) {
    if (lane == 0) {
      buf[W + warp] = sd;
      buf[2 * W + warp] = sdd;
    }
    __syncthreads();
    sd = warp_sum(lane < W ? buf[W + lane] : 0.f);
    sdd = warp_sum(lane < W ? buf[2 * W + lane] : 0.f);
  }
  const float corr = sd * inv_d;
  const float var = fmaxf(sdd * inv_d - corr * corr, 0.f);
  const float rstd = rsqrtf(var + p.eps);
  const float ncr = -corr * rstd;
  if (t == 0) {
    p.mean[row] = mean0 + corr;
    p.rstd[row] = rstd;
  }

  const int64_t g = group_of(row, p.group_size);
  const M* shr = static_cast<const M*>(p.shift) + g * p.shift_stride;
  const M* scr = static_cast<const M*>(p.scale) + g * p.scale_stride;
  T* yr = static_cast<T*>(p.y) + row * p.D;
  const bool affine = p.weight != nullptr;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = t + i * tpr;
    if (v < nvec) {
      float sh[VEC], sc[VEC];
      load_floats_v<M, VEC>(shr + v * VEC, sh);
      load_floats_v<M, VEC>(scr + v * VEC, sc);
      float n[VEC];
      const Pack<T> q = as_pack<T>(xp[i]);
#pragma unroll
      for (int k = 0; k < VEC; ++k) n[k] = fmaf(to_float(q.v[k]) - mean0, rstd, ncr);  // ((x - mean0) - corr) * rstd
      if (affine) {
        float w[VEC], b[VEC];
        load_floats_v<float, VEC>(p.weight + v * VEC, w);
        load_floats_v<float, VEC>(p.bias + v * VEC, b);
#pragma unroll
        for (int k = 0; k < VEC; ++k) n[k] = fmaf(n[k], w[k], b[k]);
      }
      Pack<T> out;
#pragma unroll
      for (int k = 0; k < VEC; ++k) out.v[k] = from_float<T>(fmaf(n[k], 1.f + sc[k], sh[k]));
      st_v(yr + v * VEC, *reinterpret_cast<const uint4*>(&out));
    }
  }
}

// The shared memory holds 3 * W floats (fwd_finish_row's reduction scratch).
template <typename T, typename M, int VPT, bool LOW_REGS>
__global__ void __maxnreg__(fwd_persistent_max_registers(VPT, LOW_REGS))
    ln_mod_fwd_persistent_kernel(const FwdParams p) {
  extern __shared__ float fwd_smem[];
  const int W = p.warps_per_row;  // blockDim.x == 32 * W: one row slot (the host sets rows_per_cta = 1)
  const int TPR = 32 * W;
  const int t = threadIdx.x;
  const int warp = t >> 5;
  const int lane = t & 31;
  const int nvec = p.D / Pack<T>::N;
  float* buf = fwd_smem;
  const float inv_d = 1.f / static_cast<float>(p.D);
  const T* x = static_cast<const T*>(p.x);
  const int64_t D = p.D;
  const int64_t stride = gridDim.x;
  int64_t row = blockIdx.x;

  // Two row buffers used in turn; the loop body is written out twice so that neither is ever copied.
  uint4 a[VPT], b[VPT];
  if (row < p.rows) fwd_issue_row<T, VPT>(a, x + row * D, t, TPR, nvec);
  while (row < p.rows) {
    int64_t next = row + stride;
    if (next < p.rows) fwd_issue_row<T, VPT>(b, x + next * D, opaque(t), TPR, nvec);
    fwd_finish_row<T, M, VPT>(p, a, row, t, TPR, W, warp, lane, buf, nvec, inv_d);
    row = next;
    if (row >= p.rows) break;
    next = row + stride;
    if (next < p.rows) fwd_issue_row<T, VPT>(a, x + next * D, opaque(t), TPR, nvec);
    fwd_finish_row<T, M, VPT>(p, b, row, t, TPR, W, warp, lane, buf, nvec, inv_d);
    row = next;
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward, first pass. Threads own fixed columns: thread t of a row slot owns the 16-byte vectors
// t, t + TPR, ... of every row, so the column sums over the rows a CTA visits (d_shift, d_scale,
// d_weight, d_bias) accumulate in fp32 registers with no communication. A CTA works through items: a
// contiguous chunk of rows of one modulation group (or, per token, any contiguous rows). Its row slots take
// rows_per_iter rows at a time, interleaved; the two row sums that dx needs go through a per-slot named
// barrier. At the end of an item the slots' column sums are added in shared memory in slot order and
// written as one fp32 partial row per item (or straight to d_shift/d_scale when the group has one item).
// The second pass (ln_mod_colsum_kernel) adds the partial rows of each group in order.

struct BwdParams {
  const void* dy;
  const void* x;
  const void* scale;
  const float* weight;
  const float* bias;
  const float* mean;
  const float* rstd;
  void* dx;
  void* dshift;        // final (num_groups, D) in M, written directly when chunks == 1 or per row
  void* dscale;
  float* part_shift;   // (num_items, D) fp32 partials when chunks > 1
  float* part_scale;
  float* part_weight;  // (grid, D) fp32 partials when affine
  float* part_bias;
  int64_t rows;
  int64_t group_size;
  int64_t scale_stride;
  int64_t chunks;
  int64_t rows_per_chunk;
  int64_t num_items;
  int D;
  int tpr;
  int slots;
};

// CTA size limit of the backward: 512 threads x the 96 or 128 register cap fit one SM's 64K registers.
constexpr int kBwdMaxThreads = 512;

// Shared memory of the first pass: the row-sum scratch [2 buffers][slots][2 * R][W] and, when slots > 1,
// the slot-combine area [(slots - 1)][D].
__host__ __device__ inline size_t bwd_reduce_floats(int slots, int R, int W) {
  return static_cast<size_t>(2) * slots * 2 * R * W;
}

template <int VPT, int VEC>
__device__ __forceinline__ void zero(float (&a)[VPT][VEC]) {
#pragma unroll
  for (int i = 0; i < VPT; ++i)
#pragma unroll
    for (int k = 0; k < VEC; ++k) a[i][k] = 0.f;
}

// Adds the slots' copies of `acc` in slot order; slot 0 writes the sum to dst_f (fp32) or dst_m (M).
template <typename M, int VPT, int VEC>
__device__ __forceinline__ void combine_slots(const float (&acc)[VPT][VEC], float* comb, int slots, int slot,
                                              int t, int tpr, int nvec, int D, float* dst_f, M* dst_m) {
  if (slots > 1) {
    __syncthreads();  // the previous use of `comb` is finished
    if (slot > 0) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = t + i * tpr;
        if (v < nvec) {
          float* c = comb + static_cast<size_t>(slot - 1) * D + v * VEC;
#pragma unroll
          for (int k = 0; k < VEC; k += 4)
            *reinterpret_cast<float4*>(c + k) = make_float4(acc[i][k], acc[i][k + 1], acc[i][k + 2], acc[i][k + 3]);
        }
      }
    }
    __syncthreads();
  }
  if (slot != 0) return;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int v = t + i * tpr;
    if (v < nvec) {
      float s[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) s[k] = acc[i][k];
      for (int o = 1; o < slots; ++o) {
        const float* c = comb + static_cast<size_t>(o - 1) * D + v * VEC;
#pragma unroll
        for (int k = 0; k < VEC; k += 4) {
          const float4 q = *reinterpret_cast<const float4*>(c + k);
          s[k] += q.x;
          s[k + 1] += q.y;
          s[k + 2] += q.z;
          s[k + 3] += q.w;
        }
      }
      if (dst_f != nullptr) {
        store_floats<float, VEC>(dst_f + v * VEC, s);
      } else {
        store_floats<M, VEC>(dst_m + v * VEC, s);
      }
    }
  }
}

// Register cap: 96 lets two 320-thread or three 192-thread CTAs share an SM (D = 5120 and 1536 in bf16);
// the measured cost is a few bytes of spill in the affine variants. With VPT = 4 (the largest rows) a CTA
// has up to 512 threads and the cap is the hardware's 128.
__host__ __device__ constexpr int bwd_max_registers(int vpt) { return vpt >= 4 ? 128 : 96; }

template <typename T, typename M, int VPT, int R, bool AFFINE, bool PER_ROW>
__global__ void __maxnreg__(bwd_max_registers(VPT)) ln_mod_bwd_kernel(const BwdParams p) {
  constexpr int VEC = Pack<T>::N;
  extern __shared__ float bwd_smem[];
  const int TPR = p.tpr;
  const int W = TPR >> 5;
  const int slot = threadIdx.x / TPR;
  const int t = threadIdx.x - slot * TPR;
  const int warp = t >> 5;
  const int lane = t & 31;
  const int slots = p.slots;
  const int D = p.D;
  const int nvec = D / VEC;
  const float inv_d = 1.f / static_cast<float>(D);
  float* red = bwd_smem;
  float* comb = bwd_smem + bwd_reduce_floats(slots, R, W);

  const T* dy_base = static_cast<const T*>(p.dy);
  const T* x_base = static_cast<const T*>(p.x);
  T* dx_base = static_cast<T*>(p.dx);
  const M* scale_base = static_cast<const M*>(p.scale);

  // Weight and bias are re-read from L1 where used rather than held in registers: registers bound the
  // number of resident warps, and with them the bytes in flight.
  float acc_w[VPT][VEC], acc_b[VPT][VEC];
  if (AFFINE) {
    zero(acc_w);
    zero(acc_b);
  }

  int buf = 0;
  for (int64_t item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    int64_t r0, r1, g = 0;
    if (PER_ROW) {
      r0 = item * p.rows_per_chunk;
      r1 = r0 + p.rows_per_chunk < p.rows ? r0 + p.rows_per_chunk : p.rows;
    } else {
      g = item / p.chunks;
      const int64_t c = item - g * p.chunks;
      const int64_t gend = (g + 1) * p.group_size;
      r0 = g * p.group_size + c * p.rows_per_chunk;
      r1 = r0 + p.rows_per_chunk < gend ? r0 + p.rows_per_chunk : gend;
    }

    // Per group: (1 + scale) of this item's group, constant over all its rows.
    // With 4 vectors per thread (the widest rows) registers are short: re-read it from L1 instead.
    constexpr bool kScaleInRegs = VPT <= 2;
    const M* scale_g = scale_base + g * p.scale_stride;
    float s1[VPT][VEC];
    float acc_sh[VPT][VEC], acc_sc[VPT][VEC];
    if (!PER_ROW && kScaleInRegs) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = t + i * TPR;
        if (v < nvec) {
          load_floats<M, VEC>(scale_g + v * VEC, s1[i]);
#pragma unroll
          for (int k = 0; k < VEC; ++k) s1[i][k] += 1.f;
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) s1[i][k] = 0.f;
        }
      }
    }
    if (!PER_ROW) {
      zero(acc_sh);
      zero(acc_sc);
    }

    for (int64_t base = r0 + static_cast<int64_t>(slot) * R; base < r1; base += static_cast<int64_t>(slots) * R) {
      Pack<T> xr[R][VPT], dr[R][VPT];
      float mu[R], rs[R];
      // Per token: this row's (1 + scale).
      float sr[R][VPT][VEC];  // unused (and removed by the compiler) unless PER_ROW
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = base + r;
        const bool ok = row < r1;
        mu[r] = ok ? __ldg(p.mean + row) : 0.f;
        rs[r] = ok ? __ldg(p.rstd + row) : 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int v = t + i * TPR;
          if (ok && v < nvec) {
            xr[r][i] = load_pack(x_base + row * D + v * VEC);
            dr[r][i] = load_pack(dy_base + row * D + v * VEC);
          } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              xr[r][i].v[k] = from_float<T>(0.f);
              dr[r][i].v[k] = from_float<T>(0.f);
            }
          }
          if (PER_ROW) {
            if (ok && v < nvec) {
              load_floats<M, VEC>(scale_base + row * p.scale_stride + v * VEC, sr[r][i]);
#pragma unroll
              for (int k = 0; k < VEC; ++k) sr[r][i][k] += 1.f;
            } else {
#pragma unroll
              for (int k = 0; k < VEC; ++k) sr[r][i][k] = 0.f;
            }
          }
        }
      }

      // Row sums of dxhat and dxhat * xhat; column sums; per-token d_shift / d_scale rows.
      float part[2 * R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float a = 0.f, b = 0.f;
        const int64_t row = base + r;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int v = t + i * TPR;
          float dsh[VEC], dsc[VEC];
          const int vc = v < nvec ? v : 0;  // idle lanes read a valid address; their data are zeros
          float wv[VEC], bv[VEC], sg[VEC];
          if (AFFINE) {
            load_floats<float, VEC>(p.weight + vc * VEC, wv);
            load_floats<float, VEC>(p.bias + vc * VEC, bv);
          }
          if (!PER_ROW && !kScaleInRegs) {
            load_floats<M, VEC>(scale_g + vc * VEC, sg);
#pragma unroll
            for (int k = 0; k < VEC; ++k) sg[k] += 1.f;
          }
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const float xh = (to_float(xr[r][i].v[k]) - mu[r]) * rs[r];
            const float dyv = to_float(dr[r][i].v[k]);
            const float n = AFFINE ? fmaf(xh, wv[k], bv[k]) : xh;
            const float s = PER_ROW ? sr[r][i][k] : (kScaleInRegs ? s1[i][k] : sg[k]);
            const float dn = dyv * s;
            const float dxh = AFFINE ? dn * wv[k] : dn;
            a += dxh;
            b = fmaf(dxh, xh, b);
            if (PER_ROW) {
              dsh[k] = dyv;
              dsc[k] = dyv * n;
            } else {
              acc_sh[i][k] += dyv;
              acc_sc[i][k] = fmaf(dyv, n, acc_sc[i][k]);
            }
            if (AFFINE) {
              acc_w[i][k] = fmaf(dn, xh, acc_w[i][k]);
              acc_b[i][k] += dn;
            }
          }
          if (PER_ROW && row < r1 && v < nvec) {
            store_floats<M, VEC>(static_cast<M*>(p.dshift) + row * D + v * VEC, dsh);
            store_floats<M, VEC>(static_cast<M*>(p.dscale) + row * D + v * VEC, dsc);
          }
        }
        part[2 * r] = a;
        part[2 * r + 1] = b;
      }
#pragma unroll
      for (int j = 0; j < 2 * R; ++j) part[j] = warp_sum(part[j]);
      if (W > 1) {
        float* rb = red + (static_cast<size_t>(buf) * slots + slot) * 2 * R * W;
        if (lane == 0) {
#pragma unroll
          for (int j = 0; j < 2 * R; ++j) rb[j * W + warp] = part[j];
        }
        named_barrier(slot + 1, TPR);
#pragma unroll
        for (int j = 0; j < 2 * R; ++j) {
          float s = 0.f;
          for (int w = 0; w < W; ++w) s += rb[j * W + w];
          part[j] = s;
        }
        buf ^= 1;  // double buffering: the next iteration's writes cannot race this iteration's reads
      }

#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t row = base + r;
        if (row >= r1) continue;
        const float c1 = part[2 * r] * inv_d;
        const float c2 = part[2 * r + 1] * inv_d;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int v = t + i * TPR;
          if (v < nvec) {
            Pack<T> out;
            const Pack<T> xp = launder(xr[r][i]);
            const Pack<T> dp = launder(dr[r][i]);
            float wv[VEC], sg[VEC];
            if (AFFINE) load_floats<float, VEC>(p.weight + v * VEC, wv);
            if (!PER_ROW && !kScaleInRegs) {
              load_floats<M, VEC>(scale_g + v * VEC, sg);
#pragma unroll
              for (int k = 0; k < VEC; ++k) sg[k] += 1.f;
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
              const float xh = (to_float(xp.v[k]) - mu[r]) * rs[r];
              const float s = PER_ROW ? sr[r][i][k] : (kScaleInRegs ? s1[i][k] : sg[k]);
              float dxh = to_float(dp.v[k]) * s;
              if (AFFINE) dxh *= wv[k];
              out.v[k] = from_float<T>(rs[r] * (dxh - c1 - xh * c2));
            }
            store_pack(dx_base + row * D + v * VEC, out);
          }
        }
      }
    }

    if (!PER_ROW) {
      const bool direct = p.chunks == 1;
      M* dsh = static_cast<M*>(p.dshift) + g * D;
      M* dsc = static_cast<M*>(p.dscale) + g * D;
      combine_slots<M, VPT, VEC>(acc_sh, comb, slots, slot, t, TPR, nvec, D,
                                 direct ? nullptr : p.part_shift + item * D, direct ? dsh : nullptr);
      combine_slots<M, VPT, VEC>(acc_sc, comb, slots, slot, t, TPR, nvec, D,
                                 direct ? nullptr : p.part_scale + item * D, direct ? dsc : nullptr);
    }
  }
  if (AFFINE) {
    combine_slots<float, VPT, VEC>(acc_w, comb, slots, slot, t, TPR, nvec, D,
                                   p.part_weight + static_cast<int64_t>(blockIdx.x) * D, nullptr);
    combine_slots<float, VPT, VEC>(acc_b, comb, slots, slot, t, TPR, nvec, D,
                                   p.part_bias + static_cast<int64_t>(blockIdx.x) * D, nullptr);
  }
}

// ---------------------------------------------------------------------------------------------------
// Backward, second pass: out[o, :] = sum over r < rows_per_out of src[o * rows_per_out + r, :], in order.
// Blocks of 32 columns x kColsumY row strides: coalesced 128-byte reads, then a fixed-order sum in shared
// memory.

struct ColsumJob {
  const float* src;
  void* dst;
  int64_t rows_per_out;
  int64_t num_out;
  int dst_is_mod;  // 1: dst has the modulation dtype M; 0: fp32
};

struct ColsumParams {
  ColsumJob jobs[4];
  int D;
};

constexpr int kColsumX = 32;
// 32 row strides: about 8 partial rows per thread for the ~260 partial rows of a one-sample batch, so the
// pass is a few load latencies long (it is latency-bound: 5 us at 16 strides, 3% of the D = 1536 backward).
constexpr int kColsumY = 32;

template <typename M>
__global__ void __launch_bounds__(kColsumX* kColsumY) ln_mod_colsum_kernel(const ColsumParams p) {
  __shared__ float part[kColsumY][kColsumX + 1];
  const ColsumJob job = p.jobs[blockIdx.z];
  const int64_t o = blockIdx.y;
  if (o >= job.num_out) return;  // uniform over the block
  const int col = blockIdx.x * kColsumX + threadIdx.x;
  float s = 0.f;
  if (col < p.D) {
    const float* src = job.src + o * job.rows_per_out * p.D + col;
#pragma unroll 8
    for (int64_t r = threadIdx.y; r < job.rows_per_out; r += kColsumY) s += src[r * p.D];
  }
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= p.D) return;
  float total = 0.f;
#pragma unroll
  for (int y = 0; y < kColsumY; ++y) total += part[y][threadIdx.x];
  if (job.dst_is_mod) {
    static_cast<M*>(job.dst)[o * p.D + col] = from_float<M>(total);
  } else {
    static_cast<float*>(job.dst)[o * p.D + col] = total;
  }
}

// ---------------------------------------------------------------------------------------------------
// Instantiation tables, used by the per-dtype .cu files (one per x dtype, compiled in parallel).

// Rows each thread of the backward has in flight: enough 16-byte loads per thread to cover memory latency,
// few enough registers for several CTAs per SM.
__host__ __device__ constexpr int bwd_rows_per_iter(int vpt) { return vpt == 1 ? 2 : 1; }

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kFloat32; }
template <> constexpr DType dtype_of<__half>() { return DType::kFloat16; }
template <> constexpr DType dtype_of<__nv_bfloat16>() { return DType::kBFloat16; }

constexpr int kFwdMaxVpt = 8;

// The persistent forward holds two row buffers: built for up to 4 vectors per thread (no spill beyond a
// few bytes under its register cap); wider rows per thread take the single-row kernel.
constexpr int kFwdPersistentMaxVpt = 4;

// Forward kernel kinds: the single-row kernel (version 3), the persistent one (version 4), and the
// persistent one under an 80-register cap (differs from the former at 4 vectors per thread only).
enum FwdKind : int { kFwdSingleRow = 0, kFwdPersistent = 1, kFwdPersistentLowRegs = 2 };

template <typename T, typename M, int VPT>
const void* fwd_kernel_tmv(int kind) {
  if (kind == kFwdSingleRow) return reinterpret_cast<const void*>(&ln_mod_fwd_kernel<T, M, VPT>);
  if constexpr (VPT <= kFwdPersistentMaxVpt) {
    if constexpr (VPT == 4) {
      if (kind == kFwdPersistentLowRegs) {
#ifdef ADAPTIVELOAD_BENCH_VARIANTS
        return reinterpret_cast<const void*>(&ln_mod_fwd_persistent_kernel<T, M, VPT, true>);
#else
        // A benchmark-only variant: the shipped build leaves it out (benchmarks/modulate_variants.py
        // builds it).
        return nullptr;
#endif
      }
    }
    return reinterpret_cast<const void*>(&ln_mod_fwd_persistent_kernel<T, M, VPT, false>);
  }
  return nullptr;
}

template <typename T, typename M>
const void* fwd_kernel_tm(int vpt, int kind) {
  switch (vpt) {
    case 1: return fwd_kernel_tmv<T, M, 1>(kind);
    case 2: return fwd_kernel_tmv<T, M, 2>(kind);
    case 3: return fwd_kernel_tmv<T, M, 3>(kind);
    case 4: return fwd_kernel_tmv<T, M, 4>(kind);
    case 5: return fwd_kernel_tmv<T, M, 5>(kind);
    case 6: return fwd_kernel_tmv<T, M, 6>(kind);
    case 7: return fwd_kernel_tmv<T, M, 7>(kind);
    case 8: return fwd_kernel_tmv<T, M, 8>(kind);
    default: return nullptr;
  }
}

template <typename T>
const void* fwd_kernel_for(DType mod, int vpt, int kind) {
  if (mod == dtype_of<T>()) return fwd_kernel_tm<T, T>(vpt, kind);
  if (mod == DType::kFloat32) return fwd_kernel_tm<T, float>(vpt, kind);
  return nullptr;
}

template <typename T, typename M, int VPT>
const void* bwd_kernel_tmv(bool affine, bool per_row) {
  constexpr int R = bwd_rows_per_iter(VPT);
  if (affine) {
    return per_row ? reinterpret_cast<const void*>(&ln_mod_bwd_kernel<T, M, VPT, R, true, true>)
                   : reinterpret_cast<const void*>(&ln_mod_bwd_kernel<T, M, VPT, R, true, false>);
  }
  return per_row ? reinterpret_cast<const void*>(&ln_mod_bwd_kernel<T, M, VPT, R, false, true>)
                 : reinterpret_cast<const void*>(&ln_mod_bwd_kernel<T, M, VPT, R, false, false>);
}

template <typename T, typename M>
const void* bwd_kernel_tm(int vpt, bool affine, bool per_row) {
  switch (vpt) {
    case 1: return bwd_kernel_tmv<T, M, 1>(affine, per_row);
    case 2: return bwd_kernel_tmv<T, M, 2>(affine, per_row);
    case 4: return bwd_kernel_tmv<T, M, 4>(affine, per_row);
    case 8:
      // Only fp32 rows of more than 8192 values need 8 vectors (32 columns) per thread.
      if constexpr (sizeof(T) == 4) return bwd_kernel_tmv<T, M, 8>(affine, per_row);
      return nullptr;
    default: return nullptr;
  }
}

template <typename T>
const void* bwd_kernel_for(DType mod, int vpt, bool affine, bool per_row) {
  if (mod == dtype_of<T>()) return bwd_kernel_tm<T, T>(vpt, affine, per_row);
  if (mod == DType::kFloat32) return bwd_kernel_tm<T, float>(vpt, affine, per_row);
  return nullptr;
}

// Defined in ln_modulate_{bf16,fp16,fp32}.cu.
const void* fwd_kernel_bf16(DType mod, int vpt, int kind);
const void* fwd_kernel_fp16(DType mod, int vpt, int kind);
const void* fwd_kernel_fp32(DType mod, int vpt, int kind);
const void* bwd_kernel_bf16(DType mod, int vpt, bool affine, bool per_row);
const void* bwd_kernel_fp16(DType mod, int vpt, bool affine, bool per_row);
const void* bwd_kernel_fp32(DType mod, int vpt, bool affine, bool per_row);

}  // namespace detail
}  // namespace adaptiveload
