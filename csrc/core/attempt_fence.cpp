#include "core/attempt_fence.h"

namespace mori_torch {

bool AttemptFence::EarlierActiveLocked(const Key& k, uint16_t attempt) const {
  auto it = active_.find(k);
  return it != active_.end() && !it->second.empty() && it->second.begin()->first < attempt;
}

bool AttemptFence::Enter(const std::string& peer, TransferUid uid, uint16_t attempt, Deadline deadline) {
  Key k{peer, uid};
  std::unique_lock<std::mutex> lk(mu_);
  if (attempt > 0) {
    while (EarlierActiveLocked(k, attempt)) {
      if (cv_.wait_until(lk, deadline) == std::cv_status::timeout && EarlierActiveLocked(k, attempt)) return false;
    }
  }
  ++active_[std::move(k)][attempt];
  return true;
}

void AttemptFence::Leave(const std::string& peer, TransferUid uid, uint16_t attempt) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = active_.find(Key{peer, uid});
    if (it == active_.end()) return;
    auto jt = it->second.find(attempt);
    if (jt != it->second.end() && --jt->second == 0) {
      it->second.erase(jt);
      wake = true;
    }
    if (it->second.empty()) active_.erase(it);
  }
  if (wake) cv_.notify_all();
}

size_t AttemptFence::Active() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& kv : active_) {
    for (const auto& a : kv.second) n += a.second;
  }
  return n;
}

}  // namespace mori_torch
