// What the engine asks of the CPUs it runs on: how many this process may
// use, and the hint a spin-wait gives the core.
#pragma once

#include <mutex>

namespace mori_torch {

// CPUs' worth of time this process may use: its affinity mask, capped by a
// cgroup CPU quota (a container limited to 2 CPUs still sees every core in
// its mask). At least 1.
int UsableCpus();

// A spin-wait hint: the core pauses briefly without giving up its thread.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Takes `m`, trying a few microseconds' worth of times before sleeping on
// it: a holder that keeps it for well under a microsecond (a queue swap) is
// outwaited without a futex sleep, whose wake-up cost the sleeper 10-20 us
// on the GPU VMs (the tail of a small GPU transfer's submission).
void LockSpinningFirst(std::mutex& m);

}  // namespace mori_torch
