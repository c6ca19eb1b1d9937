// Fused LayerNorm or RMSNorm + adaLN modulation: y = norm(x) * (1 + scale) + shift.
//
// Raw-pointer launcher interface. Nothing here includes torch, so the kernels build and can be checked
// standalone with nvcc (`nvcc -arch=sm_90 --resource-usage -c csrc/ln_modulate_fwd.cu`); the torch
// binding (ln_modulate_binding.cpp) is the only file that needs torch headers.
//
// Data layout. x is (rows, D) contiguous, rows = product of x's leading dims. A modulation vector (one row
// of shift/scale, D values) is shared by `group_size` consecutive rows: row r uses modulation row
// r / group_size. Per sample (x (B, S, D), shift (B, 1, D)): group_size = S. Per frame (x (B, F, L, D),
// shift (B, F, 1, D)): group_size = L. Per token: group_size = 1. Modulation rows may be strided
// (`*_stride`, in elements, last dim contiguous) so that chunks of a (B, 6, D) table need no copy.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace adaptiveload {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// The largest feature size the kernels take; larger rows fall back to the reference.
constexpr int64_t kMaxD = 16384;

struct LnModFwdArgs {
  const void* x = nullptr;      // (rows, D), x_dtype
  const void* shift = nullptr;  // (num_groups, D) rows at shift_stride, mod_dtype
  const void* scale = nullptr;  // (num_groups, D) rows at scale_stride, mod_dtype
  const float* weight = nullptr;  // (D,) fp32 or null
  const float* bias = nullptr;    // (D,) fp32 or null
  void* y = nullptr;              // (rows, D), x_dtype
  float* mean = nullptr;          // (rows,)
  float* rstd = nullptr;          // (rows,)
  int64_t rows = 0;
  int64_t D = 0;
  int64_t group_size = 1;
  int64_t shift_stride = 0;
  int64_t scale_stride = 0;
  float eps = 1e-6f;
  DType x_dtype = DType::kBFloat16;
  DType mod_dtype = DType::kFloat32;
  bool rms = false;        // RMSNorm (no mean; `mean` unused and may be null) instead of LayerNorm
  int warps_per_row = 0;  // 0: choose; else a tuning override (benchmarks only)
  int rows_per_cta = 0;   // 0: choose; else a tuning override (benchmarks only)
  int stages = 0;         // bulk-copy path: 0 choose; else rows in flight per CTA (benchmarks only)
  // Forward kernel, a tuning override (benchmarks only): 0 choose; 1 one row per row slot per CTA
  // (version 3, any width); 2 persistent CTAs of one row slot with the next row prefetched (version 4; up
  // to 4 vectors per thread, rows_per_cta 0 or 1); 3 as 2 under an 80-register cap at 4 vectors; 4 rows
  // fed by the bulk copy engine into shared memory (version 5, LayerNorm and RMSNorm). Paths 1-3 are
  // LayerNorm only.
  int path = 0;
  // Bulk-copy path, row mapping (benchmarks only): 0 choose; 1 contiguous rows per CTA; 2 interleaved.
  int interleave = 0;
  // Bulk-copy path (benchmarks only): a kernel of the same signature to launch instead of the table's, with
  // the mapping forced by `interleave` (1 or 2) to match the kernel's (benchmarks/kernels/norm_mod_mapping.cu).
  const void* kernel_override = nullptr;
};

// Forward kernel paths (LnModFwdArgs::path).
enum FwdPath : int { kFwdAuto = 0, kFwdV3 = 1, kFwdV4 = 2, kFwdV4LowRegs = 3, kFwdTma = 4 };
// Backward kernel paths (LnModBwdArgs::path).
enum BwdPath : int { kBwdAuto = 0, kBwdRegs = 1, kBwdTma = 2 };

struct LnModBwdArgs {
  const void* dy = nullptr;     // (rows, D), x_dtype
  const void* x = nullptr;      // (rows, D), x_dtype
  const void* scale = nullptr;  // (num_groups, D) rows at scale_stride, mod_dtype
  const float* weight = nullptr;
  const float* bias = nullptr;
  const float* mean = nullptr;  // (rows,) from the forward
  const float* rstd = nullptr;  // (rows,) from the forward
  void* dx = nullptr;           // (rows, D), x_dtype
  void* dshift = nullptr;       // (num_groups, D) contiguous, mod_dtype
  void* dscale = nullptr;       // (num_groups, D) contiguous, mod_dtype
  float* dweight = nullptr;     // (D,) or null (only with weight)
  float* dbias = nullptr;       // (D,) or null (only with weight)
  int64_t rows = 0;
  int64_t D = 0;
  int64_t group_size = 1;
  int64_t scale_stride = 0;
  DType x_dtype = DType::kBFloat16;
  DType mod_dtype = DType::kFloat32;
  bool rms = false;            // RMSNorm: `mean` unused (may be null)
  int vectors_per_thread = 0;  // 0: choose; else 1, 2 or 4 (8 for fp32 rows; tuning override)
  int slots = 0;               // 0: choose; else rows processed side by side per CTA (tuning override;
                               // the bulk-copy path: rows per iteration, 1, 2 or 4)
  int stages = 0;              // bulk-copy path: 0 choose; else rows in flight per CTA (tuning override)
  int path = 0;                // BwdPath: 0 choose; 1 the register-fed kernel (LayerNorm); 2 bulk copies
  int regs = 0;                // bulk-copy path, register cap (benchmarks only): 0 choose; 96, 112 or 128
  // Bulk-copy path (benchmarks only): a kernel of the same signature and rows per iteration (`slots`) to
  // launch instead of the table's; the plan's occupancy is the override's.
  const void* kernel_override = nullptr;
};

// The launch plan of the backward; the workspace holds the fp32 column partials of the first pass.
struct LnModBwdPlan {
  int vpt = 1;           // 16-byte vectors per thread per row
  int rows_per_iter = 1;  // rows each thread has in flight (the bulk-copy path: rows per iteration)
  int tpr = 32;          // threads per row slot (multiple of 32)
  int slots = 1;         // row slots per CTA
  int grid = 1;          // CTAs
  int64_t chunks = 1;    // CTAs (work items) per modulation group; 1 in per-token mode
  int64_t rows_per_chunk = 1;
  int64_t num_items = 1;
  bool per_row = false;  // group_size == 1: per-token modulation, no column sums for shift/scale
  bool affine = false;
  bool tma = false;      // the bulk-copy kernel (version 5); then tpr is the CTA and slots is 1
  int stages = 0;        // bulk-copy path: rows in flight per CTA
  bool interleave = false;  // bulk-copy path: an item's blocks of rows interleaved with its group's other items
                            // (fixed per kernel: RMSNorm and per token, see norm_mod_tma.cuh)
  int regs = 0;             // bulk-copy path: the kernel's register cap
  const void* kernel = nullptr;  // bulk-copy path: the kernel to launch
  uint32_t stage_bytes = 0;
  size_t smem_bytes = 0;
  size_t workspace_bytes = 0;
};

// Returns a message on unsupported input (nullptr when fine). The binding turns it into an exception.
const char* ln_mod_check(int64_t D, DType x_dtype, DType mod_dtype);

// The forward's plan on the bulk-copy path, for the benchmarks' report (what ln_mod_forward would launch).
struct NormModFwdPlan {
  bool tma = false;
  int threads = 0;
  int vpt = 0;
  int stages = 0;
  bool per_row = false;
  int grid = 0;
  int64_t rows_per_cta = 0;
  size_t smem_bytes = 0;
  int ctas_per_sm = 0;
  bool interleave = false;  // rows interleaved over the CTAs (else contiguous rows_per_cta per CTA)
};
cudaError_t norm_mod_forward_plan(const LnModFwdArgs& args, NormModFwdPlan* plan);

cudaError_t ln_mod_forward(const LnModFwdArgs& args, cudaStream_t stream);

// Plans the backward for the current device; call before allocating the workspace.
cudaError_t ln_mod_backward_plan(const LnModBwdArgs& args, LnModBwdPlan* plan);

// Runs the backward with `plan` from ln_mod_backward_plan and a workspace of plan.workspace_bytes
// (16-byte aligned; contents ignored).
cudaError_t ln_mod_backward(const LnModBwdArgs& args, const LnModBwdPlan& plan, void* workspace,
                            cudaStream_t stream);

}  // namespace adaptiveload
