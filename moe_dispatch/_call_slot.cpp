// MoELayer's call slot: the fast branch of LayerCalls.__call__ (_layer_calls.py) in C, set as
// the class's tp_call by _call_slot.py. Why: at decode every line between two kernel calls
// runs cold: measured on a Zen 3 after a 128 MiB read, paired in one process, the Python
// __call__ cost 20 us over calling the native entry itself on a layer too small to stream
// (benchmarks/bench_call_cost.py) and 26-44 us at E=8 top-2 H=1024 I=1408 and E=64 top-8
// H=2048 I=768 (int8, int4 g128, T=1); this slot 9 us there and 15-20 here.
//
// The contract: the slot runs a call's native entry only when the Python __call__ would have
// (same checks, same order, apart from dynamo's, below), hands every other call to the
// Python __call__ itself, and a call the entry declines or fails to the same methods as the
// Python __call__ does (_without_entry, _entry_failed). So this file holds no policy: only
// the checks that let a plain call skip the interpreter.
//
// Why no dynamo check (the Python __call__'s first line): dynamo never calls tp_call. It
// traces the Python __call__, which stays in the class's dict (type(layer).__call__), and
// this code runs only when a call is executed for real, where is_dynamo_compiling() is False.
// One difference remains: a call run for real while torch.compile is active (code under
// torch._dynamo.disable(recursive=False), a frame dynamo gave up on) runs the entry here,
// where dynamo would have compiled the Python __call__'s frame on its own (its custom op):
// the same result, one compiled frame less. And an entry's exception that _entry_failed
// re-raises has no __call__ frame in its traceback.
// Only the PyObject C API: no torch headers, so it builds in seconds.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <initializer_list>

namespace {

PyTypeObject* cls_ = nullptr;        // the class whose slot this is (MoELayer)
ternaryfunc python_slot_ = nullptr;  // its slot before (CPython's, which calls __call__)
PyObject* python_call_ = nullptr;    // LayerCalls.__call__
PyObject* global_hooks_[4] = {};     // nn.Module's process-wide hook dicts
PyObject* compiler_ = nullptr;       // the object whose _is_compiling_flag the Python path reads
PyObject* compiler_dict_ = nullptr;  // its __dict__ where it is a plain module (borrowed from it)
PyObject* tensor_ = nullptr;         // torch.Tensor
unsigned long long taken_ = 0;       // calls this slot ran to the end (the tests read it)

enum Name { kPlan, kOwn, kForward, kRun, kCompiled, kHook0, kFlag = kHook0 + 4, kWatched, kSingle,
            kNatives, kFailed, kWithout, kShape, kCall, kNames };
const char* const kNameText[kNames] = {
    "_plan", "_own_forward", "forward", "run", "_compiled_call_impl", "_forward_hooks",
    "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_is_compiling_flag",
    "watched", "single", "natives", "_entry_failed", "_without_entry", "shape", "__call__"};
PyObject* names_[kNames] = {};

// The Python __call__ with the call's own arguments.
PyObject* python_path(PyObject* self, PyObject* args, PyObject* kwargs) {
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  PyObject* full = PyTuple_New(n + 1);
  if (full == nullptr) return nullptr;
  Py_INCREF(self);
  PyTuple_SET_ITEM(full, 0, self);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    Py_INCREF(a);
    PyTuple_SET_ITEM(full, i + 1, a);
  }
  PyObject* out = PyObject_Call(python_call_, full, kwargs);
  Py_DECREF(full);
  return out;
}

// d[key] is a dict (nn.Module's OrderedDicts are) and empty.
bool no_hooks(PyObject* d, Name key) {
  PyObject* h = PyDict_GetItemWithError(d, names_[key]);
  return h != nullptr && PyDict_Check(h) && PyDict_GET_SIZE(h) == 0;
}

// What the Python __call__ checks before it reads the plan: the instance's own plan, no
// forward or run of the instance or a subclass, not compiled by nn.Module.compile(), no hook
// of the module or of the process, not inside a compile session. A new reference (the flag
// may be a Python property, during which another thread may swap the plan); null: not plain.
PyObject* plain_plan(PyObject* d) {
  PyObject* plan = PyDict_GetItemWithError(d, names_[kPlan]);
  if (plan == nullptr || plan == Py_None || PyDict_GetItemWithError(d, names_[kOwn]) != Py_True)
    return nullptr;
  for (const Name key : {kForward, kRun, kCompiled})
    if (PyDict_Contains(d, names_[key]) != 0) return nullptr;  // present, or an error
  for (int i = 0; i < 4; ++i)
    if (!no_hooks(d, static_cast<Name>(kHook0 + i)) || PyDict_GET_SIZE(global_hooks_[i]) != 0)
      return nullptr;
  Py_INCREF(plan);
  // A plain module's attribute is its dict's item (ModuleType defines no such name): read
  // there, the flag costs one dict lookup, where the attribute lookup first looks the name up
  // on the type (its attribute cache, cold; the MRO's dicts on a miss): 2.7 us of a cold
  // call's 7 before the entry, 1.8 read from the dict (probe builds, Zen 5, C1 int4 T=1).
  PyObject* flag = compiler_dict_ != nullptr ? PyDict_GetItemWithError(compiler_dict_, names_[kFlag]) : nullptr;
  if (flag != nullptr) Py_INCREF(flag);
  else if (PyErr_Occurred() == nullptr) flag = PyObject_GetAttr(compiler_, names_[kFlag]);
  const int compiling = flag != nullptr ? PyObject_IsTrue(flag) : -1;
  Py_XDECREF(flag);
  if (compiling == 0) return plan;
  Py_DECREF(plan);
  return nullptr;
}

// ExecutionPlan.native_for(x) as __call__ reads it: plan.single, else the bucket of x's
// rows in plan.natives. A new reference, or null (no entry: the Python path).
PyObject* entry_pair(PyObject* plan, PyObject* x) {
  PyObject* watched = PyObject_GetAttr(plan, names_[kWatched]);
  const int watching = watched != nullptr ? PyObject_IsTrue(watched) : -1;
  Py_XDECREF(watched);
  if (watching != 1) return nullptr;
  PyObject* pair = PyObject_GetAttr(plan, names_[kSingle]);
  if (pair != Py_None) return pair;
  Py_DECREF(pair);
  PyObject* natives = PyObject_GetAttr(plan, names_[kNatives]);
  PyObject* found = nullptr;
  if (natives != nullptr && PyTuple_Check(natives) && PyTuple_GET_SIZE(natives) > 0) {
    const Py_ssize_t n = PyTuple_GET_SIZE(natives);
    Py_ssize_t bucket = 0;  // _plan.bucket_index: the smallest power of two >= rows, clamped
    if (n > 1) {
      // As native_for: an exact torch.Tensor of two dimensions, rows from x.shape (a tuple of
      // ints; under torch.jit.trace its items are traced tensors, and the call goes to Python).
      bucket = -1;
      PyObject* shape = Py_TYPE(x) == reinterpret_cast<PyTypeObject*>(tensor_) ? PyObject_GetAttr(x, names_[kShape]) : nullptr;
      PyObject* first = shape != nullptr && PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 2
          ? PyTuple_GET_ITEM(shape, 0) : nullptr;
      const Py_ssize_t rows = first != nullptr && PyLong_CheckExact(first) ? PyLong_AsSsize_t(first) : -1;
      Py_XDECREF(shape);
      if (rows > 0) {
        bucket = 0;
        for (size_t v = static_cast<size_t>(rows - 1); v != 0; v >>= 1) ++bucket;
        if (bucket > n - 1) bucket = n - 1;
      }
    }
    if (bucket >= 0) {
      found = PyTuple_GET_ITEM(natives, bucket);
      Py_INCREF(found);
    }
  }
  Py_XDECREF(natives);
  return found;
}

// The entry raised: as the Python __call__, an Exception goes to self._entry_failed(route,
// exc, *args), which re-checks the input and falls back or raises; anything else propagates.
// It runs with exc as the exception being handled, as inside `except Exception as exc:`, so
// that what it raises has exc as its __context__ (and the caller's own, if any, is restored).
PyObject* entry_failed(PyObject* self, PyObject* args, PyObject* route) {
  if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
  PyObject *type, *exc, *tb;
  PyErr_Fetch(&type, &exc, &tb);
  PyErr_NormalizeException(&type, &exc, &tb);
  if (tb != nullptr) PyException_SetTraceback(exc, tb);
  PyObject* outer = PyErr_GetHandledException();
  PyErr_SetHandledException(exc);
  PyObject* out = PyObject_CallMethodObjArgs(self, names_[kFailed], route, exc, PyTuple_GET_ITEM(args, 0),
                                             PyTuple_GET_ITEM(args, 1), PyTuple_GET_ITEM(args, 2), nullptr);
  PyErr_SetHandledException(outer);
  Py_XDECREF(outer);
  Py_XDECREF(type);
  Py_XDECREF(exc);
  Py_XDECREF(tb);
  return out;
}

PyObject* layer_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  // A subclass's instance never gets here (its own slot calls __call__); checked all the same.
  if (Py_TYPE(self) != cls_ || (kwargs != nullptr && PyDict_GET_SIZE(kwargs) != 0) ||
      PyTuple_GET_SIZE(args) != 3)
    return python_path(self, args, kwargs);
  PyObject* d = PyObject_GenericGetDict(self, nullptr);
  PyObject* plan = d != nullptr ? plain_plan(d) : nullptr;
  // The plan is read before the entry runs: the entry releases the GIL, and another thread
  // may then swap the layer's plan (a demotion); the pair is our own.
  PyObject* pair = plan != nullptr ? entry_pair(plan, PyTuple_GET_ITEM(args, 0)) : nullptr;
  Py_XDECREF(plan);
  Py_XDECREF(d);
  if (pair == nullptr || !PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
    Py_XDECREF(pair);
    // A failed lookup is a reason to take the Python path, which raises what it must; a
    // KeyboardInterrupt or a MemoryError on the way propagates.
    if (PyErr_Occurred() != nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
      PyErr_Clear();
    }
    return python_path(self, args, kwargs);
  }
  PyObject* out = PyObject_Vectorcall(PyTuple_GET_ITEM(pair, 0), &PyTuple_GET_ITEM(args, 0), 3, nullptr);
  if (out == nullptr) {
    out = entry_failed(self, args, PyTuple_GET_ITEM(pair, 1));
    Py_DECREF(pair);
    return out;
  }
  Py_DECREF(pair);
  if (out != Py_None) {
    ++taken_;
    return out;
  }
  Py_DECREF(out);  // declined: the rest of the Python __call__
  PyObject* stack[4] = {self, PyTuple_GET_ITEM(args, 0), PyTuple_GET_ITEM(args, 1), PyTuple_GET_ITEM(args, 2)};
  return PyObject_VectorcallMethod(names_[kWithout], stack, 4, nullptr);
}

// install(cls, python_call, global_hooks, compiler, tensor): cls's slot becomes this one.
PyObject* install(PyObject*, PyObject* a) {
  PyObject *cls, *call, *hooks, *compiler, *tensor;
  if (!PyArg_ParseTuple(a, "O!OO!OO!", &PyType_Type, &cls, &call, &PyTuple_Type, &hooks, &compiler,
                        &PyType_Type, &tensor))
    return nullptr;
  if (PyTuple_GET_SIZE(hooks) != 4) {
    PyErr_SetString(PyExc_ValueError, "global_hooks: nn.Module's four hook dicts");
    return nullptr;
  }
  for (int i = 0; i < 4; ++i) {
    if (!PyDict_Check(PyTuple_GET_ITEM(hooks, i))) {
      PyErr_SetString(PyExc_TypeError, "global_hooks: dicts");
      return nullptr;
    }
  }
  if (cls_ != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the call slot is installed already");
    return nullptr;
  }
  cls_ = reinterpret_cast<PyTypeObject*>(cls);
  python_slot_ = cls_->tp_call;
  for (PyObject* o : {cls, call, compiler, tensor}) Py_INCREF(o);
  python_call_ = call, compiler_ = compiler, tensor_ = tensor;
  compiler_dict_ = PyModule_CheckExact(compiler) ? PyModule_GetDict(compiler) : nullptr;
  for (int i = 0; i < 4; ++i) Py_INCREF(global_hooks_[i] = PyTuple_GET_ITEM(hooks, i));
  cls_->tp_call = layer_call;
  PyType_Modified(cls_);
  Py_RETURN_NONE;
}

// set_active(on): this slot or CPython's (the tests compare the two paths). Never this one
// over a __call__ assigned on the class since install: the slot would skip it.
PyObject* set_active(PyObject*, PyObject* on) {
  const int value = PyObject_IsTrue(on);
  if (value < 0) return nullptr;
  if (cls_ == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the call slot is not installed");
    return nullptr;
  }
  if (value) {
    PyObject* call = PyObject_GetAttr(reinterpret_cast<PyObject*>(cls_), names_[kCall]);
    Py_XDECREF(call);
    if (call != python_call_) {
      if (call != nullptr)
        PyErr_SetString(PyExc_RuntimeError, "the class's __call__ is not the one the slot was "
                        "installed for: the Python __call__ runs every call");
      return nullptr;
    }
  }
  cls_->tp_call = value ? layer_call : python_slot_;
  PyType_Modified(cls_);
  Py_RETURN_NONE;
}

// active(): whether the class's slot is this one now (CPython resets it where __call__ is
// assigned on the class or a base, and then the Python __call__ runs every call).
PyObject* active(PyObject*, PyObject*) {
  return PyBool_FromLong(cls_ != nullptr && cls_->tp_call == layer_call);
}

PyObject* taken(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(taken_); }

PyMethodDef kMethods[] = {
    {"install", install, METH_VARARGS, "install(cls, python_call, global_hooks, compiler, tensor)"},
    {"set_active", set_active, METH_O, "set_active(on): this slot, or CPython's"},
    {"active", active, METH_NOARGS, "whether the class's call slot is this one"},
    {"taken", taken, METH_NOARGS, "calls this slot ran to the end, in this process"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "moe_dispatch_call_slot", nullptr, -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

#define MD_INIT2(name) PyInit_##name
#define MD_INIT(name) MD_INIT2(name)

PyMODINIT_FUNC MD_INIT(TORCH_EXTENSION_NAME)(void) {
  for (int i = 0; i < kNames; ++i)
    if ((names_[i] = PyUnicode_InternFromString(kNameText[i])) == nullptr) return nullptr;
  return PyModule_Create(&kModule);
}
