#include "core/retry_driver.h"

#include <algorithm>

#include "core/logging.h"

namespace mori_torch {

// One transfer across its attempts.
struct RetryDriver::Transfer {
  std::weak_ptr<RetryDriver> driver;
  TransferOp op;                               // the attempt template: everything but `attempt` stays
  BackendType backend = BackendType::Unknown;  // of the current attempt
  std::string peer_key;
  bool alternative = false;
  Deadline deadline;
  int64_t next_backoff_ms = 0;
};

RetryDriver::RetryDriver(RetryPolicy retry, FailoverPolicy failover) : policy_(retry), health_(failover) {}

RetryDriver::~RetryDriver() { Shutdown(); }

void RetryDriver::SetRouter(Router router) {
  std::lock_guard<std::mutex> lk(mu_);
  router_ = std::move(router);
}

RetryDriver::Router RetryDriver::CurrentRouter() const {
  std::lock_guard<std::mutex> lk(mu_);
  return router_;
}

void RetryDriver::Shutdown() {
  if (shut_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    router_ = nullptr;  // the engine it calls into is going away
  }
  delays_.Stop();
}

RetryStats RetryDriver::Stats() const { return {retries_.load(), recovered_.load(), exhausted_.load()}; }

void RetryDriver::Track(const TransferOp& op, TransferPath& path) {
  if (!policy_.enabled || policy_.max_attempts <= 1) return;
  auto t = std::make_shared<Transfer>();
  t->driver = weak_from_this();
  t->op = op;  // kept for the retries (the backend takes `op`; the segment list is shared, not copied)
  t->backend = path.backend->Type();
  t->peer_key = std::move(path.peer_key);
  t->alternative = path.alternative;
  int64_t bound = policy_.budget_ms;
  const int64_t op_timeout = path.backend->OpTimeoutMs();
  if (op_timeout >= 0) bound = std::min(bound, op_timeout);
  t->deadline = DeadlineAfterMs(bound);
  t->next_backoff_ms = policy_.backoff_ms;
  Arm(t);
}

void RetryDriver::Submit(TransferOp op, TransferPath path) {
  Track(op, path);
  path.peer->Submit(std::move(op));
}

void RetryDriver::SubmitGroup(std::vector<std::pair<TransferOp, TransferPath>> ops) {
  // One group per backend, in the order the backends first appear.
  std::vector<std::pair<std::shared_ptr<Backend>, std::vector<PeerOp>>> groups;
  for (auto& entry : ops) {
    TransferOp& op = entry.first;
    TransferPath& path = entry.second;
    Track(op, path);
    const std::shared_ptr<Backend>& backend = path.backend;
    auto g = std::find_if(groups.begin(), groups.end(), [&backend](const auto& x) { return x.first == backend; });
    if (g == groups.end()) g = groups.insert(groups.end(), {path.backend, {}});
    g->second.push_back({std::move(path.peer), std::move(op)});
  }
  for (auto& [backend, group] : groups) backend->SubmitGroup(std::move(group));
}

void RetryDriver::Arm(const std::shared_ptr<Transfer>& t) {
  t->op.status->SetOutcomeHook([t](StatusCode code, std::string* msg, bool path_failed) {
    auto d = t->driver.lock();
    return d && d->OnOutcome(t, code, msg, path_failed);
  });
}

bool RetryDriver::OnOutcome(const std::shared_ptr<Transfer>& t, StatusCode code, std::string* msg, bool path_failed) {
  const int attempts = t->op.attempt + 1;
  if (!IsError(code)) {
    health_.Succeeded(t->peer_key, t->backend);
    if (attempts > 1) recovered_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  if (!path_failed) {
    if (attempts > 1) *msg = "attempt " + std::to_string(attempts) + " of the transfer failed: " + *msg;
    return false;
  }
  health_.Failed(t->peer_key, t->backend, *msg, t->alternative);
  const char* why_not = nullptr;
  if (shut_.load()) {
    why_not = "the engine is shutting down";
  } else if (attempts >= policy_.max_attempts) {
    why_not = "no attempts left";
  } else if (Clock::now() + std::chrono::milliseconds(t->next_backoff_ms) >= t->deadline) {
    why_not = "the retry budget (min of retry_budget_ms and the backend's op_timeout_ms) is spent";
  }
  if (why_not) {
    exhausted_.fetch_add(1, std::memory_order_relaxed);
    *msg = "transfer failed after " + std::to_string(attempts) + " attempt(s) (" + why_not + "); last over " +
           BackendTypeName(t->backend) + ": " + *msg;
    return false;
  }
  const int64_t delay = t->next_backoff_ms;
  t->next_backoff_ms *= 2;
  delays_.After(delay, [t, code, msg = *msg](bool run) {
    auto d = t->driver.lock();
    if (run && d) return d->Retry(t, code, msg);
    t->op.status->Update(code, msg + " (the engine shut down while a retry waited)");
  });
  return true;
}

StatusCode RetryDriver::Route(const MemoryDesc& local, const MemoryDesc& remote, TransferPath* path,
                              std::string* msg) const {
  Router router = CurrentRouter();
  if (!router) {
    *msg = "the engine is shut down";
    return StatusCode::ERR_BAD_STATE;
  }
  return router(local, remote, path, msg);
}

void RetryDriver::Retry(const std::shared_ptr<Transfer>& t, StatusCode last_code, const std::string& last_msg) {
  TransferPath path;
  std::string msg;
  if (Route(t->op.local->desc, t->op.remote, &path, &msg) != StatusCode::SUCCESS) {
    // Nothing to retry on (the backend or engine went away): the failure
    // that made us try is the one to report.
    exhausted_.fetch_add(1, std::memory_order_relaxed);
    t->op.status->Update(last_code, last_msg + " (no path for a retry: " + msg + ")");
    return;
  }
  retries_.fetch_add(1, std::memory_order_relaxed);
  ++t->op.attempt;
  t->backend = path.backend->Type();
  t->alternative = path.alternative;
  MORI_LOG(Debug, "retrying transfer " << t->op.uid << " to engine '" << t->peer_key << "' over "
                                       << BackendTypeName(t->backend) << " (attempt " << t->op.attempt + 1 << ")");
  TransferOp op = t->op;
  Arm(t);
  path.peer->Submit(std::move(op));
}

}  // namespace mori_torch
