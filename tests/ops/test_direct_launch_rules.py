"""The rules of the fast path's direct launch (csrc/norm_mod_direct.h), on CPU.

The header is compiled alone into a small extension, and its answers are checked against PyTorch itself:
``table_stride`` against what ``reshape(rows, D)`` does to random strided tensors (a view, and which row
stride), ``dispatcher_adds_nothing`` against key sets built from dispatch key names. The CUDA tests
(tests/ops/test_ops_cuda.py) check that the launch is taken where these rules allow it and that its results
equal the dispatcher's.
"""

from __future__ import annotations

import shutil

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lightning_adaptiveload.ops import _build  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler"
)

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/DispatchKey.h>
#include "norm_mod_direct.h"

int64_t table_stride(std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t rows, int64_t D) {
  return adaptiveload::direct::table_stride(sizes, strides, rows, D);
}

c10::DispatchKeySet keys(const std::vector<std::string>& names) {
  c10::DispatchKeySet ks;
  for (const auto& n : names) ks = ks | c10::DispatchKeySet(c10::parseDispatchKey(n));
  return ks;
}

bool adds_nothing(std::vector<std::string> tensors, std::vector<std::string> included,
                  std::vector<std::string> excluded) {
  return adaptiveload::direct::dispatcher_adds_nothing(keys(tensors), keys(included), keys(excluded));
}

bool adds_nothing_live(at::Tensor t) { return adaptiveload::direct::dispatcher_adds_nothing(t.key_set()); }
"""


@pytest.fixture(scope="module")
def rules(tmp_path_factory):
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="adaptiveload_direct_rules",
        cpp_sources=[_SOURCE],
        functions=["table_stride", "adds_nothing", "adds_nothing_live"],
        extra_include_paths=[str(_build.find_csrc())],
        extra_cflags=["-O1", "-std=c++17"],
        build_directory=str(tmp_path_factory.mktemp("direct_rules")),
        verbose=False,
    )


def _reshape_stride(t: torch.Tensor, rows: int, D: int) -> int:
    """The row stride of t.reshape(rows, D) where that is a view of t's memory, else -1."""
    v = t.reshape(rows, D)
    if v.data_ptr() != t.data_ptr() or v.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return -1
    if D > 1 and v.stride(1) != 1:
        return -1
    return v.stride(0) if rows > 1 else D


@st.composite
def strided(draw):
    """A tensor of (..., D) with random leading sizes, taken as a slice, permutation or expansion of a
    larger one (the layouts a modulation table arrives in: chunks of (B, 6, D), (B, 1, D), expanded)."""
    D = draw(st.sampled_from([8, 16, 24]))
    lead = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    kind = draw(st.sampled_from(["contiguous", "chunk", "permute", "expand", "step"]))
    shape = [*lead, D]
    if kind == "chunk":  # a chunk of a table with k modulation vectors per row, as chunk(6, dim=-2) makes
        k = draw(st.integers(2, 6))
        base = torch.zeros(*lead, k, D)
        t = base.select(-2, draw(st.integers(0, k - 1)))
    elif kind == "permute" and len(lead) >= 2:
        t = torch.zeros(*reversed(lead), D).permute(*reversed(range(len(lead))), len(lead))
    elif kind == "expand" and lead:
        small = [1 if draw(st.booleans()) else s for s in lead]
        t = torch.zeros(*small, D).expand(*shape)
    elif kind == "step" and lead:
        t = torch.zeros(lead[0] * 2, *lead[1:], D)[::2]
    else:
        t = torch.zeros(*shape)
    return t, D


@settings(max_examples=300, deadline=None)
@given(strided())
def test_table_stride_agrees_with_reshape(rules, case):
    t, D = case
    rows = t.numel() // D
    expected = _reshape_stride(t, rows, D)
    assert rules.table_stride(list(t.shape), list(t.stride()), rows, D) == expected, (t.shape, t.stride())


def test_table_stride_refuses_what_is_not_a_table(rules):
    # The last dim is not D, or not unit-stride (a transposed table), or the rows are not the count.
    assert rules.table_stride([4, 16], [16, 1], 4, 8) == -1
    assert rules.table_stride([4, 16], [1, 4], 4, 16) == -1
    assert rules.table_stride([4, 16], [16, 1], 3, 16) == -1
    # Leading dims that do not collapse into one strided dim: rows of a (2, 3) grid at strides (1, 2).
    assert rules.table_stride([2, 3, 8], [8, 32, 1], 6, 8) == -1
    # A single row, however it is strided, has stride D; size-1 dims are ignored.
    assert rules.table_stride([1, 1, 8], [999, 7, 1], 1, 8) == 8
    assert rules.table_stride([3, 1, 8], [48, 5, 1], 3, 8) == 48


_CUDA_TENSOR = ["CUDA", "AutogradCUDA", "ADInplaceOrView", "AutocastCUDA"]


def test_plain_cuda_tensors_dispatch_to_the_kernel_alone(rules):
    assert rules.adds_nothing(_CUDA_TENSOR, ["BackendSelect", "ADInplaceOrView"], ["AutocastCUDA"])
    # Autocast on (the key no longer excluded): its kernel for custom operators is a fallthrough.
    assert rules.adds_nothing(_CUDA_TENSOR, ["BackendSelect", "ADInplaceOrView"], [])
    # Below autograd (the thread excludes the autograd keys): still the kernel alone.
    assert rules.adds_nothing(_CUDA_TENSOR, [], ["AutogradCUDA", "ADInplaceOrView"])


@pytest.mark.parametrize(
    "extra_tensor, extra_included",
    [
        (["Python", "PythonTLSSnapshot"], []),  # a tensor subclass with __torch_dispatch__
        ([], ["Python", "PythonTLSSnapshot"]),  # a TorchDispatchMode
        ([], ["Functionalize"]),
        ([], ["FuncTorchDynamicLayerFrontMode"]),
        (["FuncTorchBatched"], []),
        (["Conjugate"], []),
        (["Negative"], []),
        (["SparseCUDA"], []),
        ([], ["PreDispatch"]),
    ],
)
def test_anything_else_takes_the_dispatcher(rules, extra_tensor, extra_included):
    assert not rules.adds_nothing(_CUDA_TENSOR + extra_tensor, ["BackendSelect", *extra_included], [])


def test_other_backends_and_empty_sets_take_the_dispatcher(rules):
    assert not rules.adds_nothing(["CPU", "AutogradCPU", "ADInplaceOrView"], ["BackendSelect"], [])
    assert not rules.adds_nothing(["Meta"], [], [])
    assert not rules.adds_nothing([], ["BackendSelect"], [])
    # A key the thread excludes is not dispatched on: excluding CUDA leaves nothing to launch on.
    assert not rules.adds_nothing(_CUDA_TENSOR, [], ["CUDA"])


def test_live_key_sets_of_cpu_tensors_take_the_dispatcher(rules):
    """The live overload reads the thread's sets; a CPU tensor never launches directly, in any mode."""
    assert not rules.adds_nothing_live(torch.zeros(2, 8))
    with torch.inference_mode():
        assert not rules.adds_nothing_live(torch.zeros(2, 8))
