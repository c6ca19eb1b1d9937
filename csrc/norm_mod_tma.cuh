// Kernels of the fused norm-modulate ops fed by the bulk copy engine (version 5): LayerNorm and RMSNorm,
//
//   y = norm(x) * (1 + scale) + shift,   norm = LayerNorm or RMSNorm, with an optional fp32 affine first.
//
// One thread of each CTA issues `cp.async.bulk` copies of whole rows into a ring of `stages` shared-memory
// buffers, each completing on its own mbarrier, so a CTA keeps its next rows in flight whatever its register
// count, and the threads read shared memory. Measured on an H200 (benchmarks/kernels/bench_norm_modulate_limit.py
// --sweep, docs/fused_op.md): 80-88% of a copy forward, 75-94% backward; deeper rings did not help, the rows in
// flight per SM and each row's chain of reductions and barriers bound them.
//
// Work split: the forward gives each CTA a contiguous range of rows (so a per-sample modulation row is
// loaded into registers once per group), or, for rows of up to 4 KB in long groups and per token, rows
// interleaved over the CTAs (IL); the backward gives each CTA items, a contiguous chunk of rows of one
// modulation group (or, per token, any contiguous rows; for RMSNorm and per token blocks of R rows
// interleaved with the group's other items), walked R rows per barrier, and accumulates the
// column sums (d_shift, d_scale, d_weight, d_bias) in fp32 registers over an item; one partial row per item
// (or the final row when a group has one item) is written, and ln_mod_colsum_kernel adds the partial rows in
// a fixed order. Per-token modulation rows travel in the same stage as their x row. No atomics: results are
// bitwise reproducible run to run.
//
// Numerics: fp32 statistics; LayerNorm's in one pass from sums shifted by the row's first value (see the
// forward), RMSNorm's from the sum of squares.
#pragma once

#include "ln_modulate_kernels.cuh"

namespace adaptiveload {
namespace detail {

// ---------------------------------------------------------------------------------------------------
// PTX: mbarriers and 1-D bulk copies global -> shared (sm_90). A build that also targets older GPUs
// compiles these kernels as traps there; the host takes this path on compute capability 9.0 and newer
// only (tma_supported in ln_modulate.cu).

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define ADAPTIVELOAD_TMA_ASM(...) __trap()
#else
#define ADAPTIVELOAD_TMA_ASM(...) asm volatile(__VA_ARGS__)
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  ADAPTIVELOAD_TMA_ASM("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void fence_mbar_init() {
  ADAPTIVELOAD_TMA_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// One arrival that also expects `bytes` of transactions (the bulk copies that follow complete them).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  ADAPTIVELOAD_TMA_ASM(
      "{\n\t.reg .b64 st;\n\t"
      "mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(smem_u32(bar)),
      "r"(bytes)
      : "memory");
}

__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  ADAPTIVELOAD_TMA_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    ADAPTIVELOAD_TMA_ASM(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}

// 16-byte vectors read from shared memory (plain loads; __ldg is for global memory only).
template <typename T>
__device__ __forceinline__ Pack<T> lds_pack(const T* p) {
  Pack<T> out;
  *reinterpret_cast<uint4*>(&out) = *reinterpret_cast<const uint4*>(p);
  return out;
}

template <typename M, int N>
__device__ __forceinline__ void lds_floats(const M* p, float (&out)[N]) {
  constexpr int P = Pack<M>::N;
  static_assert(N % P == 0, "vector width");
#pragma unroll
  for (int j = 0; j < N / P; ++j) {
    const Pack<M> pk = lds_pack(p + j * P);
#pragma unroll
    for (int k = 0; k < P; ++k) out[j * P + k] = to_float(pk.v[k]);
  }
}

// Sum over the CTA (W warps): every thread gets the same, order-fixed result. `buf` holds W floats; the
// caller alternates buffers so that a later write cannot race an earlier read.
__device__ __forceinline__ float cta_sum(float v, float* buf, int W, int warp, int lane) {
  v = warp_sum(v);
  if (W == 1) {
    __syncwarp();
    return v;
  }
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  return warp_sum(lane < W ? buf[lane] : 0.f);
}

__device__ __forceinline__ void cta_sum2(float& a, float& b, float* buf, int W, int warp, int lane) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (W == 1) {
    __syncwarp();
    return;
  }
  if (lane == 0) {
    buf[warp] = a;
    buf[W + warp] = b;
  }
  __syncthreads();
  a = warp_sum(lane < W ? buf[lane] : 0.f);
  b = warp_sum(lane < W ? buf[W + lane] : 0.f);
}

// Sums each of N values over the CTA (W warps, N * W <= kTmaRedHalf); see cta_sum.
template <int N>
__device__ __forceinline__ void cta_sum_n(float (&v)[N], float* buf, int W, int warp, int lane) {
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = warp_sum(v[j]);
  if (W == 1) {
    __syncwarp();
    return;
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) buf[j * W + warp] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = warp_sum(lane < W ? buf[j * W + lane] : 0.f);
}

// Threads per CTA of the forward at most (its register cap is then 128).
constexpr int kTmaMaxThreads = 512;
// Floats of reduction scratch after the mbarriers: [2 buffers][8 values][32 warps].
constexpr int kTmaRedFloats = 2 * 8 * 32;
constexpr int kTmaRedHalf = kTmaRedFloats / 2;

// Dynamic shared memory after the stages: one mbarrier per stage, the reduction scratch, and the
// backward's producer state (4 int64).
__host__ __device__ constexpr size_t tma_extra_smem(int stages) {
  return static_cast<size_t>(stages) * 8 + sizeof(float) * kTmaRedFloats + 4 * sizeof(int64_t);
}

// ---------------------------------------------------------------------------------------------------
// Forward.

struct TmaFwdParams {
  const void* x;
  const void* shift;
  const void* scale;
  const float* weight;  // (D,) fp32 or null
  const float* bias;    // (D,) fp32 or null (with weight)
  void* y;
  float* mean;  // (rows,), LayerNorm only
  float* rstd;  // (rows,)
  int64_t rows;
  int64_t group_size;
  int64_t shift_stride;
  int64_t scale_stride;
  int64_t rows_per_cta;  // contiguous mapping: rows per CTA
  int D;
  int stages;
  uint32_t stage_bytes;  // x row, and with PER_ROW its shift and scale rows
  float eps;
};

// Thread 0: issues the copies of row r0 + ki (and, with PER_ROW, its modulation rows) into stage ki % S.
// A function, not a lambda: a lambda capturing the kernel parameters by reference makes ptxas copy them to
// the stack.
template <typename T, typename M, bool PER_ROW>
__device__ __forceinline__ void fwd_issue(const TmaFwdParams& p, unsigned char* smem, uint64_t* bars, int64_t r0,
                                          int64_t ki, int64_t step) {
  const int s = static_cast<int>(ki % p.stages);
  unsigned char* st = smem + static_cast<size_t>(s) * p.stage_bytes;
  const int64_t row = r0 + ki * step;
  const uint32_t xbytes = static_cast<uint32_t>(p.D) * sizeof(T);
  const uint32_t mbytes = static_cast<uint32_t>(p.D) * sizeof(M);
  mbar_arrive_expect_tx(bars + s, p.stage_bytes);
  bulk_g2s(st, static_cast<const T*>(p.x) + row * p.D, xbytes, bars + s);
  if (PER_ROW) {
    bulk_g2s(st + xbytes, static_cast<const M*>(p.shift) + row * p.shift_stride, mbytes, bars + s);
    bulk_g2s(st + xbytes + mbytes, static_cast<const M*>(p.scale) + row * p.scale_stride, mbytes, bars + s);
  }
}

// PER_ROW: per-token modulation, whose rows travel in the stage with x's (then a stage is released one row
// later, after its modulation was read). Otherwise modulation rows are read through L1.
// IL: the row mapping. false: CTA b takes the contiguous rows [b * rows_per_cta, ...). true: interleaved,
// CTA b takes rows b, b + gridDim.x, ..., so that the CTAs read one contiguous front of memory at a time,
// as a copy does. A template parameter, not a flag: the run-time choice cost the contiguous kernel at 4
// vectors per thread 32 bytes more of spill under its 128-register cap, and 4-7% at D = 3072 and 5120.
// MOD_L1: read a per-sample / per-frame modulation row through L1 at every row instead of holding it in
// registers (fewer registers, so more CTAs per SM). FMA_NORM: for 16-bit x, the LayerNorm normalisation as
// one fused multiply-add, x * rstd - mean * rstd (see below). nm_fwd_tma_kernel is the library's kernel; the
// body is shared with benchmarks/kernels/norm_mod_mapping.cu, which builds it under other register caps.
template <typename T, typename M, int VPT, bool RMS, bool PER_ROW, bool IL, bool MOD_L1 = false,
          bool FMA_NORM = false>
__device__ __forceinline__ void nm_fwd_tma_body(const TmaFwdParams& p) {
  constexpr int VEC = Pack<T>::N;
  constexpr int LAG = PER_ROW ? 1 : 0;
  extern __shared__ __align__(128) unsigned char nm_smem[];
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int W = nthr >> 5;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int D = p.D;
  const int nvec = D / VEC;
  const int S = p.stages;
  // Row k of this CTA is r0 + k * step (see IL).
  const int64_t step = IL ? static_cast<int64_t>(gridDim.x) : 1;
  const int64_t r0 = IL ? static_cast<int64_t>(blockIdx.x) : static_cast<int64_t>(blockIdx.x) * p.rows_per_cta;
  if (r0 >= p.rows) return;  // uniform over the CTA
  const int64_t n = IL ? (p.rows - r0 + step - 1) / step
                       : (p.rows - r0 < p.rows_per_cta ? p.rows - r0 : p.rows_per_cta);
  uint64_t* bars = reinterpret_cast<uint64_t*>(nm_smem + static_cast<size_t>(S) * p.stage_bytes);
  float* red = reinterpret_cast<float*>(bars + S);
  const uint32_t xbytes = static_cast<uint32_t>(D) * sizeof(T);
  const uint32_t mbytes = static_cast<uint32_t>(D) * sizeof(M);
  const M* shg = static_cast<const M*>(p.shift);
  const M* scg = static_cast<const M*>(p.scale);
  constexpr bool kFmaNorm = FMA_NORM && !RMS && sizeof(T) == 2;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bars + s, 1);
    fence_mbar_init();
  }
  __syncthreads();

  // Thread 0 issues row ki into stage ki % S; `issued` counts the rows issued so far.
  int64_t issued = 0;
  if (tid == 0) {
    for (; issued < n && issued < S; ++issued) fwd_issue<T, M, PER_ROW>(p, nm_smem, bars, r0, issued, step);
  }

  const float inv_d = 1.f / static_cast<float>(D);
  const bool affine = p.weight != nullptr;
  // Per sample or per frame with at most 4 vectors per thread: shift and 1 + scale of the current group in
  // registers, reloaded when the group changes (a CTA's rows are contiguous, so rarely). Measured on an
  // H200 (--sweep, 2026-12-02): 3-4 vectors with the modulation in registers beat 5-8 (one warp per row)
  // reading it through L1 by 5-10%. Wider rows per thread read the group's rows through L1.
  constexpr bool kModRegs = !PER_ROW && VPT <= 4 && !MOD_L1;
  float msh[kModRegs ? VPT : 1][VEC], msc[kModRegs ? VPT : 1][VEC];
  int64_t cur_g = -1;
  const M* gsh = shg;
  const M* gsc = scg;
  int s = 0;
  uint32_t phase = 0;
  for (int64_t k = 0; k < n; ++k) {
    mbar_wait(bars + s, phase);
    const unsigned char* st = nm_smem + static_cast<size_t>(s) * p.stage_bytes;
    const T* xs = reinterpret_cast<const T*>(st);
    Pack<T> xp[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = tid + i * nthr;
      if (v < nvec) {
        xp[i] = lds_pack(xs + v * VEC);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) xp[i].v[e] = from_float<T>(0.f);
      }
    }
    // One reduction per row. RMSNorm: the sum of x^2. LayerNorm: the sums of d and d^2 with d = x - K,
    // K the row's first value (a broadcast read of the stage): shifted sums keep fp32 accuracy for rows
    // far from zero (|x| ~ 1e4 with unit spread) as the two-pass algorithm does, in one pass and one
    // reduction (the variance's rounding grows with ((K - mean) / std)^2, which a value of the row keeps
    // small: at most D for a row of one spike).
    const float K = RMS ? 0.f : to_float(xs[0]);
    float sums[RMS ? 1 : 2];
    {
      float pa = 0.f, pb = 0.f, qa = 0.f, qb = 0.f;  // two independent chains per sum
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        if (RMS || tid + i * nthr < nvec) {  // zeros past the row end add nothing to sum(x^2)
#pragma unroll
          for (int e = 0; e < VEC; e += 2) {
            const float d0 = to_float(xp[i].v[e]) - K;
            const float d1 = to_float(xp[i].v[e + 1]) - K;
            if (RMS) {
              pa = fmaf(d0, d0, pa);
              pb = fmaf(d1, d1, pb);
            } else {
              pa += d0;
              pb += d1;
              qa = fmaf(d0, d0, qa);
              qb = fmaf(d1, d1, qb);
            }
          }
        }
      }
      sums[0] = pa + pb;
      if (!RMS) sums[RMS ? 0 : 1] = qa + qb;
    }
    float* rb = red + (k & 1) * kTmaRedHalf;
    cta_sum_n<RMS ? 1 : 2>(sums, rb, W, warp, lane);
    // Every thread has its part of row k in registers (and, with LAG 1, is done with row k - 1): the
    // freed stage takes the next row.
    if (tid == 0) {
      for (; issued < n && issued <= k - LAG + S; ++issued) fwd_issue<T, M, PER_ROW>(p, nm_smem, bars, r0, issued, step);
    }
    float mean0, corr, rstd, ncr;
    if (RMS) {
      mean0 = corr = ncr = 0.f;
      rstd = rsqrtf(sums[0] * inv_d + p.eps);
    } else {
      mean0 = K;
      corr = sums[0] * inv_d;  // mean = K + corr
      const float var = fmaxf(sums[RMS ? 0 : 1] * inv_d - corr * corr, 0.f);
      rstd = rsqrtf(var + p.eps);
      // FMA_NORM (16-bit x only): -(K + corr) * rstd, so that x * rstd + ncr is the normalised value. The
      // rounding of x * rstd is 2^-24 |x| / std, far below the output's bf16/fp16 precision for any row a
      // 16-bit type can hold; fp32 rows keep the subtraction of K first.
      ncr = kFmaNorm ? -(K + corr) * rstd : -corr * rstd;
    }
    const int64_t row = r0 + k * step;
    if (tid == 0) {
      if (!RMS) p.mean[row] = mean0 + corr;
      p.rstd[row] = rstd;
    }
    const M* shr = reinterpret_cast<const M*>(st + xbytes);  // PER_ROW: this row's modulation, in the stage
    const M* scr = reinterpret_cast<const M*>(st + xbytes + mbytes);
    if (!PER_ROW) {
      const int64_t g = group_of(row, p.group_size);
      if (g != cur_g) {  // uniform over the CTA
        cur_g = g;
        gsh = shg + g * p.shift_stride;
        gsc = scg + g * p.scale_stride;
        if (kModRegs) {
#pragma unroll
          for (int i = 0; i < (kModRegs ? VPT : 0); ++i) {
            const int vc = tid + i * nthr < nvec ? tid + i * nthr : 0;
            load_floats<M, VEC>(gsh + vc * VEC, msh[i]);
            load_floats<M, VEC>(gsc + vc * VEC, msc[i]);
#pragma unroll
            for (int e = 0; e < VEC; ++e) msc[i][e] += 1.f;
          }
        }
      }
    }
    T* yr = static_cast<T*>(p.y) + row * D;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = tid + i * nthr;
      if (v < nvec) {
        float sh[VEC], sc[VEC];
        if (PER_ROW) {
          lds_floats<M, VEC>(shr + v * VEC, sh);
          lds_floats<M, VEC>(scr + v * VEC, sc);
#pragma unroll
          for (int e = 0; e < VEC; ++e) sc[e] += 1.f;
        } else if (kModRegs) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            sh[e] = msh[kModRegs ? i : 0][e];
            sc[e] = msc[kModRegs ? i : 0][e];
          }
        } else {
          load_floats<M, VEC>(gsh + v * VEC, sh);
          load_floats<M, VEC>(gsc + v * VEC, sc);
#pragma unroll
          for (int e = 0; e < VEC; ++e) sc[e] += 1.f;
        }
        float nv[VEC];
        const Pack<T> q = launder(xp[i]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float f = to_float(q.v[e]);
          // LayerNorm: (f - K - corr) * rstd as one subtraction and one fused multiply-add (K exact, a value
          // of the row, so f - K keeps the precision of the shifted sums; corr * rstd is O(1)).
          nv[e] = RMS ? f * rstd : kFmaNorm ? fmaf(f, rstd, ncr) : fmaf(f - mean0, rstd, ncr);
        }
        if (affine) {
          float w[VEC], b[VEC];
          load_floats<float, VEC>(p.weight + v * VEC, w);
          load_floats<float, VEC>(p.bias + v * VEC, b);
#pragma unroll
          for (int e = 0; e < VEC; ++e) nv[e] = fmaf(nv[e], w[e], b[e]);
        }
        Pack<T> out;
#pragma unroll
        for (int e = 0; e < VEC; ++e) out.v[e] = from_float<T>(fmaf(nv[e], sc[e], sh[e]));
        store_pack(yr + v * VEC, out);
      }
    }
    if (++s == S) {
      s = 0;
      phase ^= 1u;
    }
  }
}

template <typename T, typename M, int VPT, bool RMS, bool PER_ROW, bool IL>
__global__ void __launch_bounds__(kTmaMaxThreads) nm_fwd_tma_kernel(const TmaFwdParams p) {
  nm_fwd_tma_body<T, M, VPT, RMS, PER_ROW, IL>(p);
}

// ---------------------------------------------------------------------------------------------------
// Backward.

struct TmaBwdParams {
  const void* dy;
  const void* x;
  const void* scale;
  const float* weight;
  const float* bias;
  const float* mean;  // LayerNorm only
  const float* rstd;
  void* dx;
  void* dshift;  // (num_groups, D) in M when chunks == 1, or (rows, D) per token
  void* dscale;
  float* part_shift;  // (num_items, D) fp32 partials when chunks > 1
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
  int stages;
  uint32_t stage_bytes;  // x row, dy row, and with PER_ROW the scale row
};

// The backward's row mapping, IL (fixed per kernel: tma_bwd_interleaved). false: an item is rows_per_chunk
// contiguous rows, walked R at a time. true: interleaved, item c of a group (of all rows, per token) takes
// the blocks of R rows c, c + chunks, ... (per token c, c + num_items, ...), so that the CTAs read one
// contiguous front of memory at a time. Measured on an H200 (benchmarks/kernels/norm_mod_mapping.cu,
// 2026-12-03): interleaved, the RMSNorm backward was 2-4% faster at D = 1152 to 5120 and both norms per
// token 3%; the LayerNorm backward per sample the same at D <= 1536 and 7-11% slower at D = 3072 and 5120.
__host__ __device__ constexpr bool tma_bwd_interleaved(bool rms, bool per_row) { return rms || per_row; }

// Rows [r0, r1) of work item `item`.
template <bool PER_ROW, bool IL>
__device__ __forceinline__ void tma_item_rows(const TmaBwdParams& p, int64_t item, int64_t& r0, int64_t& r1, int R) {
  if (IL) {
    if (PER_ROW) {
      r0 = item * R;
      r1 = p.rows;
    } else {
      const int64_t g = item / p.chunks;
      const int64_t c = item - g * p.chunks;
      r0 = g * p.group_size + c * R;
      r1 = (g + 1) * p.group_size;
    }
    return;
  }
  if (PER_ROW) {
    r0 = item * p.rows_per_chunk;
    r1 = r0 + p.rows_per_chunk < p.rows ? r0 + p.rows_per_chunk : p.rows;
  } else {
    const int64_t g = item / p.chunks;
    const int64_t c = item - g * p.chunks;
    const int64_t gend = (g + 1) * p.group_size;
    r0 = g * p.group_size + c * p.rows_per_chunk;
    r1 = r0 + p.rows_per_chunk < gend ? r0 + p.rows_per_chunk : gend;
  }
}

// The rows a CTA visits, in order: its items blockIdx.x, blockIdx.x + gridDim.x, ..., each item's rows,
// R at a time (fewer at an item's end).
struct TmaCursor {
  int64_t item;
  int64_t row;
  int64_t end;
};

// Rows from one block of an item to its next: R, or with interleave R times the items sharing the rows.
template <bool PER_ROW, bool IL>
__device__ __forceinline__ int64_t tma_block_step(const TmaBwdParams& p, int R) {
  if (!IL) return R;
  return static_cast<int64_t>(R) * (PER_ROW ? p.num_items : p.chunks);
}

template <bool PER_ROW, bool IL>
__device__ __forceinline__ TmaCursor tma_first(const TmaBwdParams& p, int R) {
  TmaCursor c;
  c.item = blockIdx.x;
  c.row = c.end = 0;
  if (c.item < p.num_items) tma_item_rows<PER_ROW, IL>(p, c.item, c.row, c.end, R);
  while (c.item < p.num_items && c.row >= c.end) {  // an item with no rows (the host plans none)
    c.item += gridDim.x;
    if (c.item < p.num_items) tma_item_rows<PER_ROW, IL>(p, c.item, c.row, c.end, R);
  }
  return c;
}

template <bool PER_ROW, bool IL>
__device__ __forceinline__ void tma_next(const TmaBwdParams& p, TmaCursor& c, int R) {
  c.row += tma_block_step<PER_ROW, IL>(p, R);
  while (c.row >= c.end) {  // an item may have no rows (more items than blocks): skip it
    c.item += gridDim.x;
    if (c.item >= p.num_items) return;
    tma_item_rows<PER_ROW, IL>(p, c.item, c.row, c.end, R);
  }
}

// Thread 0: issues row blocks (R rows of x, of dy and with PER_ROW of scale; fewer at an item's end) in the
// CTA's order while fewer than `limit` + 1 blocks were issued; `prod` holds the producer's cursor and count.
// A function, not a lambda: a lambda capturing the kernel parameters by reference makes ptxas copy them to
// the stack.
template <typename T, typename M, bool PER_ROW, int R, bool IL>
__device__ __forceinline__ void bwd_issue_ahead(const TmaBwdParams& p, int64_t* prod, unsigned char* smem,
                                                uint64_t* bars, int64_t limit) {
  TmaCursor pc{prod[0], prod[1], prod[2]};
  int64_t issued = prod[3];
  const uint32_t xbytes = static_cast<uint32_t>(p.D) * sizeof(T);
  const uint32_t mbytes = static_cast<uint32_t>(p.D) * sizeof(M);
  while (pc.item < p.num_items && issued <= limit) {
    const int s = static_cast<int>(issued % p.stages);
    unsigned char* st = smem + static_cast<size_t>(s) * p.stage_bytes;
    const int r = static_cast<int>(pc.end - pc.row < R ? pc.end - pc.row : R);
    mbar_arrive_expect_tx(bars + s, static_cast<uint32_t>(r) * (2 * xbytes + (PER_ROW ? mbytes : 0)));
    bulk_g2s(st, static_cast<const T*>(p.x) + pc.row * p.D, r * xbytes, bars + s);
    bulk_g2s(st + R * xbytes, static_cast<const T*>(p.dy) + pc.row * p.D, r * xbytes, bars + s);
    if (PER_ROW) {
      for (int j = 0; j < r; ++j) {
        bulk_g2s(st + 2 * R * xbytes + j * mbytes, static_cast<const M*>(p.scale) + (pc.row + j) * p.scale_stride,
                 mbytes, bars + s);
      }
    }
    ++issued;
    tma_next<PER_ROW, IL>(p, pc, R);
  }
  prod[0] = pc.item;
  prod[1] = pc.row;
  prod[2] = pc.end;
  prod[3] = issued;
}

// Register cap of the backward: 96 up to 2 vectors per thread, so that two 320-thread CTAs (D = 5120 in
// bf16) share an SM; 128 (the hardware's for 512 threads) for wider rows per thread.
__host__ __device__ constexpr int tma_bwd_max_registers(int vpt) { return vpt <= 2 ? 96 : 128; }
// Threads per CTA the backward takes at most: what its register cap leaves room for in one SM (640 x 96 of
// 65536 registers: one vector per thread up to D = 5120 in bf16).
__host__ __device__ constexpr int tma_bwd_max_threads(int vpt) { return vpt <= 2 ? 640 : 512; }
// One vector per thread, 1 or 2 rows per iteration, is also built under caps of 112 and 128 registers: the
// host takes the highest cap that keeps as many CTAs per SM as 96 gives (the occupancy API decides: D = 3072
// in bf16, 384 threads, has 1 CTA per SM at 96 or 128 and takes 128; D = 1536 and 5120 keep 96), so that
// the kernel keeps its values in registers. At 96 the LayerNorm backward spilled 48 bytes per thread at 2
// rows per iteration (RMSNorm 24); at 112 and 128 neither spills. Measured on an H200 at 1 x 32,760 x 3,072
// (benchmarks/kernels/norm_mod_mapping.cu, 2026-12-03): LayerNorm 0.220 -> 0.193 ms, RMSNorm 0.183 -> 0.179.
__host__ __device__ constexpr bool tma_bwd_has_cap(int vpt, int rows, int regs) {
  return regs == tma_bwd_max_registers(vpt) || (vpt == 1 && rows <= 2 && (regs == 112 || regs == 128));
}

// R: rows per iteration. A CTA owns all columns of its rows (fp32 column sums in registers), so it cannot
// split a row between independent warps; R rows side by side give it R rows in flight per barrier instead.
// FAST (OPT bit 0; 16-bit x only; fp32 x keeps the subtraction of the mean first): xhat = x * rstd - mean * rstd as one
// fused multiply-add, and dx = rstd * dxhat + A * x + B with A = -rstd^2 * c2 and B = -rstd * (c1 + c2 *
// (-mean * rstd)) per row, so that the second pass computes no xhat: fewer instructions per element and
// fewer values live across the row's barrier. The extra rounding is 2^-24 |mean| / std relative, far below
// the bf16/fp16 output's precision for any row such a type can hold.
// OPT: bit 0 FAST; bit 1 the group's (1 + scale) read through L1 in both passes instead of held in registers;
// bit 2 the next block's copies issued after the second pass (kLateIssue).
template <typename T, typename M, int VPT, bool RMS, bool AFFINE, bool PER_ROW, int R, int REGS, int OPT = 0>
__global__ void __maxnreg__(REGS) nm_bwd_tma_kernel(const TmaBwdParams p) {
  constexpr int VEC = Pack<T>::N;
  constexpr bool kFast = (OPT & 1) && sizeof(T) == 2;
  constexpr bool kLateIssue = (OPT & 4) != 0;
  constexpr int LAG = PER_ROW ? 1 : 0;
  constexpr bool IL = tma_bwd_interleaved(RMS, PER_ROW);
  // (1 + scale) of the item's group in registers where registers allow (one vector per thread); otherwise
  // re-read through L1, where the group's row stays.
  constexpr bool kScaleInRegs = !PER_ROW && !AFFINE && VPT == 1 && !(OPT & 2);
  extern __shared__ __align__(128) unsigned char nm_smem[];
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int W = nthr >> 5;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int D = p.D;
  const int nvec = D / VEC;
  const int S = p.stages;
  const float inv_d = 1.f / static_cast<float>(D);
  if (static_cast<int64_t>(blockIdx.x) >= p.num_items) return;  // uniform
  uint64_t* bars = reinterpret_cast<uint64_t*>(nm_smem + static_cast<size_t>(S) * p.stage_bytes);
  float* red = reinterpret_cast<float*>(bars + S);
  const uint32_t xbytes = static_cast<uint32_t>(D) * sizeof(T);
  const uint32_t mbytes = static_cast<uint32_t>(D) * sizeof(M);
  const M* scg = static_cast<const M*>(p.scale);

  if (tid == 0) {
    for (int s = 0; s < S; ++s) mbar_init(bars + s, 1);
    fence_mbar_init();
  }
  __syncthreads();

  // Producer state, in shared memory (only thread 0 reads it): the next rows to issue (their item, row and
  // the item's end) and how many blocks were issued. Registers are what bounds the CTAs per SM here.
  int64_t* prod = reinterpret_cast<int64_t*>(red + kTmaRedFloats);
  if (tid == 0) {
    const TmaCursor first = tma_first<PER_ROW, IL>(p, R);
    prod[0] = first.item;
    prod[1] = first.row;
    prod[2] = first.end;
    prod[3] = 0;
    bwd_issue_ahead<T, M, PER_ROW, R, IL>(p, prod, nm_smem, bars, S - 1);
  }

  float acc_sh[VPT][VEC], acc_sc[VPT][VEC], acc_w[VPT][VEC], acc_b[VPT][VEC];
  if (AFFINE) {
    zero(acc_w);
    zero(acc_b);
  }
  float s1[VPT][VEC];  // kScaleInRegs: 1 + scale of the item's group

  int64_t k = 0;  // row blocks consumed so far
  int s = 0;
  uint32_t phase = 0;
  for (int64_t item = blockIdx.x; item < p.num_items; item += gridDim.x) {
    int64_t r0, r1;
    tma_item_rows<PER_ROW, IL>(p, item, r0, r1, R);
    const int64_t bstep = tma_block_step<PER_ROW, IL>(p, R);
    const int64_t g = PER_ROW ? 0 : item / p.chunks;
    const M* sgr = scg + g * p.scale_stride;  // !PER_ROW: the group's scale row
    if (!PER_ROW) {
      zero(acc_sh);
      zero(acc_sc);
    }
    if (kScaleInRegs) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int vc = tid + i * nthr < nvec ? tid + i * nthr : 0;
        load_floats<M, VEC>(sgr + vc * VEC, s1[i]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) s1[i][e] += 1.f;
      }
    }
    // The statistics of the next block, in flight while this one is worked on.
    float mu_n[R], rs_n[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const bool ok = r0 + j < r1;
      rs_n[j] = ok ? __ldg(p.rstd + r0 + j) : 0.f;
      mu_n[j] = ok && !RMS ? __ldg(p.mean + r0 + j) : 0.f;
    }
    for (int64_t row0 = r0; row0 < r1; row0 += bstep, ++k) {
      const int r = static_cast<int>(r1 - row0 < R ? r1 - row0 : R);
      float mu[R], rs[R];
#pragma unroll
      for (int j = 0; j < R; ++j) {
        mu[j] = mu_n[j];
        rs[j] = rs_n[j];
        const int64_t nxt = row0 + bstep + j;
        const bool ok = nxt < r1;
        if (ok) {
          rs_n[j] = __ldg(p.rstd + nxt);
          if (!RMS) mu_n[j] = __ldg(p.mean + nxt);
        }
      }
      float nmr[R];  // kFast: -mean * rstd
#pragma unroll
      for (int j = 0; j < R; ++j) nmr[j] = RMS ? 0.f : -mu[j] * rs[j];
      mbar_wait(bars + s, phase);
      const unsigned char* st = nm_smem + static_cast<size_t>(s) * p.stage_bytes;
      Pack<T> xr[R][VPT], dr[R][VPT];
#pragma unroll
      for (int j = 0; j < R; ++j) {
        const T* xs = reinterpret_cast<const T*>(st + j * xbytes);
        const T* ds = reinterpret_cast<const T*>(st + (R + j) * xbytes);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int v = tid + i * nthr;
          if (j < r && v < nvec) {
            xr[j][i] = lds_pack(xs + v * VEC);
            dr[j][i] = lds_pack(ds + v * VEC);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              xr[j][i].v[e] = from_float<T>(0.f);
              dr[j][i].v[e] = from_float<T>(0.f);
            }
          }
        }
      }

      // First pass: the row sums of dxhat and dxhat * xhat, the column sums, per-token d_shift / d_scale.
      // Rows past the block's end have zero data, so they add nothing.
      float sums[2 * R];
#pragma unroll
      for (int j = 0; j < 2 * R; ++j) sums[j] = 0.f;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = tid + i * nthr;
        const int vc = v < nvec ? v : 0;  // idle lanes read a valid address; their data are zeros
        float wv[VEC], bv[VEC], sg[VEC];
        if (AFFINE) {
          load_floats<float, VEC>(p.weight + vc * VEC, wv);
          load_floats<float, VEC>(p.bias + vc * VEC, bv);
        }
        if (!PER_ROW && !kScaleInRegs) load_floats<M, VEC>(sgr + vc * VEC, sg);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          // Rows past the block's end have no modulation row in the stage: its bytes are whatever an earlier
          // block left there (or never written), and 0 * NaN would poison the column sums of the affine.
          if (PER_ROW) {
            if (j < r) {
              lds_floats<M, VEC>(reinterpret_cast<const M*>(st + 2 * R * xbytes + j * mbytes) + vc * VEC, sg);
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) sg[e] = 0.f;
            }
          }
          float dsh[VEC], dsc[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const float xf = to_float(xr[j][i].v[e]);
            const float xh = RMS ? xf * rs[j] : kFast ? fmaf(xf, rs[j], nmr[j]) : (xf - mu[j]) * rs[j];
            const float dyv = to_float(dr[j][i].v[e]);
            const float nrm = AFFINE ? fmaf(xh, wv[e], bv[e]) : xh;
            const float sv = kScaleInRegs ? s1[i][e] : sg[e] + 1.f;
            const float dn = dyv * sv;
            const float dxh = AFFINE ? dn * wv[e] : dn;
            sums[2 * j] += dxh;
            sums[2 * j + 1] = fmaf(dxh, xh, sums[2 * j + 1]);
            if (PER_ROW) {
              dsh[e] = dyv;
              dsc[e] = dyv * nrm;
            } else {
              acc_sh[i][e] += dyv;
              acc_sc[i][e] = fmaf(dyv, nrm, acc_sc[i][e]);
            }
            if (AFFINE) {
              acc_w[i][e] = fmaf(dn, xh, acc_w[i][e]);
              acc_b[i][e] += dn;
            }
          }
          if (PER_ROW && j < r && v < nvec) {
            store_floats<M, VEC>(static_cast<M*>(p.dshift) + (row0 + j) * D + v * VEC, dsh);
            store_floats<M, VEC>(static_cast<M*>(p.dscale) + (row0 + j) * D + v * VEC, dsc);
          }
        }
      }
      cta_sum_n<2 * R>(sums, red + (k & 1) * kTmaRedHalf, W, warp, lane);
      // Block k is in registers (with LAG 1, block k - 1 is finished): its stage takes the next block.
      // kLateIssue: after the second pass instead, where fewer values are live (the producer's state then
      // needs no registers of its own).
      if (!kLateIssue && tid == 0) bwd_issue_ahead<T, M, PER_ROW, R, IL>(p, prod, nm_smem, bars, k - LAG + S);

      // Second pass: dx.
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = tid + i * nthr;
        if (v < nvec) {
          float wv[VEC], sg[VEC];
          if (AFFINE) load_floats<float, VEC>(p.weight + v * VEC, wv);
          if (!PER_ROW && !kScaleInRegs) load_floats<M, VEC>(sgr + v * VEC, sg);
#pragma unroll
          for (int j = 0; j < R; ++j) {
            if (j < r) {
              if (PER_ROW) lds_floats<M, VEC>(reinterpret_cast<const M*>(st + 2 * R * xbytes + j * mbytes) + v * VEC, sg);
              const float c1 = RMS ? 0.f : sums[2 * j] * inv_d;
              const float c2 = sums[2 * j + 1] * inv_d;
              const float ca = -rs[j] * rs[j] * c2;                  // kFast: A
              const float cb = -rs[j] * fmaf(c2, nmr[j], c1);        // kFast: B
              Pack<T> out;
              const Pack<T> xq = launder(xr[j][i]);
              const Pack<T> dq = launder(dr[j][i]);
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                const float xf = to_float(xq.v[e]);
                const float sv = kScaleInRegs ? s1[i][e] : sg[e] + 1.f;
                float dxh = to_float(dq.v[e]) * sv;
                if (AFFINE) dxh *= wv[e];
                if (kFast) {
                  out.v[e] = from_float<T>(fmaf(rs[j], dxh, RMS ? ca * xf : fmaf(ca, xf, cb)));
                } else {
                  const float xh = RMS ? xf * rs[j] : (xf - mu[j]) * rs[j];
                  out.v[e] = from_float<T>(rs[j] * (dxh - c1 - xh * c2));
                }
              }
              store_pack(static_cast<T*>(p.dx) + (row0 + j) * D + v * VEC, out);
            }
          }
        }
      }
      if (kLateIssue && tid == 0) bwd_issue_ahead<T, M, PER_ROW, R, IL>(p, prod, nm_smem, bars, k - LAG + S);
      if (++s == S) {
        s = 0;
        phase ^= 1u;
      }
    }

    // End of the item: its column sums of d_shift and d_scale go out (final rows or fp32 partials).
    if (!PER_ROW) {
      const bool direct = p.chunks == 1;
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int v = tid + i * nthr;
        if (v < nvec) {
          if (direct) {
            store_floats<M, VEC>(static_cast<M*>(p.dshift) + g * D + v * VEC, acc_sh[i]);
            store_floats<M, VEC>(static_cast<M*>(p.dscale) + g * D + v * VEC, acc_sc[i]);
          } else {
            store_floats<float, VEC>(p.part_shift + item * D + v * VEC, acc_sh[i]);
            store_floats<float, VEC>(p.part_scale + item * D + v * VEC, acc_sc[i]);
          }
        }
      }
    }
  }
  if (AFFINE) {
    float* pw = p.part_weight + static_cast<int64_t>(blockIdx.x) * D;
    float* pb = p.part_bias + static_cast<int64_t>(blockIdx.x) * D;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int v = tid + i * nthr;
      if (v < nvec) {
        store_floats<float, VEC>(pw + v * VEC, acc_w[i]);
        store_floats<float, VEC>(pb + v * VEC, acc_b[i]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Instantiation tables (norm_mod_tma_<dtype>_<norm>.cu instantiate them for one x dtype and norm each, so
// that ninja compiles them in parallel).

// The interleaved forward is built up to 4 vectors per thread (the host interleaves rows of up to 4 KB).
__host__ __device__ constexpr bool tma_fwd_has_interleaved(int vpt) { return vpt <= 4; }

template <typename T, typename M, bool RMS, int VPT>
const void* tma_fwd_tmv(bool per_row, bool interleave) {
  if (interleave) {
    if constexpr (tma_fwd_has_interleaved(VPT)) {
      return per_row ? reinterpret_cast<const void*>(&nm_fwd_tma_kernel<T, M, VPT, RMS, true, true>)
                     : reinterpret_cast<const void*>(&nm_fwd_tma_kernel<T, M, VPT, RMS, false, true>);
    }
    return nullptr;
  }
  return per_row ? reinterpret_cast<const void*>(&nm_fwd_tma_kernel<T, M, VPT, RMS, true, false>)
                 : reinterpret_cast<const void*>(&nm_fwd_tma_kernel<T, M, VPT, RMS, false, false>);
}

template <typename T, typename M, bool RMS>
const void* tma_fwd_tm(int vpt, bool per_row, bool interleave) {
  switch (vpt) {
    case 1: return tma_fwd_tmv<T, M, RMS, 1>(per_row, interleave);
    case 2: return tma_fwd_tmv<T, M, RMS, 2>(per_row, interleave);
    case 3: return tma_fwd_tmv<T, M, RMS, 3>(per_row, interleave);
    case 4: return tma_fwd_tmv<T, M, RMS, 4>(per_row, interleave);
    case 5: return tma_fwd_tmv<T, M, RMS, 5>(per_row, interleave);
    case 6: return tma_fwd_tmv<T, M, RMS, 6>(per_row, interleave);
    case 8: return tma_fwd_tmv<T, M, RMS, 8>(per_row, interleave);
    default: return nullptr;
  }
}

template <typename T, bool RMS>
const void* tma_fwd_for(DType mod, int vpt, bool per_row, bool interleave) {
  if (mod == dtype_of<T>()) return tma_fwd_tm<T, T, RMS>(vpt, per_row, interleave);
  if (mod == DType::kFloat32) return tma_fwd_tm<T, float, RMS>(vpt, per_row, interleave);
  return nullptr;
}

template <typename T, typename M, bool RMS, int VPT, int R, int REGS>
const void* tma_bwd_tmvrc(bool affine, bool per_row) {
  if (affine) {
    return per_row ? reinterpret_cast<const void*>(&nm_bwd_tma_kernel<T, M, VPT, RMS, true, true, R, REGS>)
                   : reinterpret_cast<const void*>(&nm_bwd_tma_kernel<T, M, VPT, RMS, true, false, R, REGS>);
  }
  return per_row ? reinterpret_cast<const void*>(&nm_bwd_tma_kernel<T, M, VPT, RMS, false, true, R, REGS>)
                 : reinterpret_cast<const void*>(&nm_bwd_tma_kernel<T, M, VPT, RMS, false, false, R, REGS>);
}

// regs: the register cap (tma_bwd_has_cap), 0 for the default one.
template <typename T, typename M, bool RMS, int VPT, int R>
const void* tma_bwd_tmvr(bool affine, bool per_row, int regs) {
  constexpr int kDefault = tma_bwd_max_registers(VPT);
  if (regs == 0 || regs == kDefault) return tma_bwd_tmvrc<T, M, RMS, VPT, R, kDefault>(affine, per_row);
  if constexpr (tma_bwd_has_cap(VPT, R, 112)) {
    if (regs == 112) return tma_bwd_tmvrc<T, M, RMS, VPT, R, 112>(affine, per_row);
  }
  if constexpr (tma_bwd_has_cap(VPT, R, 128) && kDefault != 128) {
    if (regs == 128) return tma_bwd_tmvrc<T, M, RMS, VPT, R, 128>(affine, per_row);
  }
  return nullptr;
}

// Rows per iteration: 1, 2 or 4 up to 2 vectors per thread; 1 for wider rows per thread (registers).
template <typename T, typename M, bool RMS, int VPT>
const void* tma_bwd_tmv(bool affine, bool per_row, int rows, int regs) {
  if constexpr (VPT <= 2) {
    if (rows == 2) return tma_bwd_tmvr<T, M, RMS, VPT, 2>(affine, per_row, regs);
    if (rows == 4) return tma_bwd_tmvr<T, M, RMS, VPT, 4>(affine, per_row, regs);
  }
  return rows == 1 ? tma_bwd_tmvr<T, M, RMS, VPT, 1>(affine, per_row, regs) : nullptr;
}

template <typename T, typename M, bool RMS>
const void* tma_bwd_tm(int vpt, bool affine, bool per_row, int rows, int regs) {
  switch (vpt) {
    case 1: return tma_bwd_tmv<T, M, RMS, 1>(affine, per_row, rows, regs);
    case 2: return tma_bwd_tmv<T, M, RMS, 2>(affine, per_row, rows, regs);
    case 4: return tma_bwd_tmv<T, M, RMS, 4>(affine, per_row, rows, regs);
    case 8:
      // Only fp32 rows of more than 8192 values need 8 vectors per thread (512 threads).
      if constexpr (sizeof(T) == 4) return tma_bwd_tmv<T, M, RMS, 8>(affine, per_row, rows, regs);
      return nullptr;
    default: return nullptr;
  }
}

template <typename T, bool RMS>
const void* tma_bwd_for(DType mod, int vpt, bool affine, bool per_row, int rows, int regs) {
  if (mod == dtype_of<T>()) return tma_bwd_tm<T, T, RMS>(vpt, affine, per_row, rows, regs);
  if (mod == DType::kFloat32) return tma_bwd_tm<T, float, RMS>(vpt, affine, per_row, rows, regs);
  return nullptr;
}

// The backward's tuned kernels (2026-12-03, second pass; tma_bwd_plan chooses among them by occupancy): 16-bit
// x, one vector per thread, per sample or per frame, no affine, under the 96-register cap. `opt` is the
// kernel's OPT: 4 the next block issued after the second pass (kLateIssue; no spill at 96 registers), 5 that and
// the fast dx. Built: LayerNorm rows 1 and 2 with opt 5; RMSNorm rows 1 with opt 5 and rows 2 with opt 4. Other
// x types: none (nullptr).
template <typename T, typename M, bool RMS>
const void* tma_bwd_tuned_tm(int rows, int opt) {
  if (rows == 1 && opt == 5) return reinterpret_cast<const void*>(&nm_bwd_tma_kernel<T, M, 1, RMS, false, false, 1, 96, 5>);
  if (rows == 2 && opt == (RMS ? 4 : 5))
    return reinterpret_cast<const void*>(&nm_bwd_tma_kernel<T, M, 1, RMS, false, false, 2, 96, RMS ? 4 : 5>);
  return nullptr;
}

template <typename T, bool RMS>
const void* tma_bwd_tuned_for(DType mod, int rows, int opt) {
  if constexpr (sizeof(T) != 2) {
    return nullptr;
  } else {
    if (mod == dtype_of<T>()) return tma_bwd_tuned_tm<T, T, RMS>(rows, opt);
    if (mod == DType::kFloat32) return tma_bwd_tuned_tm<T, float, RMS>(rows, opt);
    return nullptr;
  }
}

// Defined in norm_mod_tma_{bf16,fp16,fp32}_{ln,rms}.cu.
#define ADAPTIVELOAD_TMA_DECL(tag)                                                   \
  const void* tma_fwd_kernel_##tag(DType mod, int vpt, bool per_row, bool interleave);                \
  const void* tma_bwd_kernel_##tag(DType mod, int vpt, bool affine, bool per_row, int rows, int regs); \
  const void* tma_bwd_tuned_kernel_##tag(DType mod, int rows, int opt);
ADAPTIVELOAD_TMA_DECL(bf16_ln)
ADAPTIVELOAD_TMA_DECL(bf16_rms)
ADAPTIVELOAD_TMA_DECL(fp16_ln)
ADAPTIVELOAD_TMA_DECL(fp16_rms)
ADAPTIVELOAD_TMA_DECL(fp32_ln)
ADAPTIVELOAD_TMA_DECL(fp32_rms)
#undef ADAPTIVELOAD_TMA_DECL

}  // namespace detail
}  // namespace adaptiveload
