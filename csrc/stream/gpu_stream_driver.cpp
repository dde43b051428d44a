#include "stream/stream_driver.h"

namespace mori_torch {

bool GpuStreamDriver::Capturing() { return gpu::StreamIsCapturing(s_); }

void GpuStreamDriver::Copy(void* dst, const void* src, size_t bytes) {
  gpu::CopyAsync(reinterpret_cast<uint64_t>(dst), reinterpret_cast<uint64_t>(src), bytes, s_);
}

void* GpuStreamDriver::AllocScratch(size_t bytes) {
  gpu::RelaxedCaptureScope relaxed;  // may run while this thread captures a graph
  return gpu::DeviceAlloc(gpu::CurrentDevice(), bytes);
}

StreamDriver::ScratchFree GpuStreamDriver::scratch_free() {
  return [](void* p, int domain) { gpu::DeviceFree(p, domain); };
}

int GpuStreamDriver::scratch_domain() { return gpu::CurrentDevice(); }

void GpuStreamDriver::PackOffsets(const int64_t* sizes, int64_t size_stride, int64_t count, int64_t* packed) {
  gpu::LaunchPackOffsets(sizes, size_stride, count, packed, s_);
}

void GpuStreamDriver::CopySegments(const gpu::StreamCopyArgs& args) { gpu::LaunchStreamCopy(args, s_); }

void GpuStreamDriver::WriteFlag(uint32_t* flag, uint32_t value) { gpu::StreamWriteFlag(s_, flag, value); }

void GpuStreamDriver::WaitFlag(uint32_t* flag, uint32_t value) { gpu::StreamWaitFlag(s_, flag, value); }

bool GpuStreamDriver::ReleaseWithGraph(void (*release)(void*), void* context) {
  return gpu::ReleaseWithCapturedGraph(s_, release, context);
}

}  // namespace mori_torch
