// moe-dispatch's toolkit for a backend's native entry (BackendBase.fast_call), header-only.
//
// Why: at T=1 a fused MoE kernel takes 1-10 ms and streams its experts' weights through
// every cache, so the Python that runs between two calls runs cold (measured: the layer's
// checks plus a backend's Python cost 50-110 us per call, 1.5-5% of the kernel). A native
// entry makes the same checks in a few microseconds.
//
// The contract: an entry takes a call only when it can prove it is the plain case and
// returns None for anything else; the layer then runs its Python path, which raises the
// precise error or rewrites the call. So an entry holds no error messages and no
// rewriting: only checks (PlainCall below) and the kernel call.

#pragma once

#include <torch/extension.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

// Hidden: each extension compiles its own copy of this header, and a default-visibility
// template's static member (EntryFunction<Entry>::def) would be one process-wide symbol
// shared by every module that instantiates it with a same-named class, such as a backend's
// avx2 and avx512 builds of one source, so one module's entries would run the other's code.
namespace __attribute__((visibility("hidden"))) moe_dispatch {

namespace py = pybind11;

// Exactly torch.Tensor, as the layer's Python path asks (THPVariable_CheckExact also admits
// nn.Parameter; a subclass may override anything), dense, on the CPU, 2-D, contiguous, of
// this dtype and shape (rows < 0: any number of rows), and its memory is its value: a
// storage of its own (torch.func's vmap and grad wrap tensors without one, and say they are
// contiguous torch.Tensors), no lazy negation or conjugation (torch._neg_view: the bytes are
// the value's negation), no functionalization or Python dispatch in between.
inline bool plain_input(PyObject* obj, at::ScalarType dtype, int64_t rows, int64_t cols) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::Python});
  return t.layout() == at::kStrided && t.is_cpu() && t.scalar_type() == dtype &&
         t.dim() == 2 && (rows < 0 || t.size(0) == rows) && t.size(1) == cols &&
         t.is_contiguous() && t.has_storage() && !t.is_neg() && !t.is_conj() &&
         !t.key_set().has_any(wrapped);
}

// What a layer's plan fixes for its entry: the forward's shape constants and the caller's
// canonical weights with their version stamps at prepare() (the layer's version check), and
// their storages, taken here: `w.data = ...` and a module's .to() keep the tensor and its
// version but replace its storage, which this tensor handle (the same TensorImpl) sees.
// Compared by identity and held (so no other storage can take the old one's address while
// this spec lives), not by data pointer: share_memory_() moves a storage's bytes and keeps it.
struct PlainSpec {
  int64_t hidden = 0, top_k = 0, experts = 0;
  at::ScalarType dtype = at::kFloat;
  bool reject_repeated_ids = false;  // for kernels that are wrong on an id repeated in a row
  std::vector<at::Tensor> watched;
  std::vector<int64_t> versions;
  std::vector<c10::Storage> storages;

  PlainSpec() = default;
  PlainSpec(int64_t hidden_, int64_t top_k_, int64_t experts_, at::ScalarType dtype_,
            std::vector<at::Tensor> watched_, std::vector<int64_t> versions_,
            bool reject_repeated_ids_ = false)
      : hidden(hidden_), top_k(top_k_), experts(experts_), dtype(dtype_),
        reject_repeated_ids(reject_repeated_ids_), watched(std::move(watched_)),
        versions(std::move(versions_)) {
    TORCH_CHECK(watched.size() == versions.size(), "one version per watched tensor");
    TORCH_CHECK(top_k > 0 && hidden > 0 && experts > 0, "PlainSpec: a plain config");
    for (const at::Tensor& w : watched) storages.push_back(w.storage());
  }

  bool weights_want_grad() const {
    for (const at::Tensor& w : watched)
      if (w.requires_grad()) return true;
    return false;
  }

  bool weights_unchanged() const {
    for (size_t i = 0; i < watched.size(); ++i)
      if (watched[i]._version() != versions[i] ||
          watched[i].storage().unsafeGetStorageImpl() != storages[i].unsafeGetStorageImpl())
        return false;
    return true;
  }
};

// The call's tensors when it is plain: x [T, H] of the layer's dtype, T > 0; router
// weights [T, top_k] float32, bfloat16, float16 or float64 and ids [T, top_k] int32 or
// int64, given to the kernel as float32 and int32 (the caller's own tensors when they are,
// else converted here, value by value, as the backends' Python paths convert them with
// .to(): int64 ids only after their range check, so 2**32 + 1 is out of range, never 1; a
// float64 weight rounded to nearest); every id in [0, E) (and none repeated in a row when
// the spec asks); the canonical weights unchanged; no torch.jit.trace running (it records
// torch ops, and would record the kernel's output as a constant); and nothing autograd
// would record (grad mode on while x, the router weights or a canonical weight requires
// grad). The layer leaves the last two checks to its entries: here thread-local reads,
// where the tracing check's Python form, torch._C._get_tracing_state(), costs 10 us per
// cold call.
// Why convert here: torch.topk gives int64 ids and HF passes router weights in the model's
// dtype; declined, such a call took the Python path, 1.08-1.29x of the time of an int32 /
// float32 call at T=1 (E=64 top-8 H=2048 and E=8 top-2 H=1024 bf16, cold, Zen 3), and a
// .to() in the caller costs a torch op that runs cold (tens of us).
struct PlainCall {
  const at::Tensor* x;
  at::Tensor topk_weights;  // float32 [T, top_k]
  at::Tensor topk_ids;      // int32 [T, top_k]
  int64_t tokens;

  static std::optional<PlainCall> check(const PlainSpec& s, py::handle x, py::handle tw,
                                        py::handle ids) {
    if (torch::jit::tracer::isTracing() || !plain_input(x.ptr(), s.dtype, -1, s.hidden))
      return std::nullopt;
    const at::Tensor& xt = THPVariable_Unpack(x.ptr());
    const int64_t tokens = xt.size(0);
    if (tokens == 0 || !router_weights(tw.ptr(), tokens, s.top_k) ||
        !(plain_input(ids.ptr(), at::kInt, tokens, s.top_k) ||
          plain_input(ids.ptr(), at::kLong, tokens, s.top_k)) ||
        !s.weights_unchanged())
      return std::nullopt;
    const at::Tensor& wt = THPVariable_Unpack(tw.ptr());
    // A call autograd would record: the layer's Python path gives it exact gradients or a
    // backward that raises (moe_dispatch/_autograd.py). Under no_grad one thread-local read.
    if (at::GradMode::is_enabled() && (xt.requires_grad() || wt.requires_grad() || s.weights_want_grad()))
      return std::nullopt;
    const at::Tensor& it = THPVariable_Unpack(ids.ptr());
    std::optional<at::Tensor> ids32 = it.scalar_type() == at::kInt
        ? checked_ids<int32_t>(s, it, tokens) : checked_ids<int64_t>(s, it, tokens);
    if (!ids32) return std::nullopt;
    return PlainCall{&xt, as_float32(wt), std::move(*ids32), tokens};
  }

 private:
  // Router weights: as plain_input asks, of a floating dtype (the layer's Python path takes
  // float32, bfloat16, float16 and float64 and converts them to float32).
  static bool router_weights(PyObject* obj, int64_t rows, int64_t cols) {
    for (const at::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble})
      if (plain_input(obj, t, rows, cols)) return true;
    return false;
  }

  // The ids as int32 when every one is in [0, E) (and none is repeated in a row where the
  // spec asks); int32 ids are passed as they are.
  template <class Id>
  static std::optional<at::Tensor> checked_ids(const PlainSpec& s, const at::Tensor& it, int64_t tokens) {
    const Id* row = it.const_data_ptr<Id>();
    for (int64_t r = 0; r < tokens; ++r, row += s.top_k) {
      for (int64_t a = 0; a < s.top_k; ++a) {
        if (row[a] < 0 || row[a] >= s.experts) return std::nullopt;
        if (s.reject_repeated_ids)
          for (int64_t b = 0; b < a; ++b)
            if (row[a] == row[b]) return std::nullopt;
      }
    }
    if constexpr (std::is_same_v<Id, int32_t>) {
      return it;
    } else {
      at::Tensor out = at::detail::empty_cpu(it.sizes(), at::kInt, /*pin_memory=*/false, std::nullopt);
      const Id* in = it.const_data_ptr<Id>();
      int32_t* o = out.mutable_data_ptr<int32_t>();
      for (int64_t i = 0; i < tokens * s.top_k; ++i) o[i] = static_cast<int32_t>(in[i]);
      return out;
    }
  }

  template <class T>
  static at::Tensor converted(const at::Tensor& w) {
    at::Tensor out = at::detail::empty_cpu(w.sizes(), at::kFloat, /*pin_memory=*/false, std::nullopt);
    const T* in = w.const_data_ptr<T>();
    float* o = out.mutable_data_ptr<float>();
    const int64_t n = w.numel();
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(in[i]);
    return out;
  }

  static at::Tensor as_float32(const at::Tensor& w) {
    switch (w.scalar_type()) {
      case at::kFloat: return w;
      case at::kBFloat16: return converted<at::BFloat16>(w);
      case at::kHalf: return converted<at::Half>(w);
      default: return converted<double>(w);  // float64: router_weights admits no other
    }
  }
};

// A fresh output shaped and typed like a plain call's x (contiguous, on the CPU): what
// at::empty_like(x) makes, without its two trips through the dispatcher (empty_like, then
// empty), which cost 5 us per call when they run cold (measured as for EntryFunction below).
inline at::Tensor new_output(const at::Tensor& x) {
  return at::detail::empty_cpu(x.sizes(), x.scalar_type(), /*pin_memory=*/false, std::nullopt);
}

inline py::object wrap(at::Tensor t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
}

// The entry as a CPython function f(x, topk_weights, topk_ids) that owns a copy of `entry`
// (any copyable class with `py::object operator()(py::handle, py::handle, py::handle) const`).
// Why not pybind11's __call__: its dispatcher (overload lookup, argument casters) costs
// 8 us per call when it runs cold, as it does between two decode calls (measured on a Zen 4,
// E=8 top-2 H=128 int8 native kernel at T=1 after a 128 MiB read: 26.7 against 34.4 us per
// call); CPython calls a METH_FASTCALL function directly. Exceptions become Python ones, as
// torch's own functions raise them.
template <class Entry>
struct EntryFunction {
  static constexpr const char* kName = "moe_dispatch.entry";
  static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    try {
      HANDLE_TH_ERRORS
      try {
        if (nargs != 3) {
          PyErr_Format(PyExc_TypeError, "a native entry takes 3 arguments (hidden_states, "
                       "topk_weights, topk_ids), got %zd", nargs);
          return nullptr;
        }
        const auto* entry = static_cast<const Entry*>(PyCapsule_GetPointer(self, kName));
        if (entry == nullptr) return nullptr;
        return (*entry)(args[0], args[1], args[2]).release().ptr();
      } catch (py::builtin_exception& e) {  // pybind11's value_error and the like keep their type
        e.set_error();
        return nullptr;
      }
      END_HANDLE_TH_ERRORS  // c10::Error, std::exception, py::error_already_set
    } catch (...) {  // anything else: a Python error, never std::terminate
      PyErr_SetString(PyExc_RuntimeError, "a native entry raised a non-standard C++ exception");
      return nullptr;
    }
  }
  static void free(PyObject* capsule) {
    delete static_cast<Entry*>(PyCapsule_GetPointer(capsule, kName));
  }
  static inline PyMethodDef def = {
      "native_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&call)),
      METH_FASTCALL, "The layer's native entry: (hidden_states, topk_weights, topk_ids) -> "
      "the output, or None for a call that is not the plain case."};
};

template <class Entry>
py::object entry_function(const Entry& entry) {
  auto owned = std::make_unique<Entry>(entry);
  py::object capsule = py::reinterpret_steal<py::object>(
      PyCapsule_New(owned.get(), EntryFunction<Entry>::kName, &EntryFunction<Entry>::free));
  if (!capsule) throw py::error_already_set();
  owned.release();  // the capsule frees it
  PyObject* fn = PyCFunction_New(&EntryFunction<Entry>::def, capsule.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace moe_dispatch
