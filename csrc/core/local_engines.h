// Which engines live in this very process. A peer's pid and node id do not
// say it: containers on one host share the kernel's boot id (the default
// node id), and pids repeat across pid namespaces. Each engine's
// incarnation is a random 64-bit value, so the set of live incarnations
// does (used where "same process" changes behaviour: XGMI maps nothing
// then, TCP refuses stream ordering of GPU memory served there).
#pragma once

#include "core/descriptors.h"

namespace mori_torch {

// Marks an engine as alive in this process for as long as it exists.
class LocalEngineMark {
 public:
  explicit LocalEngineMark(Incarnation incarnation);
  ~LocalEngineMark();
  LocalEngineMark(const LocalEngineMark&) = delete;
  LocalEngineMark& operator=(const LocalEngineMark&) = delete;

 private:
  const Incarnation incarnation_;
};

// True if `engine` is an engine of this process that is alive now.
bool InThisProcess(const EngineDesc& engine);

}  // namespace mori_torch
