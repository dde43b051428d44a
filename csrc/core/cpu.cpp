#include "core/cpu.h"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <string>

namespace mori_torch {

int UsableCpus() {
  cpu_set_t set;
  long long cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  // cgroup v2 cpu.max, else v1 cpu.cfs_quota_us / cfs_period_us. A missing
  // file or a value that does not parse leaves 0: no quota.
  long long quota = 0, period = 0;
  std::string v2_quota;
  if (std::ifstream("/sys/fs/cgroup/cpu.max") >> v2_quota >> period) {
    if (v2_quota != "max") quota = std::atoll(v2_quota.c_str());
  } else {
    std::ifstream("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") >> quota;  // -1: none
    std::ifstream("/sys/fs/cgroup/cpu/cpu.cfs_period_us") >> period;
  }
  if (quota > 0 && period > 0) cpus = std::min(cpus, (quota + period - 1) / period);
  return cpus < 1 ? 1 : static_cast<int>(cpus);
}

void LockSpinningFirst(std::mutex& m) {
  constexpr int kTries = 256;  // a pause is 10-140 cycles: 1-20 us in all
  for (int i = 0; i < kTries; ++i) {
    if (m.try_lock()) return;
    CpuRelax();
  }
  m.lock();
}

}  // namespace mori_torch
