// Profiler ranges (NVTX on CUDA, roctx on ROCm) around transfers and ops, so
// they line up with kernels in Nsight Systems / rocprof. Off unless enabled
// (MORI_TORCH_NVTX=1 or SetTraceRanges(true)): disabled, a range costs one
// relaxed load. A build without a GPU makes them no-ops.
#pragma once

#include <cstdint>

namespace mori_torch {
namespace gpu {

bool TraceRangesEnabled();
void SetTraceRanges(bool on);
// True if ranges reach a profiler library in this build (NVTX or roctx found).
bool TraceRangesAvailable();

// A range that may end on another thread (a transfer: submitted here, ended
// by a backend thread). 0 means "no range".
uint64_t TraceRangeStart(const char* name);
void TraceRangeEnd(uint64_t id);

// A range on this thread's stack for the scope's life (an op's host side).
class ScopedTraceRange {
 public:
  explicit ScopedTraceRange(const char* name);
  ~ScopedTraceRange();
  ScopedTraceRange(const ScopedTraceRange&) = delete;
  ScopedTraceRange& operator=(const ScopedTraceRange&) = delete;

 private:
  bool pushed_;
};

}  // namespace gpu
}  // namespace mori_torch
