// Kernels of the stream-ordered ops: the bounds-checked copy that reads its
// segment list from device memory when it runs (a CUDA graph replay sees the
// block table of that replay), and the spin kernels that stand in for stream
// memory operations where the driver has none.
#include "base/error.h"
#include "gpu/stream_ops.h"
#include "gpu/vendor.h"

namespace mori_torch {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunkBytes = 64 << 10;  // work of one block within a segment
constexpr int64_t kMaxBlocks = 1 << 16;

// Copies [from, from + n) of one segment chunk with the block's threads:
// 16-byte vectors, four in flight per thread, when everything is aligned.
__device__ void CopyChunk(unsigned char* dst, const unsigned char* src, int64_t n) {
  if (((reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src) | static_cast<uint64_t>(n)) & 15) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    const int64_t vectors = n / 16;
    int64_t k = threadIdx.x;
    for (; k + 3 * blockDim.x < vectors; k += 4 * blockDim.x) {
      const uint4 a = s[k], b = s[k + blockDim.x], c = s[k + 2 * blockDim.x], e = s[k + 3 * blockDim.x];
      d[k] = a;
      d[k + blockDim.x] = b;
      d[k + 2 * blockDim.x] = c;
      d[k + 3 * blockDim.x] = e;
    }
    for (; k < vectors; k += blockDim.x) d[k] = s[k];
  } else {
    for (int64_t k = threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
  }
}

// The first refused segment is reported whole: a thread claims the record
// by moving code from 0 to kStreamErrorWriting (atomicCAS; later refusals
// find it taken and leave it alone), writes the fields, and only then
// publishes the code the host looks for.
__device__ void RecordOutOfRange(StreamError* err, int64_t i, const SegmentBytes& b) {
  if (!err) return;
  if (atomicCAS(&err->code, 0u, kStreamErrorWriting) != 0u) return;
  volatile StreamError* e = err;
  e->index = i;
  e->local_offset = b.local_offset;
  e->remote_offset = b.remote_offset;
  e->size = b.size;
  __threadfence_system();  // the fields before the code
  atomicExch(&err->code, kStreamErrorOutOfRange);
  __threadfence_system();
}

// Work item w is chunk (w % chunks) of segment (w / chunks).
__global__ void StreamCopyKernel(StreamCopyArgs a, int64_t chunks) {
  if (a.skip_flag && *reinterpret_cast<const volatile uint32_t*>(a.skip_flag) != 0) return;
  const int64_t items = a.count * chunks;
  for (int64_t w = blockIdx.x; w < items; w += gridDim.x) {
    const int64_t i = w / chunks, chunk = w % chunks;
    // Raw entries until SegmentAt scales them (it leaves them on failure).
    SegmentBytes b{a.local_offsets ? a.local_offsets[i] : a.local_offset,
                   a.remote_packed ? 0 : (a.remote_offsets ? a.remote_offsets[i] : a.remote_offset), 0};
    bool ok = SegmentAt(a, i, &b);
    ok = ok && InsideRange(b.local_offset, b.size, a.local_size) && InsideRange(b.remote_offset, b.size, a.remote_size);
    if (!ok) {
      // A refused segment moves nothing; one thread of its first chunk reports it.
      if (chunk == 0 && threadIdx.x == 0) RecordOutOfRange(a.error, i, b);
      continue;
    }
    // Chunks split the segment evenly so every chunk count covers it whole.
    const int64_t per = ((b.size + chunks - 1) / chunks + 15) & ~int64_t{15};
    const int64_t begin = chunk * per;
    if (begin >= b.size) continue;
    const int64_t n = b.size - begin < per ? b.size - begin : per;
    const uint64_t local = a.local_base + b.local_offset + begin, remote = a.remote_base + b.remote_offset + begin;
    auto* dst = reinterpret_cast<unsigned char*>(a.is_read ? local : remote);
    const auto* src = reinterpret_cast<const unsigned char*>(a.is_read ? remote : local);
    CopyChunk(dst, src, n);
  }
}

// One block: each thread sums a contiguous run of sizes, the block scans
// the run totals, then each thread writes its run's offsets.
constexpr int kScanThreads = 1024;
__global__ void PackOffsetsKernel(const int64_t* sizes, int64_t stride, int64_t count, int64_t* packed) {
  __shared__ int64_t totals[kScanThreads];
  const int64_t per = (count + kScanThreads - 1) / kScanThreads;
  const int64_t begin = threadIdx.x * per;
  const int64_t end = begin + per < count ? begin + per : count;
  auto saturating_add = [](int64_t x, int64_t y) { return x > INT64_MAX - y ? INT64_MAX : x + y; };
  int64_t sum = 0;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t v = sizes[i * stride];
    sum = saturating_add(sum, v < 0 ? 0 : v);
  }
  totals[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {  // 1024 additions: cheaper than a tree at this size
    int64_t run = 0;
    for (int t = 0; t < kScanThreads; ++t) {
      const int64_t v = totals[t];
      totals[t] = run;
      run = saturating_add(run, v);
    }
  }
  __syncthreads();
  int64_t at = totals[threadIdx.x];
  for (int64_t i = begin; i < end; ++i) {
    packed[i] = at;
    const int64_t v = sizes[i * stride];
    at = saturating_add(at, v < 0 ? 0 : v);
  }
}

// A null flag does nothing (the warm-up launch).
__global__ void FlagWriteKernel(uint32_t* flag, uint32_t value) {
  if (!flag) return;
  __threadfence_system();  // the stream's earlier writes are visible first
  *reinterpret_cast<volatile uint32_t*>(flag) = value;
  __threadfence_system();
}

__global__ void FlagWaitKernel(const uint32_t* flag, uint32_t value) {
  if (!flag) return;
  while (*reinterpret_cast<const volatile uint32_t*>(flag) != value) {
  }
  __threadfence_system();
}

void CheckLaunch(const char* what) {
  gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) throw Error(StatusCode::ERR_GPU_OP, std::string(what) + " launch: " + gpuGetErrorString(e));
}

}  // namespace

void LaunchStreamCopy(const StreamCopyArgs& args, Stream s) {
  if (args.count <= 0) return;
  // With one known size per segment, large segments are spread over blocks;
  // sizes read from device memory give one block per segment.
  int64_t chunks = 1;
  if (!args.sizes && args.uniform_size > kChunkBytes) chunks = (args.uniform_size + kChunkBytes - 1) / kChunkBytes;
  if (chunks > kMaxBlocks) chunks = kMaxBlocks;
  const int64_t items = args.count * chunks;
  const auto blocks = static_cast<unsigned int>(items < kMaxBlocks ? items : kMaxBlocks);
  StreamCopyKernel<<<blocks, kThreads, 0, static_cast<gpuStream_t>(s)>>>(args, chunks);
  CheckLaunch("stream copy kernel");
}

void LaunchPackOffsets(const int64_t* sizes, int64_t size_stride, int64_t count, int64_t* packed, Stream s) {
  if (count <= 0) return;
  PackOffsetsKernel<<<1, kScanThreads, 0, static_cast<gpuStream_t>(s)>>>(sizes, size_stride, count, packed);
  CheckLaunch("pack offsets kernel");
}

void LaunchFlagWriteKernel(Stream s, uint32_t* device_flag, uint32_t value) {
  FlagWriteKernel<<<1, 1, 0, static_cast<gpuStream_t>(s)>>>(device_flag, value);
  CheckLaunch("flag write kernel");
}

void LaunchFlagWaitKernel(Stream s, const uint32_t* device_flag, uint32_t value) {
  FlagWaitKernel<<<1, 1, 0, static_cast<gpuStream_t>(s)>>>(device_flag, value);
  CheckLaunch("flag wait kernel");
}

void WarmUpStreamKernels(int device) {
  DeviceScope on(device);
  // Zero-work launches load the module (lazy loading would otherwise load it
  // at a first launch that can sit behind a pending stream wait). No sync:
  // another stream may be held by a wait right now. A stream of its own, not
  // the legacy one, so a capture elsewhere is never joined.
  Stream s = CreateStream(device);
  auto* stream = static_cast<gpuStream_t>(s);
  StreamCopyArgs nothing;
  nothing.count = 0;
  StreamCopyKernel<<<1, 1, 0, stream>>>(nothing, 1);
  PackOffsetsKernel<<<1, kScanThreads, 0, stream>>>(nullptr, 1, 0, nullptr);
  FlagWriteKernel<<<1, 1, 0, stream>>>(nullptr, 0);
  FlagWaitKernel<<<1, 1, 0, stream>>>(nullptr, 0);
  gpuError_t e = gpuGetLastError();
  DestroyStream(s, device);
  if (e != gpuSuccess)
    throw Error(StatusCode::ERR_GPU_OP, std::string("stream kernel warm-up: ") + gpuGetErrorString(e));
}

}  // namespace gpu
}  // namespace mori_torch
