// The GPU runtime shim: the one interface through which the core and the
// backends reach CUDA or HIP. This header includes no vendor header; the
// implementation (gpu_runtime.cpp, copy_kernels.cu) is one source for both
// vendors and compiles to "no GPU" stubs in a CPU-only build. Failures throw
// mori_torch::Error(ERR_GPU_OP or ERR_INVALID_ARGS) naming the call.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mori_torch {
namespace gpu {

constexpr size_t kIpcHandleBytes = 64;
using IpcHandle = std::array<uint8_t, kIpcHandleBytes>;

// True when this build has CUDA or HIP support.
bool Compiled();
// Devices visible to this process (0 without GPU support or devices).
int DeviceCount();

struct DeviceRange {
  int device = -1;
  uint64_t alloc_base = 0;  // start of the allocation holding the range
  uint64_t alloc_size = 0;
  std::string bus_id;  // lower-case PCI id
};
// Describes device memory [ptr, ptr+size). Throws ERR_INVALID_ARGS when the
// range is not device memory of one allocation, naming ptr, size and why.
DeviceRange DescribeDeviceRange(uint64_t ptr, uint64_t size);

IpcHandle IpcHandleOf(uint64_t alloc_base);
// Maps a peer's allocation into this process (on `device`); returns its base.
uint64_t OpenIpcHandle(const IpcHandle& handle, int device);
void CloseIpcHandle(uint64_t mapped_base, int device);

// A dma-buf fd exporting device memory around [ptr, ptr+size), so a NIC can
// register it (ibv_reg_dmabuf_mr). The exported range is page-aligned;
// *offset receives where ptr sits inside it. The caller closes the fd.
// Resolved at run time (cuMemGetHandleForAddressRange /
// hipMemGetHandleForAddressRange); throws ERR_GPU_OP when unsupported.
int DmaBufFdOf(uint64_t ptr, uint64_t size, uint64_t* offset);

// Opaque stream / event handles.
using Stream = void*;
using Event = void*;
Stream CreateStream(int device);
void DestroyStream(Stream s, int device);
Event CreateEvent(int device);
void DestroyEvent(Event e, int device);
void RecordEvent(Event e, Stream s);
// Work enqueued on `s` after this waits until `e` (as last recorded) fired.
void StreamWaitEvent(Stream s, Event e);
// 1 done, 0 pending; throws on a device error.
int QueryEvent(Event e);
void SynchronizeStream(Stream s);
// Blocks until `e` has fired; throws on a device error.
void SynchronizeEvent(Event e);

// Device-to-device (or any UVA) copy, asynchronous on `s`.
void CopyAsync(uint64_t dst, uint64_t src, uint64_t bytes, Stream s);
void* DeviceAlloc(int device, size_t bytes);
void DeviceFree(void* p, int device);

// One segment of a batched copy, read by the kernel from device memory.
struct CopySegment {
  uint64_t dst;
  uint64_t src;
  uint64_t bytes;
};
static_assert(sizeof(CopySegment) == 24, "CopySegment layout is shared with the kernel");
// How the kernel reads list entries. With no sets (the default) an entry's
// `dst` and `src` are addresses. Otherwise the list is a run of entries per
// set: set k's run starts at list index first[k] (first[0] = 0, non-decreasing:
// an empty set repeats the next one's),
// and its entries are offsets that the kernel adds to set k's bases; with bit
// k of `swap` the entry's second field is the destination. A core Segment
// (local offset, remote offset, bytes) is then uploaded as it is, one set
// per transfer: a read's destination is the local memory, a write's the
// remote one (swapped).
constexpr uint32_t kMaxBaseSets = 16;
struct SegmentBases {
  uint32_t sets = 0;
  uint32_t swap = 0;
  uint64_t first[kMaxBaseSets];
  uint64_t dst_base[kMaxBaseSets];
  uint64_t src_base[kMaxBaseSets];
};
// Launches one gather/scatter kernel over `count` segments listed at
// `device_segments` (a device address: device memory, or pinned host memory
// mapped into the device's address space), on `s` (a stream of the current device).
// Each segment is copied by one group of threads: callers split large
// segments (see SegmentCopyResidentGroups) so that the groups share the work.
// `first_index`: the list index of device_segments[0] (a later part of a
// list), which `bases` count in.
void LaunchSegmentCopy(const CopySegment* device_segments, uint64_t count, Stream s, const SegmentBases& bases = {},
                       uint64_t first_index = 0);
// Up to this many segments travel in the launch's parameters instead: no
// upload of a list, for single and few-segment transfers.
constexpr uint32_t kInlineSegments = 16;
void LaunchInlineSegmentCopy(const CopySegment* host_segments, uint32_t count, Stream s);
// How many segment-copying groups of threads run at once on `device`.
uint32_t SegmentCopyResidentGroups(int device);
// Loads every kernel of the project on `device` now: lazy module loading
// while a stream waits on host memory can deadlock (docs/GPU_FACTS.md).
void WarmUpKernels(int device);

// What pinned memory is for, counted apart: buffers belong to an engine and
// go with it; segment lists are a process-wide cache (pinned_segment_memory.h).
enum class PinnedUse { kBuffers, kSegmentLists };
// Page-locked host memory from anonymous mmap + host registration (not
// cudaHostAlloc); released safely if registration fails.
void* PinnedAlloc(size_t bytes, int numa_node, PinnedUse use = PinnedUse::kBuffers);
void PinnedFree(void* p, size_t bytes, PinnedUse use = PinnedUse::kBuffers);
// The address through which kernels reach PinnedAlloc memory at `p`.
uint64_t DevicePointerOfPinned(void* p);
// Bytes of host memory PinnedAlloc holds pinned now for `use` (leak checks, diagnostics).
uint64_t PinnedBytes(PinnedUse use = PinnedUse::kBuffers);

// NUMA node of `device`'s PCI function (sysfs), -1 when unknown.
int NumaNodeOf(int device);
// Exempts the calling thread's CUDA/HIP calls from other threads' stream
// captures (thread-local capture mode "relaxed"): engine threads copy and
// poll while a user thread captures a graph. Idempotent, cheap after the
// first call on a thread; a no-op without GPU support.
void RelaxCaptureModeForThisThread();

// Lets `device` reach `peer`'s memory directly (same process); idempotent.
void EnablePeerAccess(int device, int peer);
void SetDevice(int device);
int CurrentDevice();

// Makes `device` current on this thread for the scope and restores the
// previous device after. Pinning host memory acts on the current device's
// context, and an engine thread still at device 0 would create a context
// there: hundreds of MiB on a GPU the process may never use, and a failure
// when that GPU is full. A no-op without GPU support.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
  int device_ = -1;
};

}  // namespace gpu
}  // namespace mori_torch
