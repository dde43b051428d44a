// Gather/scatter copy kernel: one launch moves a whole batch of segments
// whose list lives in device or mapped pinned host memory (or, for a
// handful of segments, in the launch's parameters), so many small KV pages
// cost one launch.
#include <atomic>

#include "base/error.h"
#include "gpu/gpu_runtime.h"
#include "gpu/vendor.h"

namespace mori_torch {
namespace gpu {
namespace {

// A group of 64 threads copies one segment, 4 KiB per pass of 16-byte
// loads (a 4 KiB page: one pass, all its loads issued before any store).
// One group per segment and a block per 4 segments, the hardware block
// scheduler balancing them: on one H100, 16,384 permuted 16 KiB pages took
// 194.8 us this way against 202.1 with a device-filling grid of 32-thread
// groups striding over the list (cudaMemcpyAsync of the same bytes: 183.3),
// and 4 KiB pages 55.4 against 57.5 (memcpy 53.0).
constexpr uint32_t kGroup = 64;
constexpr uint32_t kThreads = 256;
constexpr uint32_t kGroupsPerBlock = kThreads / kGroup;
// 16-byte loads each thread keeps in flight before storing. Peer reads over
// NVLink/XGMI are latency-bound, so bytes in flight decide the bandwidth;
// with 4 KiB per group and up to 8 blocks an SM there are plenty. 4 rather
// than 8: on H200 (bench_xgmi.py, one batch at a time, 3 rounds each way)
// one GPU's 4 KiB pages went from 0.62-0.65 of copy_ to 0.67-0.71, 16 and
// 64 KiB gained about 0.01, and NVLink between two H200s was unchanged
// (session 24). On H100 (session 18) 4 did no better than 8; not re-run there.
constexpr uint32_t kUnroll = 4;
constexpr int kMaxDevices = 64;

struct InlineSegments {
  CopySegment segs[kInlineSegments];
  uint32_t count;
};

__device__ __forceinline__ void CopyBytes(uint64_t dst, uint64_t src, uint64_t bytes, uint32_t lane) {
  auto* d = reinterpret_cast<unsigned char*>(dst);
  const auto* s = reinterpret_cast<const unsigned char*>(src);
  for (uint64_t k = lane; k < bytes; k += kGroup) d[k] = s[k];
}

// One group copies one segment. Source and destination with the same
// alignment mod 16 move in 16-byte vectors (head and tail bytewise).
__device__ __forceinline__ void CopySegmentByGroup(const CopySegment& seg, uint32_t lane) {
  uint64_t dst = seg.dst, src = seg.src, bytes = seg.bytes;
  if (((dst ^ src) & 15) != 0) {
    CopyBytes(dst, src, bytes, lane);
    return;
  }
  uint64_t head = (16 - (dst & 15)) & 15;
  if (head > bytes) head = bytes;
  CopyBytes(dst, src, head, lane);
  dst += head;
  src += head;
  bytes -= head;
  auto* d = reinterpret_cast<uint4*>(dst);
  const auto* s = reinterpret_cast<const uint4*>(src);
  const uint64_t n = bytes / 16;
  constexpr uint64_t kStep = static_cast<uint64_t>(kGroup) * kUnroll;
  uint64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    uint4 v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) v[u] = s[i + lane + u * kGroup];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) d[i + lane + u * kGroup] = v[u];
  }
  if (i < n) {  // the rest, fewer than kStep vectors: still all loads first
    uint4 v[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      if (i + lane + u * kGroup < n) v[u] = s[i + lane + u * kGroup];
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      if (i + lane + u * kGroup < n) d[i + lane + u * kGroup] = v[u];
    }
  }
  CopyBytes(dst + n * 16, src + n * 16, bytes & 15, lane);
}

// The address form of list entry `e` at list index `gi` (see SegmentBases).
__device__ __forceinline__ CopySegment Placed(const CopySegment& e, uint64_t gi, const SegmentBases& b) {
  if (b.sets == 0) return e;
  uint32_t k = 0;
  while (k + 1 < b.sets && b.first[k + 1] <= gi) ++k;  // one entry per group: the same k for all its lanes
  const bool swap = ((b.swap >> k) & 1u) != 0;
  return {b.dst_base[k] + (swap ? e.src : e.dst), b.src_base[k] + (swap ? e.dst : e.src), e.bytes};
}

// The list may live in pinned host memory (the XGMI backend's batches): a
// block's entries (4 x 24 bytes) come in one load by its first 12 threads,
// one round trip across the bus per block rather than one per group.
__global__ void __launch_bounds__(kThreads)
    SegmentCopyKernel(const CopySegment* segs, uint32_t count, SegmentBases b, uint64_t first_index) {
  constexpr uint32_t kWords = sizeof(CopySegment) / sizeof(uint64_t);
  __shared__ uint64_t entries[kGroupsPerBlock * kWords];
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * kGroupsPerBlock;
  if (first >= count) return;
  const uint64_t here = count - first < kGroupsPerBlock ? count - first : kGroupsPerBlock;
  if (threadIdx.x < here * kWords) entries[threadIdx.x] = reinterpret_cast<const uint64_t*>(segs + first)[threadIdx.x];
  __syncthreads();
  const uint32_t g = threadIdx.x / kGroup;
  if (g >= here) return;
  const CopySegment e{entries[g * kWords], entries[g * kWords + 1], entries[g * kWords + 2]};
  CopySegmentByGroup(Placed(e, first_index + first + g, b), threadIdx.x % kGroup);
}

__global__ void __launch_bounds__(kThreads) InlineSegmentCopyKernel(InlineSegments list) {
  const uint32_t lane = threadIdx.x % kGroup;
  const uint32_t i = blockIdx.x * kGroupsPerBlock + threadIdx.x / kGroup;
  if (i < list.count) CopySegmentByGroup(list.segs[i], lane);
}

void CheckLaunch(const char* what) {
  gpuError_t e = gpuGetLastError();
  if (e != gpuSuccess) throw Error(StatusCode::ERR_GPU_OP, std::string(what) + ": " + gpuGetErrorString(e));
}

// Blocks of SegmentCopyKernel resident at once on each device, 0 until asked.
std::atomic<uint32_t> g_resident_blocks[kMaxDevices];

uint32_t ResidentBlocks(int device) {
  if (device < 0 || device >= kMaxDevices) return 1024;
  uint32_t b = g_resident_blocks[device].load(std::memory_order_relaxed);
  if (b != 0) return b;
  int sms = 0, per_sm = 0;
  if (gpuDeviceGetAttribute(&sms, gpuDevAttrMultiProcessorCount, device) != gpuSuccess ||
      gpuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, SegmentCopyKernel, kThreads, 0) != gpuSuccess) {
    (void)gpuGetLastError();
    return 1024;
  }
  b = static_cast<uint32_t>(sms > 0 ? sms : 1) * static_cast<uint32_t>(per_sm > 0 ? per_sm : 1);
  g_resident_blocks[device].store(b, std::memory_order_relaxed);
  return b;
}

}  // namespace

uint32_t SegmentCopyResidentGroups(int device) { return ResidentBlocks(device) * kGroupsPerBlock; }

void LaunchSegmentCopy(const CopySegment* device_segments, uint64_t count, Stream s, const SegmentBases& bases,
                       uint64_t first_index) {
  // A launch's threads must number fewer than 2^32 (HIP's dispatch packet
  // counts them in 32 bits): longer lists go in several launches.
  constexpr uint64_t kMaxPerLaunch = (uint64_t{UINT32_MAX} / kThreads) * kGroupsPerBlock;
  for (uint64_t at = 0; at < count; at += kMaxPerLaunch) {
    const uint64_t n = count - at < kMaxPerLaunch ? count - at : kMaxPerLaunch;
    const auto blocks = static_cast<uint32_t>((n + kGroupsPerBlock - 1) / kGroupsPerBlock);
    SegmentCopyKernel<<<blocks, kThreads, 0, static_cast<gpuStream_t>(s)>>>(
        device_segments + at, static_cast<uint32_t>(n), bases, first_index + at);
    CheckLaunch("segment copy kernel launch");
  }
}

void LaunchInlineSegmentCopy(const CopySegment* host_segments, uint32_t count, Stream s) {
  if (count == 0) return;
  if (count > kInlineSegments) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "LaunchInlineSegmentCopy: " + std::to_string(count) +
                                                  " segments, at most " + std::to_string(kInlineSegments));
  }
  InlineSegments list;
  for (uint32_t i = 0; i < count; ++i) list.segs[i] = host_segments[i];
  list.count = count;
  InlineSegmentCopyKernel<<<(count + kGroupsPerBlock - 1) / kGroupsPerBlock, kThreads, 0,
                            static_cast<gpuStream_t>(s)>>>(list);
  CheckLaunch("inline segment copy kernel launch");
}

void WarmUpKernels(int device) {
  DeviceScope on(device);
  // A zero-length launch still loads the module.
  SegmentCopyKernel<<<1, kThreads>>>(nullptr, 0, SegmentBases{}, 0);
  CheckLaunch("kernel warm-up");
  InlineSegments none{};
  InlineSegmentCopyKernel<<<1, kThreads>>>(none);
  CheckLaunch("kernel warm-up");
  (void)ResidentBlocks(device);
}

}  // namespace gpu
}  // namespace mori_torch
