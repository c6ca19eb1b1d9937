// The eager fast path of lightning_adaptiveload.ops.layer_norm_modulate and rms_norm_modulate: a Python
// module in the same library as the operators (csrc/ln_modulate_binding.cpp), imported from the library's
// file by lightning_adaptiveload/ops/layer_norm_modulate.py.
//
// A call from Python through torch.ops parses its arguments against the schema and builds an argument
// stack, which costs several microseconds a call; a training step makes one or two such calls per block.
// This module keeps what the Python wrapper decided for each argument signature (shapes, dtypes and devices
// of x, shift, scale, weight and bias), namely the (rows, D) tables the modulation is read as and the group
// size, and a call whose signature was seen before goes from Python straight into C++ (norm_modulate_eager):
// the operator's CUDA kernel with the tables viewed below autograd, and one graph node whose backward is the
// operators' backward formula (no view nodes, no torch::autograd::Function bookkeeping). Where the
// dispatcher would add nothing to such a call, the kernel is launched without it (norm_mod_direct.h).
//
// Only the Python wrapper writes the cache (remember), after its own checks found that the kernels serve the
// call with plain views of shift and scale. Anything else returns None, and the wrapper takes its checked
// path: a tensor subclass, an active torch-function mode, a functorch transform (vmap, grad), a torch.jit
// trace, an argument of another type, an unseen signature. The cache is guarded by the GIL; the operator
// runs with the GIL released, as torch's own bindings do.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/util/SmallVector.h>
#include <pybind11/pybind11.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "norm_mod_eager.h"

namespace py = pybind11;

namespace {

using Key = c10::SmallVector<int64_t, 40>;

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = 1469598103934665603ull;
    for (const int64_t v : k) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Entry {
  int64_t rows;        // modulation table rows M: shift and scale are read as (M, D)
  int64_t group_size;  // rows of x each table row serves
};

// Distinct signatures kept (variable sequence lengths make many); then the cache starts over.
constexpr size_t kMaxEntries = 4096;
std::unordered_map<Key, Entry, KeyHash> g_cache;  // written and read with the GIL held

// A plain torch.Tensor (or Parameter): subclasses may mean something else and take the checked path.
bool unpack(py::handle h, at::Tensor* out) {
  if (!THPVariable_CheckExact(h.ptr())) return false;
  *out = THPVariable_Unpack(h.ptr());
  return true;
}

bool unpack_optional(py::handle h, std::optional<at::Tensor>* out) {
  if (h.is_none()) {
    *out = std::nullopt;
    return true;
  }
  at::Tensor t;
  if (!unpack(h, &t)) return false;
  *out = std::move(t);
  return true;
}

bool unpack_eps(py::handle h, double* out) {
  PyObject* o = h.ptr();
  if (PyFloat_Check(o)) {  // a float or a subclass (numpy's float64)
    *out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (PyLong_CheckExact(o)) {
    *out = PyLong_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

void add(Key& k, const at::Tensor& t) {
  const c10::Device d = t.device();
  k.push_back(static_cast<int64_t>(d.type()) * 1024 + d.index());
  k.push_back(static_cast<int64_t>(t.scalar_type()));
  k.push_back(t.dim());
  for (const int64_t s : t.sizes()) k.push_back(s);
}

void add(Key& k, const std::optional<at::Tensor>& t) {
  if (t.has_value()) {
    add(k, *t);
  } else {
    k.push_back(-1);
  }
}

struct Args {
  at::Tensor x, shift, scale;
  std::optional<at::Tensor> weight, bias;
  double eps = 0.0;
  Key key;
};

// False where the call is not the fast path's to serve (then the Python wrapper checks it).
bool parse(bool rms, py::handle x, py::handle shift, py::handle scale, py::handle weight, py::handle bias,
           py::handle eps, Args* a) {
  if (at::impl::torch_function_mode_enabled() || torch::jit::tracer::isTracing() ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    return false;
  }
  if (!unpack(x, &a->x) || !unpack(shift, &a->shift) || !unpack(scale, &a->scale) ||
      !unpack_optional(weight, &a->weight) || !unpack_optional(bias, &a->bias) || !unpack_eps(eps, &a->eps)) {
    return false;
  }
  if (!a->x.is_cuda() || a->x.dim() < 1) return false;
  a->key.push_back(rms ? 1 : 0);
  add(a->key, a->x);
  add(a->key, a->shift);
  add(a->key, a->scale);
  add(a->key, a->weight);
  add(a->key, a->bias);
  return true;
}

// y of the operator for a signature seen before, else None.
py::object forward(bool rms, py::handle x, py::handle shift, py::handle scale, py::handle weight, py::handle bias,
                   py::handle eps) {
  Args a;
  if (!parse(rms, x, shift, scale, weight, bias, eps, &a)) return py::none();
  const auto it = g_cache.find(a.key);
  if (it == g_cache.end()) return py::none();
  const Entry e = it->second;
  at::Tensor y;
  try {
    py::gil_scoped_release no_gil;
    y = adaptiveload::norm_modulate_eager(rms, a.x, a.shift, a.scale, a.weight, a.bias, e.rows, e.group_size, a.eps);
  } catch (const c10::Error& err) {
    // The operator's own message, without the C++ stack a c10::Error carries.
    throw std::runtime_error(err.what_without_backtrace());
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(y)));
}

// Records that calls of this signature read shift and scale as (rows, D) tables of group_size rows each.
bool remember(bool rms, py::handle x, py::handle shift, py::handle scale, py::handle weight, py::handle bias,
              py::handle eps, int64_t rows, int64_t group_size) {
  Args a;
  if (!parse(rms, x, shift, scale, weight, bias, eps, &a)) return false;
  if (rows < 1 || group_size < 1) return false;
  if (g_cache.size() >= kMaxEntries) g_cache.clear();
  g_cache[a.key] = Entry{rows, group_size};
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "The eager fast path of lightning_adaptiveload's norm-modulate operators (see norm_mod_python.cpp)";
  m.def("forward", &forward, "y for a call whose signature was remembered, else None");
  m.def("remember", &remember, "remember a call's signature with its table rows and group size");
  m.def("size", []() { return g_cache.size(); }, "signatures remembered");
  m.def("clear", []() { g_cache.clear(); }, "forget every signature");
  m.def("direct_launches", &adaptiveload::direct_launches,
        "(forward, backward) kernel launches taken without the dispatcher in this process");
}
