// Gather/scatter copy kernel: one launch moves a whole batch of segments
// whose list lives in device memory, so many small KV pages cost one launch.
#include "core/types.h"
#include "gpu/gpu_runtime.h"
#include "gpu/vendor.h"

namespace mori_torch {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr uint32_t kMaxBlocks = 16384;

// Each thread keeps kUnroll 16-byte loads in flight before storing: peer
// reads over NVLink/XGMI are latency-bound, so one load per thread at a time
// leaves most of the link idle.
constexpr int kUnroll = 4;

__global__ void SegmentCopyKernel(const CopySegment* segs, uint32_t count) {
  for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
    const CopySegment s = segs[i];
    if (((s.dst | s.src | s.bytes) & 15) == 0) {  // 16-byte vectors when aligned
      auto* d = reinterpret_cast<uint4*>(s.dst);
      const auto* src = reinterpret_cast<const uint4*>(s.src);
      const uint64_t n = s.bytes / 16;
      const uint64_t stride = static_cast<uint64_t>(blockDim.x) * kUnroll;
      uint64_t base = 0;
      for (; base + stride <= n; base += stride) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = src[base + threadIdx.x + u * blockDim.x];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) d[base + threadIdx.x + u * blockDim.x] = v[u];
      }
      for (uint64_t k = base + threadIdx.x; k < n; k += blockDim.x) d[k] = src[k];
    } else {
      auto* d = reinterpret_cast<unsigned char*>(s.dst);
      const auto* src = reinterpret_cast<const unsigned char*>(s.src);
      for (uint64_t k = threadIdx.x; k < s.bytes; k += blockDim.x) d[k] = src[k];
    }
  }
}

}  // namespace

void LaunchSegmentCopy(const CopySegment* device_segments, uint32_t count, Stream s) {
  if (count == 0) return;
  const uint32_t blocks = count < kMaxBlocks ? count : kMaxBlocks;
  SegmentCopyKernel<<<blocks, kThreads, 0, static_cast<gpuStream_t>(s)>>>(device_segments, count);
  gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) {
    throw Error(StatusCode::ERR_GPU_OP, std::string("segment copy kernel launch: ") + gpuGetErrorString(e));
  }
}

void WarmUpKernels(int device) {
  SetDevice(device);
  // A zero-length launch still loads the module.
  SegmentCopyKernel<<<1, 1>>>(nullptr, 0);
  gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) throw Error(StatusCode::ERR_GPU_OP, std::string("kernel warm-up: ") + gpuGetErrorString(e));
}

}  // namespace gpu
}  // namespace mori_torch
