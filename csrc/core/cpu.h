// What the engine asks of the CPUs it runs on: how many this process may
// use, and the hint a spin-wait gives the core.
#pragma once

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

}  // namespace mori_torch
