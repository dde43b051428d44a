// Stream-ordered work for the torch ops (docs/ARCHITECTURE.md, "Stream-ordered
// ops"), vendor-free like
// gpu_runtime.h: a bounds-checked copy kernel that reads its segment list from
// device memory at run time (so CUDA graph replays see new block tables),
// stream flag writes/waits on pinned host words (the doorbell of host-driven
// backends; driver stream memory operations, or spin kernels where those are
// unavailable or MORI_TORCH_STREAM_FLAGS=spin), and capture-mode helpers.
#pragma once

#include <cstdint>
#include <string>

#include "gpu/gpu_runtime.h"

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MORI_HOST_DEVICE __host__ __device__
#else
#define MORI_HOST_DEVICE
#endif

namespace mori_torch {
namespace gpu {

// Where a stream-ordered transfer reports a segment it refused. Lives in
// pinned, device-mapped host memory: kernels store into it, the host reads
// it without a CUDA call. code 0 means no error.
struct StreamError {
  uint32_t code;
  uint32_t reserved;
  int64_t index;
  int64_t local_offset;
  int64_t remote_offset;
  int64_t size;
};
constexpr uint32_t kStreamErrorOutOfRange = 1;
// code while the kernel thread that claimed the record (atomicCAS from 0)
// still writes the other fields; the host reports only complete records.
constexpr uint32_t kStreamErrorWriting = 0xFFFFFFFFu;

// One stream-ordered transfer between a local registration and a remote one.
// Segment i moves sizes[i * size_stride] bytes (uniform_size when sizes is
// null) between local_offsets[i] * offset_scale and remote_offsets[i] *
// offset_scale. Null offset arrays mean one segment at (local_offset,
// remote_offset). The arrays are device memory for the kernel and host memory
// for the doorbell path; both read them through SegmentAt.
struct StreamCopyArgs {
  uint64_t local_base = 0;  // local bytes as this process sees them (caller)
  uint64_t local_size = 0;
  uint64_t remote_base = 0;  // remote registration mapped here (backend)
  uint64_t remote_size = 0;
  bool is_read = false;
  const int64_t* local_offsets = nullptr;
  const int64_t* remote_offsets = nullptr;
  const int64_t* sizes = nullptr;
  int64_t count = 1;
  int64_t local_offset = 0;
  int64_t remote_offset = 0;
  int64_t offset_scale = 1;
  int64_t uniform_size = 0;
  int64_t size_stride = 1;       // 0: one size for every segment
  StreamError* error = nullptr;  // device address of the error record
  // Packed staging (host-driven backends, docs/ARCHITECTURE.md): the remote
  // side is a pinned slot where segment i sits at packed_offsets[i], or at
  // i * uniform_size when that list is null; remote_offsets are then the
  // network's business, not the kernel's.
  bool remote_packed = false;
  const int64_t* packed_offsets = nullptr;
  // When set and nonzero as the kernel starts, it moves nothing (a staged
  // read whose transfer failed leaves the pages as they were).
  const uint32_t* skip_flag = nullptr;
};

struct SegmentBytes {
  int64_t local_offset;
  int64_t remote_offset;
  int64_t size;
};

// Segment i in bytes; false when an offset overflows int64 or a value is
// negative. Range checks against the registrations are the caller's.
MORI_HOST_DEVICE inline bool SegmentAt(const StreamCopyArgs& a, int64_t i, SegmentBytes* out) {
  const int64_t lo = a.local_offsets ? a.local_offsets[i] : a.local_offset;
  const int64_t ro = a.remote_packed ? 0 : (a.remote_offsets ? a.remote_offsets[i] : a.remote_offset);
  out->size = a.sizes ? a.sizes[i * a.size_stride] : a.uniform_size;
  if (lo < 0 || ro < 0 || out->size < 0 || a.offset_scale <= 0) return false;
  const int64_t limit = INT64_MAX / a.offset_scale;
  if (lo > limit || ro > limit) return false;
  out->local_offset = lo * a.offset_scale;
  out->remote_offset = ro * a.offset_scale;
  if (a.remote_packed) {
    if (a.packed_offsets) {
      out->remote_offset = a.packed_offsets[i];
    } else {
      if (a.uniform_size != 0 && i > INT64_MAX / a.uniform_size) return false;
      out->remote_offset = i * a.uniform_size;
    }
  }
  return true;
}

// Exclusive prefix sum of the segment sizes of `a` (negative sizes count as
// 0: SegmentAt refuses those segments anyway): where segment i sits in a
// packed staging slot. Host and kernels use the same rule.
MORI_HOST_DEVICE inline int64_t SegmentSize(const StreamCopyArgs& a, int64_t i) {
  const int64_t s = a.sizes ? a.sizes[i * a.size_stride] : a.uniform_size;
  return s < 0 ? 0 : s;
}

// True when [offset, offset + size) lies inside a registration of `total` bytes.
MORI_HOST_DEVICE inline bool InsideRange(int64_t offset, int64_t size, uint64_t total) {
  return static_cast<uint64_t>(offset) <= total && static_cast<uint64_t>(size) <= total - static_cast<uint64_t>(offset);
}

// Enqueues the copy on `s`. Every segment is checked against both
// registrations inside the kernel; one out of range moves no byte and is
// recorded in args.error (when set).
void LaunchStreamCopy(const StreamCopyArgs& args, Stream s);

// Writes the exclusive prefix sum of sizes[i * size_stride] (i < count;
// negative values count as 0, sums saturate at INT64_MAX) into packed[i],
// on `s`: the offsets of variable-size segments in a packed staging slot.
// Both arrays are device-reachable (pinned host memory's device address).
void LaunchPackOffsets(const int64_t* sizes, int64_t size_stride, int64_t count, int64_t* packed, Stream s);

// Stream flags: `flag` is a word of PinnedAlloc memory (host address).
// WriteFlag stores `value` once the work before it on `s` is done (with a
// memory fence); WaitFlag holds the work after it until *flag == value.
void StreamWriteFlag(Stream s, uint32_t* flag, uint32_t value);
void StreamWaitFlag(Stream s, uint32_t* flag, uint32_t value);
// "memops" (driver stream memory operations) or "spin" (kernels polling host
// memory): the mechanism the flags above use in this process.
std::string StreamFlagMechanism();

// True while `s` is being captured into a CUDA/HIP graph.
bool StreamIsCapturing(Stream s);

// Ties `release(context)` to the graph being captured on `s`: a user object
// whose reference the graph owns (cudaUserObjectCreate +
// cudaGraphRetainUserObject with cudaGraphUserObjectMove). `release` runs
// once, on a driver thread, after the graph and every executable graph
// instantiated from it are destroyed and their launches have finished (or
// when the capture is invalidated); it must make no CUDA/HIP call and must
// not block. Returns false, and never calls `release`, where this is not
// supported (HIP without user objects, such as HIP 5.2; CPU-only builds),
// when `s` is not capturing, or when a call failed (the error is cleared).
bool ReleaseWithCapturedGraph(Stream s, void (*release)(void*), void* context);

// Loads the stream kernels on `device` (see WarmUpKernels).
void WarmUpStreamKernels(int device);

// While alive, this thread may make CUDA calls that are illegal during
// another stream's capture in global mode (allocations, host registration).
class RelaxedCaptureScope {
 public:
  RelaxedCaptureScope();
  ~RelaxedCaptureScope();
  RelaxedCaptureScope(const RelaxedCaptureScope&) = delete;
  RelaxedCaptureScope& operator=(const RelaxedCaptureScope&) = delete;

 private:
  int previous_;
};

}  // namespace gpu
}  // namespace mori_torch
