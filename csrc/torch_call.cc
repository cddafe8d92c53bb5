// XLA FFI handlers for t2j_ad's `torch_call` custom call.
//
// Every input and output buffer is wrapped as a DLPack tensor that points at
// XLA's memory (no copy). Python installs, with `set_dispatcher`,
//
//   * `wrap`: applied to each DLPack capsule (t2j_ad passes torch's
//     `_from_dlpack`); without it the capsules themselves are handed on;
//   * `runners`: a dict from key to a callable run as
//         runner(inputs: list, outputs: list, stream: int);
//   * `dispatcher`: run as dispatcher(key, inputs, outputs, stream) for a key
//     that `runners` does not hold.
//
// The runner table is the hot path: one dict lookup here instead of Python
// frames that look the key up (see NOTE [registry lifetime] in
// t2j_ad/backends/registry.py). The key is an opaque integer attribute of
// the custom call. It is only ever used to index Python's tables; nothing
// here turns it into a pointer, so a stale or forged key is a Python
// LookupError, never a crash. A Python exception comes back as an ffi::Error
// carrying the formatted traceback; nothing is thrown across the FFI boundary.

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "pybind11/pybind11.h"
#include "xla/ffi/api/ffi.h"

// NOTE [one build for CPU and GPU]
// The CUDA handler needs nothing from CUDA but the type of XLA's stream,
// which it passes on as an integer (PyTorch wraps it in
// torch.cuda.ExternalStream). The type is declared here exactly as
// cuda_runtime_api.h (driver_types.h) declares it, so every build, with or
// without a CUDA toolkit, contains the CUDA handler, links nothing from CUDA,
// and loads on machines without a GPU or driver. T2J_AD_NO_CUDA leaves it out.
#ifndef T2J_AD_NO_CUDA
typedef struct CUstream_st* cudaStream_t;
#endif

namespace ffi = xla::ffi;
namespace py = pybind11;

// DLPack's (frozen, pre-1.0 "dltensor") ABI, declared here so the build needs
// neither torch nor a dlpack checkout.
extern "C" {
struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4,
                 // kDLComplex 5, kDLBool 6
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // NULL: compact row-major, which is XLA's default layout
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
}

namespace {

constexpr int32_t kDLCPU = 1;
constexpr int32_t kDLCUDA = 2;
constexpr const char* kCapsuleName = "dltensor";

// Counts DLManagedTensors not yet freed, so tests can check nothing leaks.
std::atomic<int64_t> g_live_tensors{0};

// What set_dispatcher installed (strong references, guarded by the GIL;
// nullptr when unset).
PyObject* g_dispatcher = nullptr;
PyObject* g_runners = nullptr;  // a dict
PyObject* g_wrap = nullptr;

bool ToDLDataType(ffi::DataType t, DLDataType* out) {
  switch (t) {
    case ffi::DataType::PRED: *out = {6, 8, 1}; return true;
    case ffi::DataType::S8:   *out = {0, 8, 1}; return true;
    case ffi::DataType::S16:  *out = {0, 16, 1}; return true;
    case ffi::DataType::S32:  *out = {0, 32, 1}; return true;
    case ffi::DataType::S64:  *out = {0, 64, 1}; return true;
    case ffi::DataType::U8:   *out = {1, 8, 1}; return true;
    case ffi::DataType::U16:  *out = {1, 16, 1}; return true;
    case ffi::DataType::U32:  *out = {1, 32, 1}; return true;
    case ffi::DataType::U64:  *out = {1, 64, 1}; return true;
    case ffi::DataType::F16:  *out = {2, 16, 1}; return true;
    case ffi::DataType::F32:  *out = {2, 32, 1}; return true;
    case ffi::DataType::F64:  *out = {2, 64, 1}; return true;
    case ffi::DataType::BF16: *out = {4, 16, 1}; return true;
    case ffi::DataType::C64:  *out = {5, 64, 1}; return true;
    case ffi::DataType::C128: *out = {5, 128, 1}; return true;
    // The float8 formats both sides have (DLPack 1.1 type codes).
    case ffi::DataType::F8E4M3FN:   *out = {10, 8, 1}; return true;
    case ffi::DataType::F8E4M3FNUZ: *out = {11, 8, 1}; return true;
    case ffi::DataType::F8E5M2:     *out = {12, 8, 1}; return true;
    case ffi::DataType::F8E5M2FNUZ: *out = {13, 8, 1}; return true;
    case ffi::DataType::F8E8M0FNU:  *out = {14, 8, 1}; return true;
    default: return false;
  }
}

void FreeTensor(DLManagedTensor* t) {
  std::free(t);
  g_live_tensors.fetch_sub(1, std::memory_order_relaxed);
}

// A capsule nobody consumed still owns its tensor; a consumer renames it
// "used_dltensor" and calls the deleter itself when its tensor dies.
void CapsuleDestructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kCapsuleName)) {
    auto* t = static_cast<DLManagedTensor*>(
        PyCapsule_GetPointer(capsule, kCapsuleName));
    t->deleter(t);
  }
}

// Wraps one XLA buffer as a "dltensor" capsule. The shape is copied into the
// same allocation because the consumer may outlive this call's frame; the
// data is not copied (it stays XLA's, valid for the duration of the call).
ffi::ErrorOr<PyObject*> MakeCapsule(const ffi::AnyBuffer& buf, DLDevice device,
                                    const char* role, size_t index) {
  DLDataType dtype;
  if (!ToDLDataType(buf.element_type(), &dtype)) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string("t2j_ad: ") + role + " " + std::to_string(index) +
        " has XLA element type " +
        std::to_string(static_cast<int>(buf.element_type())) +
        ", which has no DLPack/PyTorch equivalent; cast it to a supported "
        "dtype (bool, (u)int8-64, float16/32/64, bfloat16, complex64/128) "
        "before calling the PyTorch function"));
  }
  auto dims = buf.dimensions();
  size_t rank = dims.size();
  auto* t = static_cast<DLManagedTensor*>(
      std::malloc(sizeof(DLManagedTensor) + rank * sizeof(int64_t)));
  if (t == nullptr) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kResourceExhausted,
                                      "t2j_ad: out of host memory"));
  }
  g_live_tensors.fetch_add(1, std::memory_order_relaxed);
  int64_t* shape = reinterpret_cast<int64_t*>(t + 1);
  for (size_t i = 0; i < rank; ++i) shape[i] = dims[i];
  t->dl_tensor = DLTensor{buf.untyped_data(), device, static_cast<int32_t>(rank),
                          dtype, shape, nullptr, 0};
  t->manager_ctx = nullptr;
  t->deleter = FreeTensor;
  PyObject* capsule = PyCapsule_New(t, kCapsuleName, CapsuleDestructor);
  if (capsule == nullptr) {
    FreeTensor(t);
    PyErr_Clear();
    return ffi::Unexpected(
        ffi::Error::Internal("t2j_ad: could not create a DLPack capsule"));
  }
  return capsule;
}

// Turns the pending Python exception into an ffi::Error holding the full
// `traceback.format_exception` text (type, message and traceback), and clears
// it. Uses only the C API, which cannot throw.
ffi::Error TakePythonError(int64_t key) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  std::string text;
  PyObject* mod = PyImport_ImportModule("traceback");
  PyObject* lines =
      mod ? PyObject_CallMethod(mod, "format_exception", "OOO",
                                type ? type : Py_None, value ? value : Py_None,
                                tb ? tb : Py_None)
          : nullptr;
  PyObject* empty = lines ? PyUnicode_FromString("") : nullptr;
  PyObject* joined = empty ? PyUnicode_Join(empty, lines) : nullptr;
  const char* utf8 = joined ? PyUnicode_AsUTF8(joined) : nullptr;
  if (utf8 != nullptr) {
    text = utf8;
  } else {
    PyErr_Clear();
    PyObject* s = value ? PyObject_Str(value) : nullptr;
    const char* msg = s ? PyUnicode_AsUTF8(s) : nullptr;
    text = msg ? msg : "<unprintable Python exception>";
    Py_XDECREF(s);
  }
  PyErr_Clear();
  Py_XDECREF(joined);
  Py_XDECREF(empty);
  Py_XDECREF(lines);
  Py_XDECREF(mod);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return ffi::Error(ffi::ErrorCode::kUnknown,
                    "t2j_ad: PyTorch call (key " + std::to_string(key) +
                        ") raised an exception:\n" + text);
}

ffi::ErrorOr<ffi::AnyBuffer> GetBuffer(const ffi::RemainingArgs& args,
                                       size_t i) {
  return args.get<ffi::AnyBuffer>(i);
}
ffi::ErrorOr<ffi::AnyBuffer> GetBuffer(const ffi::RemainingRets& rets,
                                       size_t i) {
  auto ret = rets.get<ffi::AnyBuffer>(i);
  if (!ret.has_value()) return ffi::Unexpected(ret.error());
  return **ret;
}

// A new list with one entry per buffer: the capsule, or wrap(capsule).
template <typename Buffers>
ffi::ErrorOr<PyObject*> MakeArgList(const Buffers& buffers, DLDevice device,
                                    const char* role, PyObject* wrap) {
  size_t n = buffers.size();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
  if (list == nullptr) {
    PyErr_Clear();
    return ffi::Unexpected(ffi::Error::Internal("t2j_ad: PyList_New failed"));
  }
  for (size_t i = 0; i < n; ++i) {
    auto buf = GetBuffer(buffers, i);
    auto capsule = buf.has_value() ? MakeCapsule(*buf, device, role, i)
                                   : ffi::ErrorOr<PyObject*>(
                                         ffi::Unexpected(buf.error()));
    if (!capsule.has_value()) {
      Py_DECREF(list);
      return ffi::Unexpected(capsule.error());
    }
    PyObject* item = *capsule;
    if (wrap != nullptr) {
      item = PyObject_CallOneArg(wrap, *capsule);
      Py_DECREF(*capsule);  // a consumer took ownership of the tensor
      if (item == nullptr) {
        Py_DECREF(list);
        return ffi::Unexpected(ffi::Error::Internal(""));  // error is pending
      }
    }
    PyList_SET_ITEM(list, i, item);  // steals the reference
  }
  return list;
}

// Calls the runner registered for `py_key`, or else the dispatcher. Returns
// a new reference, or nullptr with a Python exception pending.
PyObject* CallPython(PyObject* py_key, PyObject* inputs, PyObject* outputs,
                     PyObject* py_stream, PyObject* dispatcher,
                     PyObject* runners) {
  // A borrowed reference; nullptr with no exception when the key is absent.
  PyObject* runner =
      runners != nullptr ? PyDict_GetItemWithError(runners, py_key) : nullptr;
  if (runner != nullptr) {
    Py_INCREF(runner);  // the runner may drop its own table entry
    PyObject* argv[3] = {inputs, outputs, py_stream};
    PyObject* result = PyObject_Vectorcall(runner, argv, 3, nullptr);
    Py_DECREF(runner);
    return result;
  }
  if (PyErr_Occurred()) return nullptr;
  PyObject* argv[4] = {py_key, inputs, outputs, py_stream};
  return PyObject_Vectorcall(dispatcher, argv, 4, nullptr);
}

// A failure of MakeArgList: a Python exception if `wrap` raised, else the
// error it built.
ffi::Error ArgListError(int64_t key, const ffi::Error& error) {
  return PyErr_Occurred() ? TakePythonError(key) : error;
}

ffi::Error DispatchWithGil(int64_t key, const ffi::RemainingArgs& args,
                           const ffi::RemainingRets& rets, DLDevice device,
                           uintptr_t stream) {
  if (g_dispatcher == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "t2j_ad: no Python dispatcher is registered; import "
                      "t2j_ad.backends.ffi before running the computation");
  }
  // Local references: the Python code run below may call set_dispatcher.
  PyObject* dispatcher = g_dispatcher;
  PyObject* runners = g_runners;
  PyObject* wrap = g_wrap;
  Py_INCREF(dispatcher);
  Py_XINCREF(runners);
  Py_XINCREF(wrap);
  ffi::Error error = ffi::Error::Success();
  PyObject* py_key = PyLong_FromLongLong(key);
  PyObject* py_stream = PyLong_FromUnsignedLongLong(stream);
  PyObject* inputs = nullptr;
  PyObject* outputs = nullptr;
  if (py_key == nullptr || py_stream == nullptr) {
    error = TakePythonError(key);
  } else if (auto in = MakeArgList(args, device, "input", wrap);
             !in.has_value()) {
    error = ArgListError(key, in.error());
  } else {
    inputs = *in;
    if (auto out = MakeArgList(rets, device, "output", wrap);
        !out.has_value()) {
      error = ArgListError(key, out.error());
    } else {
      outputs = *out;
      PyObject* result =
          CallPython(py_key, inputs, outputs, py_stream, dispatcher, runners);
      if (result == nullptr) error = TakePythonError(key);
      Py_XDECREF(result);
    }
  }
  Py_XDECREF(inputs);
  Py_XDECREF(outputs);
  Py_XDECREF(py_key);
  Py_XDECREF(py_stream);
  Py_XDECREF(wrap);
  Py_XDECREF(runners);
  Py_DECREF(dispatcher);
  return error;
}

ffi::Error Dispatch(int64_t key, ffi::RemainingArgs args,
                    ffi::RemainingRets rets, DLDevice device,
                    uintptr_t stream) {
  if (!Py_IsInitialized()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "t2j_ad: the Python interpreter has shut down");
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  ffi::Error error = DispatchWithGil(key, args, rets, device, stream);
  PyGILState_Release(gil);
  return error;
}

ffi::Error TorchCallCpu(int64_t key, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  return Dispatch(key, args, rets, DLDevice{kDLCPU, 0}, 0);
}

#ifndef T2J_AD_NO_CUDA
// PyTorch runs on XLA's stream (the dispatcher wraps it in
// torch.cuda.ExternalStream), so no synchronisation is needed here.
ffi::Error TorchCallCuda(cudaStream_t stream, int32_t device_ordinal,
                         int64_t key, ffi::RemainingArgs args,
                         ffi::RemainingRets rets) {
  return Dispatch(key, args, rets, DLDevice{kDLCUDA, device_ordinal},
                  reinterpret_cast<uintptr_t>(stream));
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kTorchCallCpu, TorchCallCpu,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("key")
                                  .RemainingArgs()
                                  .RemainingRets());

#ifndef T2J_AD_NO_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(kTorchCallCuda, TorchCallCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("key")
                                  .RemainingArgs()
                                  .RemainingRets());
#endif

PYBIND11_MODULE(_ffi_ext, m) {
  m.doc() = "XLA FFI handlers that run PyTorch on XLA buffers (t2j_ad).";

  m.def(
      "handlers",
      [] {
        py::dict out;
        out["cpu"] = py::capsule(reinterpret_cast<void*>(kTorchCallCpu));
#ifndef T2J_AD_NO_CUDA
        out["CUDA"] = py::capsule(reinterpret_cast<void*>(kTorchCallCuda));
#endif
        return out;
      },
      "Platform name -> FFI handler capsule, for jax.ffi.register_ffi_target.");

  m.def(
      "set_dispatcher",
      [](py::object dispatcher, py::object runners, py::object wrap) {
        if (!dispatcher.is_none() && !PyCallable_Check(dispatcher.ptr())) {
          throw py::type_error("set_dispatcher: dispatcher must be a callable or None");
        }
        if (!runners.is_none() && !PyDict_CheckExact(runners.ptr())) {
          throw py::type_error("set_dispatcher: runners must be a dict or None");
        }
        if (!wrap.is_none() && !PyCallable_Check(wrap.ptr())) {
          throw py::type_error("set_dispatcher: wrap must be a callable or None");
        }
        auto take = [](PyObject** slot, const py::object& value) {
          PyObject* old = *slot;
          *slot = value.is_none() ? nullptr : value.inc_ref().ptr();
          Py_XDECREF(old);
        };
        take(&g_dispatcher, dispatcher);
        take(&g_runners, runners);
        take(&g_wrap, wrap);
      },
      py::arg("dispatcher"), py::kw_only(), py::arg("runners") = py::none(),
      py::arg("wrap") = py::none(),
      "Install dispatcher(key, inputs, outputs, stream), the key -> "
      "runner(inputs, outputs, stream) dict consulted first, and the callable "
      "applied to each DLPack capsule (None: pass capsules).");

  m.def(
      "live_tensors", [] { return g_live_tensors.load(); },
      "Number of DLPack tensors made by the handler and not yet freed.");

#ifndef T2J_AD_NO_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif

  // Drop the dispatcher before the interpreter tears modules down.
  py::module_::import("atexit").attr("register")(py::cpp_function([] {
    for (PyObject** slot : {&g_dispatcher, &g_runners, &g_wrap}) {
      PyObject* old = *slot;
      *slot = nullptr;
      Py_XDECREF(old);
    }
  }));
}
