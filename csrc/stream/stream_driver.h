// The stream as stream ordering sees it: the few operations the enqueue path
// (enqueue.h) puts on it, in order. GpuStreamDriver enqueues CUDA/HIP work on
// a real stream; the GoogleTests drive the same protocol with a host thread
// standing in for the stream (tests/cpp/host_stream.h), so the flag protocol,
// re-arming under capture, the error path and slot reuse are tested without
// a GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gpu/stream_ops.h"

namespace mori_torch {

class StreamDriver {
 public:
  virtual ~StreamDriver() = default;
  // True while work enqueued now is recorded into a graph that may replay.
  virtual bool Capturing() = 0;
  // Copies `bytes` between memory the stream reaches (device memory, or
  // pinned host memory by its host address): a DMA on a GPU.
  virtual void Copy(void* dst, const void* src, size_t bytes) = 0;
  // Device memory for packed pages on the stream's device (where the
  // gather/scatter kernels work at memory speed; the DMA engine moves it to
  // and from the pinned staging). Called outside the progress path; may run
  // during a capture. scratch_domain() says which device it belongs to.
  // The function that frees it later (it outlives this driver).
  using ScratchFree = void (*)(void* p, int domain);
  virtual void* AllocScratch(size_t bytes) = 0;
  virtual ScratchFree scratch_free() = 0;
  virtual int scratch_domain() = 0;
  // Exclusive prefix sum of the sizes into packed (gpu::LaunchPackOffsets).
  virtual void PackOffsets(const int64_t* sizes, int64_t size_stride, int64_t count, int64_t* packed) = 0;
  // The bounds-checked segment copy (gpu::LaunchStreamCopy).
  virtual void CopySegments(const gpu::StreamCopyArgs& args) = 0;
  // Stores `value` once the work before it is done / holds the work after it
  // until *flag == value (flag: pinned host word).
  virtual void WriteFlag(uint32_t* flag, uint32_t value) = 0;
  virtual void WaitFlag(uint32_t* flag, uint32_t value) = 0;
  // Runs release(context) once the captured graph is gone (see
  // gpu::ReleaseWithCapturedGraph); false when it cannot be tied.
  virtual bool ReleaseWithGraph(void (*release)(void*), void* context) = 0;
  // The native stream, for backends that copy on it themselves (XGMI), when
  // is_gpu_stream() (null is then the legacy default stream).
  virtual bool is_gpu_stream() const = 0;
  virtual gpu::Stream native() = 0;
};

// A CUDA/HIP stream of the current device.
class GpuStreamDriver : public StreamDriver {
 public:
  explicit GpuStreamDriver(gpu::Stream s) : s_(s) {}
  bool Capturing() override;
  void Copy(void* dst, const void* src, size_t bytes) override;
  void* AllocScratch(size_t bytes) override;
  ScratchFree scratch_free() override;
  int scratch_domain() override;
  void PackOffsets(const int64_t* sizes, int64_t size_stride, int64_t count, int64_t* packed) override;
  void CopySegments(const gpu::StreamCopyArgs& args) override;
  void WriteFlag(uint32_t* flag, uint32_t value) override;
  void WaitFlag(uint32_t* flag, uint32_t value) override;
  bool ReleaseWithGraph(void (*release)(void*), void* context) override;
  bool is_gpu_stream() const override { return true; }
  gpu::Stream native() override { return s_; }

 private:
  gpu::Stream s_;
};

}  // namespace mori_torch
