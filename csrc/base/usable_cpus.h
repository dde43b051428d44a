// How many CPUs' worth of time this process may use, for settings whose
// default depends on whether spare cores are likely (event-loop polling,
// threads that read offset lists).
#pragma once

namespace mori_torch {

// The affinity mask's CPUs, capped by a cgroup CPU quota (a container limited
// to 2 CPUs still sees every core in its mask); at least 1.
int UsableCpus();

// Where a process may use this many CPUs or more, defaults assume spare ones.
constexpr int kManyCpus = 16;

}  // namespace mori_torch
