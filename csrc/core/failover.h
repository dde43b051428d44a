// Failover between backends: the health of each (peer, backend) path. A path
// that fails (core/retry_driver.h reports it) is marked down and the engine
// routes that peer's transfers to the next capable backend in preference
// order; sessions follow (they re-route when Generation() moves). A down
// path is probed with backoff: after its pause one real transfer is let
// through, and its success brings the peer back to the preferred backend.
// The pause doubles with each failure that comes within stable_ms of the
// previous one (a circuit breaker, like Mooncake's pause tracker), so a
// flapping path cannot thrash; a path stable that long starts over.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/net.h"
#include "core/types.h"

namespace mori_torch {

struct FailoverPolicy {
  bool enabled = true;
  int64_t probe_ms = 100;        // first pause of a failed path before a probe
  int64_t probe_max_ms = 30000;  // the pause doubles up to this
  int64_t stable_ms = 10000;     // healthy this long: the pause starts over
};

struct FailoverStats {
  uint64_t failovers = 0;   // switches away from a failed backend
  uint64_t returns = 0;     // switches back to it once a probe succeeded
  uint64_t probes = 0;      // transfers let through to a down path
  uint64_t paths_down = 0;  // (peer, backend) paths down now
};

class PathHealth {
 public:
  explicit PathHealth(FailoverPolicy policy) : policy_(policy) {}

  // True if `backend` may carry a transfer to `peer` now: healthy, or down
  // with a probe due (this caller's transfer is the probe). Lock-free while
  // every path is healthy.
  bool Usable(const std::string& peer, BackendType backend);
  // The path failed (`why`). `alternative`: another capable backend can take
  // the peer's transfers; without one nothing switches (retries reuse the path).
  void Failed(const std::string& peer, BackendType backend, const std::string& why, bool alternative);
  // A transfer over the path succeeded (a probe's success brings it back).
  void Succeeded(const std::string& peer, BackendType backend);
  // Moves whenever a path goes down or comes back.
  uint64_t Generation() const { return generation_.load(std::memory_order_acquire); }
  FailoverStats Stats() const;
  const FailoverPolicy& policy() const { return policy_; }

 private:
  struct Path {
    bool down = false;
    int strikes = 0;  // failures in a row, each within stable_ms of the last
    Deadline last_failure{};
    Deadline down_since{};
    Deadline next_probe{};
    Deadline probe_started{};
    bool probing = false;
  };
  using Key = std::pair<std::string, BackendType>;

  const FailoverPolicy policy_;
  std::atomic<uint64_t> down_{0};  // paths down now: 0 keeps Usable lock-free
  std::atomic<uint64_t> generation_{0};
  mutable std::mutex mu_;
  std::map<Key, Path> paths_;
  FailoverStats stats_;
};

}  // namespace mori_torch
