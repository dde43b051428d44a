#include "gpu/gpu_runtime.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>

#include "base/error.h"

#if MORI_WITH_GPU
#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "gpu/vendor.h"
#endif

namespace mori_torch {
namespace gpu {

namespace {
std::atomic<uint64_t> g_pinned_bytes[2];
std::atomic<uint64_t>& PinnedCounter(PinnedUse use) { return g_pinned_bytes[use == PinnedUse::kBuffers ? 0 : 1]; }
}  // namespace

uint64_t PinnedBytes(PinnedUse use) { return PinnedCounter(use).load(std::memory_order_relaxed); }

#if MORI_WITH_GPU
namespace {

void Check(gpuError_t e, const char* what) {
  if (e != gpuSuccess) {
    (void)gpuGetLastError();  // clear the sticky-free error so later calls are not blamed
    throw Error(StatusCode::ERR_GPU_OP, std::string(what) + ": " + gpuGetErrorString(e));
  }
}

#if MORI_HIP
#define MORI_DMABUF_CALL "hipMemGetHandleForAddressRange"
#else
#define MORI_DMABUF_CALL "cuMemGetHandleForAddressRange"
#endif

#if !MORI_HIP
// cuMemGetAddressRange from the driver, resolved at run time so nothing links
// libcuda at build time.
using GetAddressRangeFn = int (*)(unsigned long long*, size_t*, unsigned long long);
GetAddressRangeFn AddressRangeFn() {
  static GetAddressRangeFn fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<GetAddressRangeFn>(dlsym(lib, "cuMemGetAddressRange_v2")) : nullptr;
  }();
  return fn;
}
#endif

void AllocationOf(uint64_t ptr, uint64_t* base, uint64_t* size) {
#if MORI_HIP
  hipDeviceptr_t b = nullptr;
  size_t s = 0;
  Check(hipMemGetAddressRange(&b, &s, reinterpret_cast<hipDeviceptr_t>(ptr)), "hipMemGetAddressRange");
  *base = reinterpret_cast<uint64_t>(b);
  *size = s;
#else
  auto fn = AddressRangeFn();
  if (!fn) throw Error(StatusCode::ERR_GPU_OP, "cannot resolve cuMemGetAddressRange_v2 from libcuda.so.1");
  unsigned long long b = 0;
  size_t s = 0;
  int rc = fn(&b, &s, ptr);
  if (rc != 0) throw Error(StatusCode::ERR_GPU_OP, "cuMemGetAddressRange failed with CUresult " + std::to_string(rc));
  *base = b;
  *size = s;
#endif
}

}  // namespace

bool Compiled() { return true; }

int DeviceCount() {
  int n = 0;
  if (gpuGetDeviceCount(&n) != gpuSuccess) {
    (void)gpuGetLastError();
    return 0;
  }
  return n;
}

DeviceRange DescribeDeviceRange(uint64_t ptr, uint64_t size) {
  gpuPointerAttributes attr{};
  gpuError_t e = gpuPointerGetAttributes(&attr, reinterpret_cast<void*>(ptr));
  if (e != gpuSuccess || !gpuPointerIsDevice(attr)) {
    (void)gpuGetLastError();
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "register_memory: " + std::to_string(ptr) + " is not device memory of this process");
  }
  DeviceRange r;
  r.device = attr.device;
  DeviceScope on(r.device);
  AllocationOf(ptr, &r.alloc_base, &r.alloc_size);
  if (ptr + size > r.alloc_base + r.alloc_size) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: range [" + std::to_string(ptr) + ", +" +
                                                  std::to_string(size) + ") exceeds its device allocation of " +
                                                  std::to_string(r.alloc_size) + " bytes at " +
                                                  std::to_string(r.alloc_base));
  }
  char bus[64] = {0};
  Check(gpuDeviceGetPCIBusId(bus, sizeof(bus), r.device), "DeviceGetPCIBusId");
  for (char* c = bus; *c; ++c) *c = static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  r.bus_id = bus;
  return r;
}

IpcHandle IpcHandleOf(uint64_t alloc_base) {
  gpuIpcMemHandle_t h;
  Check(gpuIpcGetMemHandle(&h, reinterpret_cast<void*>(alloc_base)), "IpcGetMemHandle");
  static_assert(sizeof(h) <= kIpcHandleBytes, "IPC handle does not fit");
  IpcHandle out{};
  std::memcpy(out.data(), &h, sizeof(h));
  return out;
}

uint64_t OpenIpcHandle(const IpcHandle& handle, int device) {
  DeviceScope on(device);
  gpuIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  Check(gpuIpcOpenMemHandle(&p, h, gpuIpcMemLazyEnablePeerAccess), "IpcOpenMemHandle");
  return reinterpret_cast<uint64_t>(p);
}

void CloseIpcHandle(uint64_t mapped_base, int device) {
  DeviceScope on(device);
  Check(gpuIpcCloseMemHandle(reinterpret_cast<void*>(mapped_base)), "IpcCloseMemHandle");
}

Stream CreateStream(int device) {
  DeviceScope on(device);
  gpuStream_t s;
  Check(gpuStreamCreateWithFlags(&s, gpuStreamNonBlocking), "StreamCreate");
  return s;
}

void DestroyStream(Stream s, int device) {
  DeviceScope on(device);
  (void)gpuStreamDestroy(static_cast<gpuStream_t>(s));
}

Event CreateEvent(int device) {
  DeviceScope on(device);
  gpuEvent_t e;
  Check(gpuEventCreateWithFlags(&e, gpuEventDisableTiming), "EventCreate");
  return e;
}

void DestroyEvent(Event e, int device) {
  DeviceScope on(device);
  (void)gpuEventDestroy(static_cast<gpuEvent_t>(e));
}

void RecordEvent(Event e, Stream s) {
  Check(gpuEventRecord(static_cast<gpuEvent_t>(e), static_cast<gpuStream_t>(s)), "EventRecord");
}

void StreamWaitEvent(Stream s, Event e) {
  Check(gpuStreamWaitEvent(static_cast<gpuStream_t>(s), static_cast<gpuEvent_t>(e), 0), "StreamWaitEvent");
}

int QueryEvent(Event e) {
  gpuError_t r = gpuEventQuery(static_cast<gpuEvent_t>(e));
  if (r == gpuSuccess) return 1;
  if (r == gpuErrorNotReady) return 0;
  Check(r, "EventQuery");
  return 0;
}

void SynchronizeStream(Stream s) { Check(gpuStreamSynchronize(static_cast<gpuStream_t>(s)), "StreamSynchronize"); }

void SynchronizeEvent(Event e) { Check(gpuEventSynchronize(static_cast<gpuEvent_t>(e)), "EventSynchronize"); }

int NumaNodeOf(int device) {
  char bus[64] = {0};
  if (gpuDeviceGetPCIBusId(bus, sizeof(bus), device) != gpuSuccess) {
    (void)gpuGetLastError();
    return -1;
  }
  for (char* c = bus; *c; ++c) *c = static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  // POSIX I/O, not iostreams: see core/logging.h on locale facets.
  const std::string path = std::string("/sys/bus/pci/devices/") + bus + "/numa_node";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char text[16] = {0};
  const ssize_t n = ::read(fd, text, sizeof(text) - 1);
  ::close(fd);
  if (n <= 0) return -1;
  return static_cast<int>(std::strtol(text, nullptr, 10));
}

void RelaxCaptureModeForThisThread() {
  thread_local bool relaxed = false;
  if (relaxed) return;
  gpuStreamCaptureMode mode = gpuStreamCaptureModeRelaxed;
  Check(gpuThreadExchangeStreamCaptureMode(&mode), "ThreadExchangeStreamCaptureMode");
  relaxed = true;
}

void CopyAsync(uint64_t dst, uint64_t src, uint64_t bytes, Stream s) {
  Check(gpuMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, gpuMemcpyDefault,
                       static_cast<gpuStream_t>(s)),
        "MemcpyAsync");
}

void* DeviceAlloc(int device, size_t bytes) {
  DeviceScope on(device);
  void* p = nullptr;
  Check(gpuMalloc(&p, bytes), "Malloc");
  return p;
}

void DeviceFree(void* p, int device) {
  DeviceScope on(device);
  (void)gpuFree(p);
}

void SetDevice(int device) { Check(gpuSetDevice(device), "SetDevice"); }

void EnablePeerAccess(int device, int peer) {
  if (device == peer) return;
  // Called per transfer: remember enabled pairs instead of asking the driver
  // (two runtime calls and a SetDevice) every time.
  constexpr int kMax = 64;
  static std::atomic<bool> enabled[kMax][kMax];
  const bool cacheable = device >= 0 && device < kMax && peer >= 0 && peer < kMax;
  if (cacheable && enabled[device][peer].load(std::memory_order_acquire)) return;
  DeviceScope on(device);
  gpuError_t e = gpuDeviceEnablePeerAccess(peer, 0);
  if (e != gpuSuccess && e != gpuErrorPeerAccessAlreadyEnabled) Check(e, "DeviceEnablePeerAccess");
  (void)gpuGetLastError();
  if (cacheable) enabled[device][peer].store(true, std::memory_order_release);
}

int CurrentDevice() {
  int d = 0;
  Check(gpuGetDevice(&d), "GetDevice");
  return d;
}

DeviceScope::DeviceScope(int device) : prev_(CurrentDevice()), device_(device) {
  if (prev_ != device_) SetDevice(device_);
}

DeviceScope::~DeviceScope() {
  if (prev_ != device_) (void)gpuSetDevice(prev_);  // restoring a device that was current cannot fail
}

void* PinnedAlloc(size_t bytes, int numa_node, PinnedUse use) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw Error(StatusCode::ERR_GPU_OP, "mmap of " + std::to_string(bytes) + " bytes failed");
  if (numa_node >= 0 && numa_node < 64) {
    unsigned long mask = 1UL << numa_node;
    syscall(SYS_mbind, p, bytes, 1 /*MPOL_PREFERRED*/, &mask, 64, 0);  // best effort
  }
  gpuError_t e = gpuHostRegister(p, bytes, gpuHostRegisterPortable | gpuHostRegisterMapped);
  if (e != gpuSuccess) {
    // A call that fails because it broke a capture elsewhere may still have
    // registered the range: unregister before unmapping, or a later mmap at
    // the same address fails with "already registered".
    (void)gpuHostUnregister(p);
    (void)gpuGetLastError();
    munmap(p, bytes);  // nothing pinned stays behind
    Check(e, "HostRegister");
  }
  PinnedCounter(use).fetch_add(bytes, std::memory_order_relaxed);
  return p;
}

uint64_t DevicePointerOfPinned(void* p) {
  void* d = nullptr;
  Check(gpuHostGetDevicePointer(&d, p, 0), "HostGetDevicePointer");
  return reinterpret_cast<uint64_t>(d);
}

void PinnedFree(void* p, size_t bytes, PinnedUse use) {
  if (!p) return;
  (void)gpuHostUnregister(p);
  munmap(p, bytes);
  PinnedCounter(use).fetch_sub(bytes, std::memory_order_relaxed);
}

namespace {
// Same signature for both vendors: (void* handle, device pointer, size,
// handle type (1 = dma-buf fd in both), flags) -> 0 on success.
using GetHandleForRangeFn = int (*)(void*, unsigned long long, size_t, int, unsigned long long);
GetHandleForRangeFn HandleForRangeFn() {
  static GetHandleForRangeFn fn = [] {
#if MORI_HIP
    const char* sym = "hipMemGetHandleForAddressRange";
    void* f = dlsym(RTLD_DEFAULT, sym);
    if (!f) {
      void* lib = dlopen("libamdhip64.so", RTLD_NOW | RTLD_LOCAL);
      f = lib ? dlsym(lib, sym) : nullptr;
    }
#else
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void* f = lib ? dlsym(lib, "cuMemGetHandleForAddressRange") : nullptr;
#endif
    return reinterpret_cast<GetHandleForRangeFn>(f);
  }();
  return fn;
}
}  // namespace

int DmaBufFdOf(uint64_t ptr, uint64_t size, uint64_t* offset) {
  auto fn = HandleForRangeFn();
  if (!fn) {
    throw Error(StatusCode::ERR_GPU_OP, "dma-buf export is not available (no " MORI_DMABUF_CALL " in the driver)");
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t begin = ptr & ~(page - 1);
  const uint64_t end = (ptr + size + page - 1) & ~(page - 1);
  int fd = -1;
  int rc = fn(&fd, begin, end - begin, 1, 0);
  if (rc != 0 || fd < 0) {
    throw Error(StatusCode::ERR_GPU_OP, std::string(MORI_DMABUF_CALL) + " failed with code " + std::to_string(rc) +
                                            " for [" + std::to_string(begin) + ", +" + std::to_string(end - begin) +
                                            ")");
  }
  *offset = ptr - begin;
  return fd;
}

#else  // CPU-only build: every entry point says there is no GPU.

namespace {
[[noreturn]] void NoGpu(const char* what) {
  throw Error(StatusCode::ERR_GPU_OP, std::string(what) + ": this build of mori_torch has no CUDA/HIP support");
}
}  // namespace

bool Compiled() { return false; }
int DeviceCount() { return 0; }
DeviceRange DescribeDeviceRange(uint64_t, uint64_t) {
  throw Error(StatusCode::ERR_INVALID_ARGS,
              "register_memory: GPU memory needs a build with CUDA or HIP support; this build has none");
}
IpcHandle IpcHandleOf(uint64_t) { NoGpu("IpcHandleOf"); }
uint64_t OpenIpcHandle(const IpcHandle&, int) { NoGpu("OpenIpcHandle"); }
void CloseIpcHandle(uint64_t, int) {}
Stream CreateStream(int) { NoGpu("CreateStream"); }
void DestroyStream(Stream, int) {}
Event CreateEvent(int) { NoGpu("CreateEvent"); }
void DestroyEvent(Event, int) {}
void RecordEvent(Event, Stream) { NoGpu("RecordEvent"); }
void StreamWaitEvent(Stream, Event) { NoGpu("StreamWaitEvent"); }
int QueryEvent(Event) { NoGpu("QueryEvent"); }
void SynchronizeStream(Stream) {}
void SynchronizeEvent(Event) { NoGpu("SynchronizeEvent"); }
int NumaNodeOf(int) { return -1; }
void RelaxCaptureModeForThisThread() {}
void CopyAsync(uint64_t, uint64_t, uint64_t, Stream) { NoGpu("CopyAsync"); }
void* DeviceAlloc(int, size_t) { NoGpu("DeviceAlloc"); }
void DeviceFree(void*, int) {}
void LaunchSegmentCopy(const CopySegment*, uint64_t, Stream, const SegmentBases&, uint64_t) {
  NoGpu("LaunchSegmentCopy");
}
void LaunchInlineSegmentCopy(const CopySegment*, uint32_t, Stream) { NoGpu("LaunchInlineSegmentCopy"); }
uint32_t SegmentCopyResidentGroups(int) { return 1; }
void WarmUpKernels(int) {}
int DmaBufFdOf(uint64_t, uint64_t, uint64_t*) { NoGpu("DmaBufFdOf"); }
void* PinnedAlloc(size_t, int, PinnedUse) { NoGpu("PinnedAlloc"); }
void PinnedFree(void*, size_t, PinnedUse) {}
uint64_t DevicePointerOfPinned(void*) { NoGpu("DevicePointerOfPinned"); }
void EnablePeerAccess(int, int) { NoGpu("EnablePeerAccess"); }
void SetDevice(int) { NoGpu("SetDevice"); }
int CurrentDevice() { return -1; }
DeviceScope::DeviceScope(int device) : device_(device) {
  (void)prev_;  // fields of the GPU build
  (void)device_;
}
DeviceScope::~DeviceScope() {}

#endif

}  // namespace gpu
}  // namespace mori_torch
