// Python callables as CUDA host callbacks (cudaLaunchHostFunc), capturable in CUDA graphs,
// plus the GIL-free waits that keep them deadlock-free. Also the Python bindings of the fused
// mask kernel in mask.cu and the token gate in gate.cu (one extension module,
// `structgen_csrc`, built from all three files).
//
// Why: a guided speculative step wants the grammar work (advance matchers, fill the next
// bitmask) ordered *inside* one CUDA graph with the GPU work, instead of the host waiting for
// the GPU, doing the work, and launching again. A host node in a graph runs a C function on a
// CUDA-internal thread each time the graph replays; this file makes that function call Python.
//
// Lifetime of the argument block (`HostCall`: the callable and its args, one reference each):
//   - not capturing: the callback runs once, then drops the references and frees the block;
//   - capturing: the host node keeps a raw pointer that every replay uses, so the block lives
//     in a registry until `release(id)` / `release_all()` (the Python loader calls the latter
//     at exit) - release only once no graph that captured it will replay again.
//
// Deadlock-free rules (see docs/kernels.md): the callback takes the GIL (PyGILState_Ensure),
// so (1) the main thread must not hold the GIL while it blocks on the GPU - use the waits
// below, which drop it, never an implicit sync such as `.item()` behind a pending callback;
// (2) callbacks make no CUDA calls (CUDA forbids them there; with the GIL they can also hang);
// (3) what a callback reads of request state is a snapshot queued per iteration.

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace py = pybind11;

// Defined in mask.cu (raw pointers; returns a cudaError_t).
int sg_mask_apply(void* logits, int dtype, int64_t rows, int64_t vocab, int64_t logits_stride,
                  const int32_t* bitmask, int64_t bitmask_stride, int64_t bitmask_words,
                  const void* flags, int flag_kind, const void* d2t, int d2t_is64,
                  const float* temperature, int64_t* argmax_out, void* workspace, int write,
                  void* stream);

// Defined in gate.cu: a captured graph behind a conditional node the device decides.
uintptr_t sg_token_gate_build(uintptr_t body, uintptr_t row, uintptr_t tokens, uintptr_t has_mask,
                              uintptr_t quiet, int64_t vocab, uintptr_t check);
void sg_gate_destroy(uintptr_t exec);

// Defined in int4_gemv.cu (raw pointers; returns a cudaError_t).
int sg_int4_gemv(const int32_t* words, int64_t word_stride, int64_t units, const void* scales,
                 const void* offsets, int64_t scale_stride, int group_shift, int scales_half,
                 int offsets_half, const void* x, int64_t x_stride, int rows, const void* bias, void* y,
                 int64_t y_stride, int64_t n, int pdl, void* stream);

namespace {

struct HostCall {
  PyObject* fn;
  PyObject* args;
  bool captured;
};

std::mutex g_mutex;                                 // guards g_captured and g_next_id
std::unordered_map<uint64_t, HostCall*> g_captured;  // id -> block kept alive for replays
uint64_t g_next_id = 1;
std::atomic<uint64_t> g_calls{0};     // callbacks that ran (successful or not)
std::atomic<uint64_t> g_errors{0};    // callbacks whose Python call raised
std::atomic<bool> g_shutdown{false};  // set at interpreter exit: callbacks become no-ops

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

void free_block(HostCall* call) {  // caller holds the GIL
  Py_XDECREF(call->fn);
  Py_XDECREF(call->args);
  delete call;
}

// Runs on a CUDA-internal thread, in stream order. Never calls CUDA.
void CUDART_CB trampoline(void* data) {
  auto* call = static_cast<HostCall*>(data);
  if (g_shutdown.load(std::memory_order_acquire) || !Py_IsInitialized()) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* result = PyObject_Call(call->fn, call->args, nullptr);
  if (result == nullptr) {
    g_errors.fetch_add(1, std::memory_order_relaxed);
    PyErr_WriteUnraisable(call->fn);  // nobody to raise to here; the decorator records errors
  } else {
    Py_DECREF(result);
  }
  g_calls.fetch_add(1, std::memory_order_release);
  if (!call->captured) free_block(call);
  PyGILState_Release(gil);
}

// Enqueue fn(*args) on `stream`. Returns the block's id when the stream is capturing (keep it
// to release the block later), 0 otherwise.
uint64_t launch(py::object fn, py::tuple args, uintptr_t stream) {
  if (!PyCallable_Check(fn.ptr())) throw py::type_error("hostfunc.launch: fn must be callable");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(s, &status), "cudaStreamIsCapturing");
  if (status == cudaStreamCaptureStatusInvalidated)
    throw std::runtime_error("hostfunc.launch: the stream's capture was invalidated");
  const bool captured = status == cudaStreamCaptureStatusActive;
  auto* call = new HostCall{fn.inc_ref().ptr(), args.inc_ref().ptr(), captured};
  uint64_t id = 0;
  if (captured) {
    std::lock_guard<std::mutex> lock(g_mutex);
    id = g_next_id++;
    g_captured[id] = call;
  }
  // We hold the GIL, so an uncaptured callback that starts at once waits for us to return.
  const cudaError_t err = cudaLaunchHostFunc(s, trampoline, call);
  if (err != cudaSuccess) {
    if (captured) {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_captured.erase(id);
    }
    free_block(call);
    check(err, "cudaLaunchHostFunc");
  }
  return id;
}

bool release(uint64_t id) {
  HostCall* call = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_captured.find(id);
    if (it == g_captured.end()) return false;
    call = it->second;
    g_captured.erase(it);
  }
  free_block(call);
  return true;
}

size_t release_all() {
  std::unordered_map<uint64_t, HostCall*> blocks;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    blocks.swap(g_captured);
  }
  for (auto& kv : blocks) free_block(kv.second);
  return blocks.size();
}

size_t captured_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_captured.size();
}

// The waits: each drops the GIL so a pending callback can take it.
void stream_synchronize(uintptr_t stream) {
  cudaError_t err;
  {
    py::gil_scoped_release nogil;
    err = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  }
  check(err, "cudaStreamSynchronize");
}

void event_synchronize(uintptr_t event) {
  cudaError_t err;
  {
    py::gil_scoped_release nogil;
    err = cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event));
  }
  check(err, "cudaEventSynchronize");
}

void device_synchronize() {
  cudaError_t err;
  {
    py::gil_scoped_release nogil;
    err = cudaDeviceSynchronize();
  }
  check(err, "cudaDeviceSynchronize");
}

// cudaGraphLaunch of an instantiated graph (torch's CUDAGraph.raw_cuda_graph_exec()). Launches
// are asynchronous but can block when the launch queue is full, so the GIL goes here too.
void graph_launch(uintptr_t graph_exec, uintptr_t stream) {
  cudaError_t err;
  {
    py::gil_scoped_release nogil;
    err = cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(graph_exec),
                          reinterpret_cast<cudaStream_t>(stream));
  }
  check(err, "cudaGraphLaunch");
}

// Up to two async copies between pinned host memory and the device (nbytes 0: none; direction
// from the pointers), in one call: the decode graphs' per-step uploads and the tokens' download.
// From Python each is a torch copy_, slow on a cold host right after a wait for the device, and
// one of them is on the path between a step's tokens and the next forward (docs/performance.md,
// "Jump-forward").
void copy_async(uintptr_t dst0, uintptr_t src0, int64_t nbytes0, uintptr_t dst1, uintptr_t src1,
                int64_t nbytes1, uintptr_t stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  cudaError_t err = cudaSuccess;
  if (nbytes0 > 0)
    err = cudaMemcpyAsync(reinterpret_cast<void*>(dst0), reinterpret_cast<const void*>(src0),
                          static_cast<size_t>(nbytes0), cudaMemcpyDefault, s);
  if (err == cudaSuccess && nbytes1 > 0)
    err = cudaMemcpyAsync(reinterpret_cast<void*>(dst1), reinterpret_cast<const void*>(src1),
                          static_cast<size_t>(nbytes1), cudaMemcpyDefault, s);
  check(err, "copy_async");
}

// A copy on a side stream that the main stream then waits for (the grammar mask's upload while
// the forward runs): cudaMemcpyAsync on side, cudaEventRecord on side, cudaStreamWaitEvent on main.
void side_copy(uintptr_t dst, uintptr_t src, int64_t nbytes, uintptr_t side, uintptr_t event, uintptr_t main) {
  auto ss = reinterpret_cast<cudaStream_t>(side);
  auto ev = reinterpret_cast<cudaEvent_t>(event);
  cudaError_t err = cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                    static_cast<size_t>(nbytes), cudaMemcpyDefault, ss);
  if (err == cudaSuccess) err = cudaEventRecord(ev, ss);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(main), ev, 0);
  check(err, "side_copy");
}

void mask_apply(uintptr_t logits, int dtype, int64_t rows, int64_t vocab, int64_t logits_stride,
                uintptr_t bitmask, int64_t bitmask_stride, int64_t bitmask_words, uintptr_t flags,
                int flag_kind, uintptr_t d2t, int d2t_is64, uintptr_t temperature,
                uintptr_t argmax_out, uintptr_t workspace, int write, uintptr_t stream) {
  const int err = sg_mask_apply(
      reinterpret_cast<void*>(logits), dtype, rows, vocab, logits_stride,
      reinterpret_cast<const int32_t*>(bitmask), bitmask_stride, bitmask_words,
      reinterpret_cast<const void*>(flags), flag_kind, reinterpret_cast<const void*>(d2t),
      d2t_is64, reinterpret_cast<const float*>(temperature),
      reinterpret_cast<int64_t*>(argmax_out), reinterpret_cast<void*>(workspace), write,
      reinterpret_cast<void*>(stream));
  check(static_cast<cudaError_t>(err), "structgen mask kernel launch");
}

void int4_gemv(uintptr_t words, int64_t word_stride, int64_t units, uintptr_t scales, uintptr_t offsets,
               int64_t scale_stride, int group_shift, int scales_half, int offsets_half, uintptr_t x,
               int64_t x_stride, int rows, uintptr_t bias, uintptr_t y, int64_t y_stride, int64_t n, int pdl,
               uintptr_t stream) {
  const int err = sg_int4_gemv(reinterpret_cast<const int32_t*>(words), word_stride, units,
                               reinterpret_cast<const void*>(scales), reinterpret_cast<const void*>(offsets),
                               scale_stride, group_shift, scales_half, offsets_half,
                               reinterpret_cast<const void*>(x), x_stride, rows, reinterpret_cast<const void*>(bias),
                               reinterpret_cast<void*>(y), y_stride, n, pdl, reinterpret_cast<void*>(stream));
  check(static_cast<cudaError_t>(err), "structgen int4 GEMV launch");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "structgen CUDA extension: host callbacks in CUDA graphs, fused grammar mask";
  m.def("launch", &launch, py::arg("fn"), py::arg("args"), py::arg("stream"),
        "Enqueue fn(*args) as a host callback on `stream`; returns the captured block's id or 0.");
  m.def("release", &release, py::arg("id"), "Free one captured callback block; False if unknown.");
  m.def("release_all", &release_all, "Free every captured callback block; returns how many.");
  m.def("captured_count", &captured_count, "Captured callback blocks still alive.");
  m.def("calls", [] { return g_calls.load(std::memory_order_acquire); },
        "Host callbacks run so far.");
  m.def("errors", [] { return g_errors.load(std::memory_order_acquire); },
        "Host callbacks whose Python call raised.");
  m.def("shutdown", [] { g_shutdown.store(true, std::memory_order_release); },
        "Make later callbacks no-ops (interpreter exit).");
  m.def("stream_synchronize", &stream_synchronize, py::arg("stream"));
  m.def("event_synchronize", &event_synchronize, py::arg("event"));
  m.def("device_synchronize", &device_synchronize);
  m.def("graph_launch", &graph_launch, py::arg("graph_exec"), py::arg("stream"));
  m.def("copy_async", &copy_async, py::arg("dst0"), py::arg("src0"), py::arg("nbytes0"), py::arg("dst1"),
        py::arg("src1"), py::arg("nbytes1"), py::arg("stream"),
        "Up to two async copies to or from pinned memory (nbytes 0: skipped) on stream.");
  m.def("side_copy", &side_copy, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("side"),
        py::arg("event"), py::arg("main"), "Copy on stream side, record event there; main waits for it.");
  m.def("token_gate_build", &sg_token_gate_build, py::arg("body"), py::arg("row"), py::arg("tokens"),
        py::arg("has_mask"), py::arg("quiet"), py::arg("vocab"), py::arg("check"),
        "Instantiate [token gate] -> IF(grammar row with a quiet token) { body graph }.");
  m.def("gate_destroy", &sg_gate_destroy, py::arg("exec"));
  m.def("mask_apply", &mask_apply, py::arg("logits"), py::arg("dtype"), py::arg("rows"),
        py::arg("vocab"), py::arg("logits_stride"), py::arg("bitmask"), py::arg("bitmask_stride"),
        py::arg("bitmask_words"), py::arg("flags"), py::arg("flag_kind"), py::arg("d2t"),
        py::arg("d2t_is64"), py::arg("temperature"), py::arg("argmax_out"),
        py::arg("workspace"), py::arg("write"), py::arg("stream"));
  m.def("int4_gemv", &int4_gemv, py::arg("words"), py::arg("word_stride"), py::arg("units"), py::arg("scales"),
        py::arg("offsets"), py::arg("scale_stride"), py::arg("group_shift"), py::arg("scales_half"),
        py::arg("offsets_half"), py::arg("x"), py::arg("x_stride"), py::arg("rows"), py::arg("bias"), py::arg("y"),
        py::arg("y_stride"), py::arg("n"), py::arg("pdl"), py::arg("stream"),
        "y = x @ W.T (+ bias) for 1-4 bf16 rows of x and int4 words (csrc/int4_gemv.cu).");
}
