// The zentorch backend's native decode path (built by native.py at first use).
//
// Why C++: at T=1 the op takes 2-6 ms and streams its experts' weights through every
// cache, so the Python that runs between two calls runs cold: measured, the layer's
// Python checks plus the backend's cost ~80-110 us per call, 1.5-5% of the kernel. The
// same checks here cost a few microseconds, which puts MoELayer within noise of calling
// the op directly.
//
// FastCall takes a call only when it can prove it is the plain case, and returns None
// for anything else; the layer then runs its Python path, which raises the precise
// error or rewrites the call (int64 ids, duplicate ids, ...). So this file holds no
// error messages and no rewriting: only the checks and the op call.
//
// run_op is the one place that calls the op once this module is loaded (the Python paths
// call it too): the op is not thread-safe, and one mutex must guard every call.

#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

// zentorch 2.13: zentorch_fused_moe(Tensor(a!) output, Tensor input, Tensor w13, Tensor w2,
//   Tensor? w13_bias, Tensor? w2_bias, Tensor topk_weights, Tensor topk_id,
//   bool skip_weighted, str act, Tensor? w13_scales=None, Tensor? w2_scales=None, *,
//   str zentorch_op_name="zentorch::zentorch_fused_moe") -> ()
// (the backend's supports_config checks the schema before this module is ever built).
using OpSig = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
                   bool, c10::string_view, const OptTensor&, const OptTensor&,
                   c10::string_view);
constexpr const char* kOpName = "zentorch::zentorch_fused_moe";

std::mutex& op_mutex() {
  static std::mutex m;
  return m;
}

const c10::TypedOperatorHandle<OpSig>& op_handle() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(kOpName, "").typed<OpSig>();
  return handle;
}

// Serialised op call without the GIL (other Python threads run meanwhile; a thread waiting
// here holds no GIL, so there is no lock-order cycle).
void call_op_locked(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w13,
                    const at::Tensor& w2, const OptTensor& b13, const OptTensor& b2,
                    const at::Tensor& tw, const at::Tensor& ids, bool skip,
                    const std::string& act) {
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> guard(op_mutex());
  op_handle().call(out, x, w13, w2, b13, b2, tw, ids, skip, act, std::nullopt, std::nullopt,
                   kOpName);
}

bool plain_input(PyObject* obj, at::ScalarType dtype, int64_t rows, int64_t cols) {
  // Exactly torch.Tensor, as the layer's Python path asks (THPVariable_CheckExact also
  // admits nn.Parameter; a subclass may override anything), dense, on the CPU, contiguous.
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  return t.layout() == at::kStrided && t.is_cpu() && t.scalar_type() == dtype &&
         t.dim() == 2 && (rows < 0 || t.size(0) == rows) && t.size(1) == cols &&
         t.is_contiguous();
}

class FastCall {
 public:
  FastCall(at::Tensor w13, at::Tensor w2, OptTensor b13, OptTensor b2, std::string act,
           int64_t hidden, int64_t top_k, int64_t experts, at::ScalarType dtype,
           std::vector<at::Tensor> watched, std::vector<int64_t> versions)
      : w13_(std::move(w13)), w2_(std::move(w2)), b13_(std::move(b13)), b2_(std::move(b2)),
        act_(std::move(act)), hidden_(hidden), top_k_(top_k), experts_(experts),
        dtype_(dtype), watched_(std::move(watched)), versions_(std::move(versions)) {
    TORCH_CHECK(watched_.size() == versions_.size(), "one version per watched tensor");
    TORCH_CHECK(top_k_ > 1 && hidden_ > 0 && experts_ > 1, "FastCall: a plain config");
    op_handle();  // resolve now: a missing op fails here, at prepare(), not at a forward
  }

  // The output, or None when the call is not the plain case (the caller's Python path
  // then handles it, errors included).
  py::object operator()(py::handle x, py::handle tw, py::handle ids) const {
    if (!plain_input(x.ptr(), dtype_, -1, hidden_)) return py::none();
    const at::Tensor& xt = THPVariable_Unpack(x.ptr());
    const int64_t tokens = xt.size(0);
    if (tokens == 0 || !plain_input(tw.ptr(), at::kFloat, tokens, top_k_) ||
        !plain_input(ids.ptr(), at::kInt, tokens, top_k_))
      return py::none();
    // The caller's canonical weights unchanged since prepare() (the layer's version check).
    for (size_t i = 0; i < watched_.size(); ++i)
      if (watched_[i]._version() != versions_[i]) return py::none();
    // Ids in range (the op checks too, but its error is not the layer's typed one) and no
    // id repeated in a row (the op silently returns wrong numbers for those).
    const at::Tensor& it = THPVariable_Unpack(ids.ptr());
    const int32_t* row = it.const_data_ptr<int32_t>();
    for (int64_t r = 0; r < tokens; ++r, row += top_k_) {
      for (int64_t a = 0; a < top_k_; ++a) {
        if (row[a] < 0 || row[a] >= experts_) return py::none();
        for (int64_t b = 0; b < a; ++b)
          if (row[a] == row[b]) return py::none();
      }
    }
    const at::Tensor& twt = THPVariable_Unpack(tw.ptr());
    at::Tensor out = at::empty_like(xt);
    call_op_locked(out, xt, w13_, w2_, b13_, b2_, twt, it, false, act_);
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }

 private:
  at::Tensor w13_, w2_;
  OptTensor b13_, b2_;
  std::string act_;
  int64_t hidden_, top_k_, experts_;
  at::ScalarType dtype_;
  std::vector<at::Tensor> watched_;
  std::vector<int64_t> versions_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe-dispatch: the zentorch backend's native decode path";
  m.def("run_op", &call_op_locked, "The op under the process-wide op mutex, without the GIL.");
  py::class_<FastCall>(m, "FastCall")
      .def(py::init<at::Tensor, at::Tensor, OptTensor, OptTensor, std::string, int64_t,
                    int64_t, int64_t, at::ScalarType, std::vector<at::Tensor>,
                    std::vector<int64_t>>())
      .def("__call__", &FastCall::operator());
}
