// Target side of retried writes: a retry (attempt > 0) of transfer (peer,
// uid) may write registered memory only once no earlier attempt of it is
// still receiving into it. The initiator resets an earlier attempt's
// connection before it retries, and receives into memory check the
// connection first (tcp_protocol.h, fence), so an earlier attempt ends at
// its next receive; this closes the window of a receive already past that
// check (a thread preempted there), so the memory's final bytes are the
// retry's.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/net.h"
#include "core/types.h"

namespace mori_torch {

class AttemptFence {
 public:
  // Marks attempt `attempt` of (peer, uid) as writing. A retry first waits
  // until earlier attempts are done, at most until `deadline`; false if they
  // still are then (the caller fails the request rather than race them).
  bool Enter(const std::string& peer, TransferUid uid, uint16_t attempt, Deadline deadline);
  void Leave(const std::string& peer, TransferUid uid, uint16_t attempt);
  // Writes under way now (tests, leak checks).
  size_t Active() const;

 private:
  using Key = std::pair<std::string, TransferUid>;
  bool EarlierActiveLocked(const Key& k, uint16_t attempt) const;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // (peer, uid) -> attempt -> writes of that attempt under way.
  std::map<Key, std::map<uint16_t, uint32_t>> active_;
};

// Enter/Leave as a scope.
class AttemptFenceScope {
 public:
  AttemptFenceScope(AttemptFence* f, const std::string& peer, TransferUid uid, uint16_t attempt, Deadline deadline)
      : f_(f), peer_(peer), uid_(uid), attempt_(attempt) {
    entered_ = f_->Enter(peer, uid, attempt, deadline);
  }
  ~AttemptFenceScope() {
    if (entered_) f_->Leave(peer_, uid_, attempt_);
  }
  AttemptFenceScope(const AttemptFenceScope&) = delete;
  AttemptFenceScope& operator=(const AttemptFenceScope&) = delete;
  bool entered() const { return entered_; }

 private:
  AttemptFence* f_;
  const std::string& peer_;
  TransferUid uid_;
  uint16_t attempt_;
  bool entered_ = false;
};

}  // namespace mori_torch
