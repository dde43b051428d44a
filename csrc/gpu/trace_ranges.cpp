#include "gpu/trace_ranges.h"

#include <atomic>
#include <cstdio>
#include <exception>

#include "base/config_table.h"

#if MORI_WITH_GPU
#include "gpu/vendor.h"  // defines MORI_HIP on ROCm
#endif

#if MORI_WITH_GPU && MORI_HIP
#include <dlfcn.h>
#elif MORI_WITH_GPU && __has_include(<nvtx3/nvToolsExt.h>)
// Header-only NVTX v3: it finds the profiler's injection library itself
// (NVTX_INJECTION64_PATH, set by nsys) and is a no-op without one.
#include <nvtx3/nvToolsExt.h>
#define MORI_NVTX3 1
#endif

namespace mori_torch {
namespace gpu {
namespace {

bool EnvEnabled() {
  try {
    return config::EnvBool("MORI_TORCH_NVTX");
  } catch (const std::exception& e) {  // read at the first range: never throw there
    std::fprintf(stderr, "mori_torch: %s; profiler ranges stay off\n", e.what());
    return false;
  }
}

std::atomic<bool>& Enabled() {
  static std::atomic<bool> on{EnvEnabled()};
  return on;
}

#if MORI_WITH_GPU && MORI_HIP
// roctx is loaded at run time: ROCm installs without it must still work.
struct Roctx {
  uint64_t (*start)(const char*) = nullptr;
  void (*stop)(uint64_t) = nullptr;
  int (*push)(const char*) = nullptr;
  int (*pop)() = nullptr;
  Roctx() {
    void* h = dlopen("libroctx64.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libroctx64.so.4", RTLD_NOW | RTLD_LOCAL);
    if (!h) return;
    start = reinterpret_cast<uint64_t (*)(const char*)>(dlsym(h, "roctxRangeStartA"));
    stop = reinterpret_cast<void (*)(uint64_t)>(dlsym(h, "roctxRangeStop"));
    push = reinterpret_cast<int (*)(const char*)>(dlsym(h, "roctxRangePushA"));
    pop = reinterpret_cast<int (*)()>(dlsym(h, "roctxRangePop"));
    if (!start || !stop || !push || !pop) start = nullptr;
  }
  bool ok() const { return start != nullptr; }
};
const Roctx& RoctxLib() {
  static const Roctx lib;
  return lib;
}
#endif

}  // namespace

bool TraceRangesEnabled() { return Enabled().load(std::memory_order_relaxed); }
void SetTraceRanges(bool on) { Enabled().store(on, std::memory_order_relaxed); }

bool TraceRangesAvailable() {
#if MORI_WITH_GPU && MORI_HIP
  return RoctxLib().ok();
#elif MORI_NVTX3
  return true;
#else
  return false;
#endif
}

uint64_t TraceRangeStart(const char* name) {
  if (!TraceRangesEnabled()) return 0;
#if MORI_WITH_GPU && MORI_HIP
  return RoctxLib().ok() ? RoctxLib().start(name) : 0;
#elif MORI_NVTX3
  return nvtxRangeStartA(name);
#else
  (void)name;
  return 0;
#endif
}

void TraceRangeEnd(uint64_t id) {
  if (id == 0) return;
#if MORI_WITH_GPU && MORI_HIP
  if (RoctxLib().ok()) RoctxLib().stop(id);
#elif MORI_NVTX3
  nvtxRangeEnd(id);
#endif
}

ScopedTraceRange::ScopedTraceRange(const char* name) : pushed_(false) {
  if (!TraceRangesEnabled()) return;
#if MORI_WITH_GPU && MORI_HIP
  if (RoctxLib().ok()) pushed_ = RoctxLib().push(name) >= 0;
#elif MORI_NVTX3
  pushed_ = nvtxRangePushA(name) >= 0;
#else
  (void)name;
#endif
}

ScopedTraceRange::~ScopedTraceRange() {
  if (!pushed_) return;
#if MORI_WITH_GPU && MORI_HIP
  RoctxLib().pop();
#elif MORI_NVTX3
  nvtxRangePop();
#endif
}

}  // namespace gpu
}  // namespace mori_torch
