#include "core/failover.h"

#include <algorithm>

#include "core/logging.h"

namespace mori_torch {
namespace {

int64_t MsBetween(Deadline a, Deadline b) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(b - a).count();
}

}  // namespace

bool PathHealth::Usable(const std::string& peer, BackendType backend) {
  if (!policy_.enabled || down_.load(std::memory_order_acquire) == 0) return true;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = paths_.find(Key{peer, backend});
  if (it == paths_.end() || !it->second.down) return true;
  Path& p = it->second;
  const Deadline now = Clock::now();
  // A probe whose outcome never came (its transfer ended elsewhere) is
  // given up after a pause's worth of time, so probing never stalls.
  const bool stale_probe = p.probing && now - p.probe_started > std::chrono::milliseconds(policy_.probe_max_ms);
  if (now < p.next_probe || (p.probing && !stale_probe)) return false;
  p.probing = true;
  p.probe_started = now;
  ++stats_.probes;
  return true;
}

void PathHealth::Failed(const std::string& peer, BackendType backend, const std::string& why, bool alternative) {
  if (!policy_.enabled || !alternative) return;
  std::lock_guard<std::mutex> lk(mu_);
  Path& p = paths_[Key{peer, backend}];
  const Deadline now = Clock::now();
  if (p.strikes > 0 && now - p.last_failure > std::chrono::milliseconds(policy_.stable_ms)) p.strikes = 0;
  p.strikes = std::min(p.strikes + 1, 40);
  p.last_failure = now;
  const int64_t pause = std::min<int64_t>(policy_.probe_max_ms, policy_.probe_ms << std::min(p.strikes - 1, 20));
  p.next_probe = now + std::chrono::milliseconds(pause);
  p.probing = false;
  if (p.down) return;  // a failed probe: only the pause grows
  p.down = true;
  p.down_since = now;
  ++stats_.failovers;
  down_.fetch_add(1, std::memory_order_acq_rel);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  MORI_LOG(Warning, "failover: the " << BackendTypeName(backend) << " path to engine '" << peer << "' failed (" << why
                                     << "); the next capable backend takes its transfers; probing "
                                     << BackendTypeName(backend) << " again in " << pause << " ms");
}

void PathHealth::Succeeded(const std::string& peer, BackendType backend) {
  if (down_.load(std::memory_order_acquire) == 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = paths_.find(Key{peer, backend});
  // Only the probe's success counts: a transfer routed before the path went
  // down proves nothing about it now.
  if (it == paths_.end() || !it->second.down || !it->second.probing) return;
  Path& p = it->second;
  p.down = false;
  p.probing = false;
  ++stats_.returns;
  down_.fetch_sub(1, std::memory_order_acq_rel);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  MORI_LOG(Warning, "failover: the " << BackendTypeName(backend) << " path to engine '" << peer
                                     << "' is healthy again after " << MsBetween(p.down_since, Clock::now())
                                     << " ms; its transfers return to it");
}

FailoverStats PathHealth::Stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  FailoverStats s = stats_;
  s.paths_down = down_.load();
  return s;
}

}  // namespace mori_torch
