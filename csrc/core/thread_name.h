// Names for the threads the engine starts ("mori-..."), so that top -H, gdb,
// py-spy and /proc/PID/task/*/comm tell them apart, and log lines say which
// thread wrote them.
#pragma once

namespace mori_torch {

// Names the calling thread. Linux keeps 15 bytes; longer names are cut.
void SetThreadName(const char* name);
// The calling thread's name as the kernel has it (read once per thread,
// then cached; SetThreadName updates the cache).
const char* ThisThreadName();

}  // namespace mori_torch
