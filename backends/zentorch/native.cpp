// The zentorch backend's native decode path (built by native.py at first use): the plain
// call's checks in C++ (the toolkit header says why and what "plain" is) and the op called
// through the dispatcher; the layer's Python path handles the rest (an id repeated in a
// row, top_k == 1, ...).
//
// run_op is the one place that calls the op once this module is loaded (the Python paths
// call it too): the op is not thread-safe, and one mutex must guard every call.

#include <moe_dispatch_fast_call.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

#include <mutex>
#include <string>

namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;
using moe_dispatch::PlainCall;
using moe_dispatch::PlainSpec;

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
// w13_scales / w2_scales: the quantized path's scales (None for float weights).
// The op's weight cache keys a reordered weight by the thread count of the call that
// reordered it, in place: with another count the op misses, finds the raw weights gone and
// fails closed (torch.set_num_threads after prepare(), or a thread whose OpenMP count was
// never set). So the op runs with `threads` (the count at prepare(); 0: as it is), set for
// the calling thread only (its OpenMP ICV; torch reads it through at::get_num_threads) and
// restored after. at::get_num_threads() first: it initialises a new thread's count from
// torch's, which would otherwise overwrite the pin inside the op.
void call_op_locked(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w13,
                    const at::Tensor& w2, const OptTensor& b13, const OptTensor& b2,
                    const at::Tensor& tw, const at::Tensor& ids, bool skip,
                    const std::string& act, const OptTensor& s13, const OptTensor& s2,
                    int64_t threads) {
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> guard(op_mutex());
  const int before = at::get_num_threads();
  const bool pin = threads > 0 && threads != before;
  if (pin) omp_set_num_threads(static_cast<int>(threads));
  try {
    op_handle().call(out, x, w13, w2, b13, b2, tw, ids, skip, act, s13, s2, kOpName);
  } catch (...) {
    if (pin) omp_set_num_threads(before);
    throw;
  }
  if (pin) omp_set_num_threads(before);
}

class FastCall {
 public:
  FastCall(at::Tensor w13, at::Tensor w2, OptTensor b13, OptTensor b2, std::string act,
           int64_t hidden, int64_t top_k, int64_t experts, at::ScalarType dtype,
           std::vector<at::Tensor> watched, std::vector<int64_t> versions, OptTensor s13,
           OptTensor s2, int64_t threads)
      : w13_(std::move(w13)), w2_(std::move(w2)), b13_(std::move(b13)), b2_(std::move(b2)),
        s13_(std::move(s13)), s2_(std::move(s2)), act_(std::move(act)), threads_(threads),
        // The op silently returns wrong numbers for an id repeated in a row; it checks the
        // range too, but its error is not the layer's typed one.
        spec_(hidden, top_k, experts, dtype, std::move(watched), std::move(versions),
              /*reject_repeated_ids=*/true) {
    TORCH_CHECK(top_k > 1 && experts > 1, "FastCall: a plain config");
    op_handle();  // resolve now: a missing op fails here, at prepare(), not at a forward
  }

  // The output, or None when the call is not the plain case (the caller's Python path
  // then handles it, errors included).
  py::object operator()(py::handle x, py::handle tw, py::handle ids) const {
    const std::optional<PlainCall> call = PlainCall::check(spec_, x, tw, ids);
    if (!call) return py::none();
    at::Tensor out = moe_dispatch::new_output(*call->x);
    call_op_locked(out, *call->x, w13_, w2_, b13_, b2_, call->topk_weights, call->topk_ids,
                   false, act_, s13_, s2_, threads_);
    return moe_dispatch::wrap(std::move(out));
  }

 private:
  at::Tensor w13_, w2_;
  OptTensor b13_, b2_, s13_, s2_;
  std::string act_;
  int64_t threads_;
  PlainSpec spec_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe-dispatch: the zentorch backend's native decode path";
  m.def("run_op", &call_op_locked, "The op under the process-wide op mutex, without the GIL.",
        py::arg("out"), py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("w13_bias"),
        py::arg("w2_bias"), py::arg("topk_weights"), py::arg("topk_ids"),
        py::arg("skip_weighted"), py::arg("act"), py::arg("w13_scales") = py::none(),
        py::arg("w2_scales") = py::none(), py::arg("threads") = 0);
  py::class_<FastCall>(m, "FastCall")
      .def(py::init<at::Tensor, at::Tensor, OptTensor, OptTensor, std::string, int64_t,
                    int64_t, int64_t, at::ScalarType, std::vector<at::Tensor>,
                    std::vector<int64_t>, OptTensor, OptTensor, int64_t>(),
           py::arg("w13"), py::arg("w2"), py::arg("w13_bias"), py::arg("w2_bias"),
           py::arg("act"), py::arg("hidden"), py::arg("top_k"), py::arg("experts"),
           py::arg("dtype"), py::arg("watched"), py::arg("versions"),
           py::arg("w13_scales") = py::none(), py::arg("w2_scales") = py::none(),
           py::arg("threads") = 0)
      .def("entry", [](const FastCall& f) { return moe_dispatch::entry_function(f); },
           "The entry as a CPython function (the layer calls it on every plain call).");
}
