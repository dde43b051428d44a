#include "core/local_engines.h"

#include <unistd.h>

#include <mutex>
#include <unordered_set>

namespace mori_torch {
namespace {

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}

// Leaked on purpose: engines may be destroyed during static destruction.
std::unordered_multiset<Incarnation>& Live() {
  static auto* live = new std::unordered_multiset<Incarnation>();
  return *live;
}

}  // namespace

LocalEngineMark::LocalEngineMark(Incarnation incarnation) : incarnation_(incarnation) {
  std::lock_guard<std::mutex> lk(Mu());
  Live().insert(incarnation_);
}

LocalEngineMark::~LocalEngineMark() {
  std::lock_guard<std::mutex> lk(Mu());
  auto it = Live().find(incarnation_);
  if (it != Live().end()) Live().erase(it);
}

bool InThisProcess(const EngineDesc& engine) {
  if (engine.pid != static_cast<int32_t>(getpid())) return false;  // the cheap test first
  std::lock_guard<std::mutex> lk(Mu());
  return Live().count(engine.incarnation) != 0;
}

}  // namespace mori_torch
