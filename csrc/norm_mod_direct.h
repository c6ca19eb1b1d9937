// The rules of the eager fast path's direct launch (ln_modulate_binding.cpp, norm_modulate_eager): when a
// call may skip the dispatcher and launch the CUDA kernel itself, and how the modulation is read then.
// Header-only and free of CUDA, so that tests/ops/test_direct_launch_rules.py checks them on a CPU build.
//
// Going through the dispatcher costs a call of the operator several microseconds on the host: the
// operator's own dispatch, a view of each table (reshape), an allocation per output (at::empty). The
// direct launch does none of that, and is only taken where the dispatcher would have run nothing but the
// operator's CUDA kernel and the autograd node the fast path builds anyway:
//   - every key the call would dispatch on, once the keys below are set aside, is CUDA: no tensor
//     subclass, no TorchDispatchMode, functionalization, functorch, conjugate or negative bit, no sparse or
//     nested tensor;
//   - set aside are the autograd keys and ADInplaceOrView (the fast path builds the operator's graph node
//     itself), the autocast keys (a fallthrough for every custom operator), and BackendSelect (the
//     operator has no kernel there);
//   - no RecordFunction callback is active (a profiler sees the operator through the dispatcher);
//   - each table is a plain strided view of rows x D elements (table_stride), and every pointer is
//     16-byte aligned.
// Anything else takes the dispatcher, as before.
#pragma once

#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

namespace adaptiveload {
namespace direct {

// The keys a direct launch sets aside (see above).
constexpr c10::DispatchKeySet kSetAside = c10::autograd_dispatch_keyset_with_ADInplaceOrView |
                                          c10::autocast_dispatch_keyset |
                                          c10::DispatchKeySet(c10::DispatchKey::BackendSelect);

// Whether the dispatcher, given the union of the arguments' key sets and the thread's local include and
// exclude sets, would run nothing beyond the set-aside keys before the CUDA kernel.
inline bool dispatcher_adds_nothing(c10::DispatchKeySet tensors, c10::DispatchKeySet tls_included,
                                    c10::DispatchKeySet tls_excluded) {
  const c10::DispatchKeySet ks = ((tensors | tls_included) - tls_excluded) - kSetAside;
  return !ks.empty() && ks.highestPriorityTypeId() == c10::DispatchKey::CUDA;
}

inline bool dispatcher_adds_nothing(c10::DispatchKeySet tensors) {
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  return dispatcher_adds_nothing(tensors, tls.included_, tls.excluded_);
}

// The row stride of a tensor of `sizes` and `strides` read as a (rows, D) table with no copy, the way
// reshape({rows, D}) would view it; -1 where its elements are not such a table (the last dim is not D
// or not unit-stride, the leading dims do not hold `rows` rows, or they do not collapse into one strided
// dim). Size-1 dims are ignored, as reshape ignores them; a single row has stride D.
inline int64_t table_stride(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t rows, int64_t D) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  if (n < 1 || sizes.size() != strides.size() || D < 1 || rows < 1) return -1;
  if (sizes[n - 1] != D || (D > 1 && strides[n - 1] != 1)) return -1;
  int64_t count = 1;
  int64_t row_stride = -1;  // of the innermost leading dim of size > 1
  int64_t next = -1;        // the stride the next dim out must have to collapse with the ones inside it
  for (int64_t i = n - 2; i >= 0; --i) {
    const int64_t s = sizes[i];
    if (s == 1) continue;
    if (s < 1) return -1;
    if (row_stride < 0) {
      row_stride = strides[i];
    } else if (strides[i] != next) {
      return -1;
    }
    next = strides[i] * s;
    count *= s;
  }
  if (count != rows) return -1;
  return row_stride < 0 ? D : row_stride;
}

}  // namespace direct
}  // namespace adaptiveload
