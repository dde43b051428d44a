// Stream flags for the doorbell of host-driven backends, and graph-capture
// helpers. CUDA's cuStreamWriteValue32 / cuStreamWaitValue32 are resolved
// from libcuda at run time (nothing links the driver at build time); HIP has
// hipStreamWriteValue32 / hipStreamWaitValue32. Where those are missing or
// refused, or MORI_TORCH_STREAM_FLAGS=spin, one-thread kernels do the same
// job (stream_kernels.cu). ReleaseWithCapturedGraph ties a callback to the
// graph being captured with a graph user object.
#include <cstdlib>
#include <cstring>

#include "base/config_table.h"
#include "base/error.h"
#include "gpu/stream_ops.h"

#if MORI_WITH_GPU
#include <dlfcn.h>

#include <atomic>

#include "gpu/vendor.h"
#endif

namespace mori_torch {
namespace gpu {

// Spin-kernel flags, defined in stream_kernels.cu.
void LaunchFlagWriteKernel(Stream s, uint32_t* device_flag, uint32_t value);
void LaunchFlagWaitKernel(Stream s, const uint32_t* device_flag, uint32_t value);

#if MORI_WITH_GPU
namespace {

void Check(gpuError_t e, const char* what) {
  if (e != gpuSuccess) {
    (void)gpuGetLastError();
    throw Error(StatusCode::ERR_GPU_OP, std::string(what) + ": " + gpuGetErrorString(e));
  }
}

bool SpinForcedByEnv() { return config::EnvInt("MORI_TORCH_STREAM_FLAGS") == 1; }  // "spin"

#if MORI_HIP
using Memops = bool;  // HIP always declares the calls
#else
// CUresult cuStreamWriteValue32_v2(CUstream, CUdeviceptr, cuuint32_t, unsigned)
using StreamValueFn = int (*)(void*, unsigned long long, uint32_t, unsigned int);
constexpr unsigned int kWaitValueEq = 0x1;  // CU_STREAM_WAIT_VALUE_EQ
struct Memops {
  StreamValueFn write = nullptr;
  StreamValueFn wait = nullptr;
};
Memops ResolveMemops() {
  Memops m;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return m;
  m.write = reinterpret_cast<StreamValueFn>(dlsym(lib, "cuStreamWriteValue32_v2"));
  m.wait = reinterpret_cast<StreamValueFn>(dlsym(lib, "cuStreamWaitValue32_v2"));
  if (!m.write || !m.wait) m.write = m.wait = nullptr;
  return m;
}
#endif

// Cleared for good the first time the driver refuses a memory operation.
std::atomic<bool> memops_usable{true};

bool UseMemops() {
  static const bool forced_spin = SpinForcedByEnv();
  if (forced_spin || !memops_usable.load(std::memory_order_relaxed)) return false;
#if MORI_HIP
  return true;
#else
  static const Memops m = ResolveMemops();
  return m.write != nullptr;
#endif
}

// Runs one memory operation; false (and spin kernels from now on) when the
// driver does not support it.
bool TryMemop(bool write, Stream s, uint32_t* device_flag, uint32_t value) {
#if MORI_HIP
  hipError_t e =
      write ? hipStreamWriteValue32(static_cast<hipStream_t>(s), device_flag, value, 0)
            : hipStreamWaitValue32(static_cast<hipStream_t>(s), device_flag, value, hipStreamWaitValueEq, 0xFFFFFFFFu);
  if (e == hipErrorNotSupported || e == hipErrorInvalidValue) {
    (void)hipGetLastError();
    memops_usable.store(false);
    return false;
  }
  Check(e, write ? "hipStreamWriteValue32" : "hipStreamWaitValue32");
  return true;
#else
  static const Memops m = ResolveMemops();
  const auto addr = reinterpret_cast<unsigned long long>(device_flag);
  int rc = write ? m.write(s, addr, value, 0) : m.wait(s, addr, value, kWaitValueEq);
  constexpr int kNotSupported = 801;  // CUDA_ERROR_NOT_SUPPORTED
  if (rc == kNotSupported) {
    memops_usable.store(false);
    return false;
  }
  if (rc != 0) {
    throw Error(StatusCode::ERR_GPU_OP, std::string(write ? "cuStreamWriteValue32" : "cuStreamWaitValue32") +
                                            " failed with CUresult " + std::to_string(rc));
  }
  return true;
#endif
}

}  // namespace

uint32_t* DeviceFlag(uint32_t* flag) { return reinterpret_cast<uint32_t*>(DevicePointerOfPinned(flag)); }

void StreamWriteFlag(Stream s, uint32_t* flag, uint32_t value) {
  uint32_t* d = DeviceFlag(flag);
  if (UseMemops() && TryMemop(true, s, d, value)) return;
  LaunchFlagWriteKernel(s, d, value);
}

void StreamWaitFlag(Stream s, uint32_t* flag, uint32_t value) {
  uint32_t* d = DeviceFlag(flag);
  if (UseMemops() && TryMemop(false, s, d, value)) return;
  LaunchFlagWaitKernel(s, d, value);
}

std::string StreamFlagMechanism() { return UseMemops() ? "memops" : "spin"; }

bool StreamIsCapturing(Stream s) {
#if MORI_HIP
  hipStreamCaptureStatus st = hipStreamCaptureStatusNone;
  Check(hipStreamIsCapturing(static_cast<hipStream_t>(s), &st), "StreamIsCapturing");
  return st != hipStreamCaptureStatusNone;
#else
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  Check(cudaStreamIsCapturing(static_cast<cudaStream_t>(s), &st), "StreamIsCapturing");
  return st != cudaStreamCaptureStatusNone;
#endif
}

namespace {
#if MORI_GPU_USER_OBJECTS
// What a graph's user object points at. `armed` is cleared when the graph
// could not take the reference, so the release that follows only frees this.
struct GraphHook {
  void (*release)(void*);
  void* context;
  std::atomic<bool> armed{true};
};

// The user object's destructor: a driver thread, no CUDA call allowed.
void RunGraphHook(void* p) {
  auto* hook = static_cast<GraphHook*>(p);
  if (hook->armed.load(std::memory_order_acquire)) hook->release(hook->context);
  delete hook;
}
#endif
}  // namespace

bool ReleaseWithCapturedGraph(Stream s, void (*release)(void*), void* context) {
#if MORI_GPU_USER_OBJECTS
  gpuStreamCaptureStatus status{};
  gpuGraph_t graph = nullptr;
  if (gpuStreamGetCaptureGraph(static_cast<gpuStream_t>(s), &status, &graph) != gpuSuccess) {
    (void)gpuGetLastError();
    return false;
  }
  if (status != gpuStreamCaptureStatusActive || !graph) return false;
  RelaxedCaptureScope relaxed;  // none of these is a stream call, but never risk the capture
  auto* hook = new GraphHook{release, context};
  gpuUserObject_t object;
  if (gpuUserObjectCreate(&object, hook, RunGraphHook, 1, gpuUserObjectNoDestructorSync) != gpuSuccess) {
    (void)gpuGetLastError();
    delete hook;
    return false;
  }
  // Moves this thread's reference to the graph: the graph alone owns it.
  if (gpuGraphRetainUserObject(graph, object, 1, gpuGraphUserObjectMove) != gpuSuccess) {
    (void)gpuGetLastError();
    hook->armed.store(false, std::memory_order_release);
    (void)gpuUserObjectRelease(object, 1);  // RunGraphHook, now or later, only deletes the hook
    (void)gpuGetLastError();
    return false;
  }
  return true;
#else
  // HIP 5.2 has no graph user objects: captured doorbell slots stay watched
  // for the life of the process (the caller's fallback).
  (void)s;
  (void)release;
  (void)context;
  return false;
#endif
}

namespace {
int ExchangeCaptureMode(int mode) {
  auto m = static_cast<gpuStreamCaptureMode>(mode);
  if (gpuThreadExchangeStreamCaptureMode(&m) != gpuSuccess) (void)gpuGetLastError();
  return static_cast<int>(m);
}
constexpr int kRelaxed = gpuStreamCaptureModeRelaxed;
}  // namespace

RelaxedCaptureScope::RelaxedCaptureScope() : previous_(ExchangeCaptureMode(kRelaxed)) {}
RelaxedCaptureScope::~RelaxedCaptureScope() { (void)ExchangeCaptureMode(previous_); }

#else  // CPU-only build

void StreamWriteFlag(Stream, uint32_t*, uint32_t) {
  throw Error(StatusCode::ERR_GPU_OP, "StreamWriteFlag: this build has no GPU support");
}
void StreamWaitFlag(Stream, uint32_t*, uint32_t) {
  throw Error(StatusCode::ERR_GPU_OP, "StreamWaitFlag: this build has no GPU support");
}
std::string StreamFlagMechanism() { return "none"; }
bool StreamIsCapturing(Stream) { return false; }
bool ReleaseWithCapturedGraph(Stream, void (*)(void*), void*) { return false; }
void LaunchPackOffsets(const int64_t*, int64_t, int64_t, int64_t*, Stream) {
  throw Error(StatusCode::ERR_GPU_OP, "LaunchPackOffsets: this build has no GPU support");
}

void LaunchStreamCopy(const StreamCopyArgs&, Stream) {
  throw Error(StatusCode::ERR_GPU_OP, "LaunchStreamCopy: this build has no GPU support");
}
void WarmUpStreamKernels(int) {}
void LaunchFlagWriteKernel(Stream, uint32_t*, uint32_t) {}
void LaunchFlagWaitKernel(Stream, const uint32_t*, uint32_t) {}
RelaxedCaptureScope::RelaxedCaptureScope() : previous_(0) {}
RelaxedCaptureScope::~RelaxedCaptureScope() {}

#endif

}  // namespace gpu
}  // namespace mori_torch
