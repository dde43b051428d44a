// Retry over a fresh path. A transfer whose path breaks (the backend ends it
// with TransferStatus::Update(..., path_failed=true): connection reset or
// closed, QP in error, IPC open failed) is issued again: up to
// max_attempts in all, after an exponential backoff, within budget_ms and
// never past the backend's op timeout, each time where the engine's router
// sends it now (a fresh connection of the same backend, or the next capable
// backend once failover.h marked the path down). Only path failures are
// retried: bounds, auth, deregistration and timeout errors end the transfer
// at once. Retrying is safe because an abandoned attempt's bytes never land
// after the retry's (the no-late-writes fence, tcp_protocol.h, and
// attempt_fence.h at the target) and notices count each part once
// (notification_table.h). The caller sees success, or one error naming the
// attempts.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/backend.h"
#include "core/delay_queue.h"
#include "core/failover.h"

namespace mori_torch {

struct RetryPolicy {
  bool enabled = true;
  int max_attempts = 4;       // attempts in all, the first included
  int64_t backoff_ms = 5;     // before the first retry; doubles after each
  int64_t budget_ms = 30000;  // from submit to the last retry's start
};

// Where an attempt goes.
struct TransferPath {
  std::shared_ptr<Backend> backend;
  std::shared_ptr<BackendPeer> peer;
  std::string peer_key;                        // the remote engine
  bool alternative = false;                    // another capable backend could serve the pair
  std::shared_ptr<TransferCounters> counters;  // of (remote engine, this backend)
};

struct RetryStats {
  uint64_t retries = 0;    // attempts after the first
  uint64_t recovered = 0;  // transfers that succeeded after a retry
  uint64_t exhausted = 0;  // transfers that failed after every attempt
};

class RetryDriver : public std::enable_shared_from_this<RetryDriver> {
 public:
  // Picks the path of an attempt; SUCCESS or an error code with *msg.
  using Router = std::function<StatusCode(const MemoryDesc& local, const MemoryDesc& remote, TransferPath* path,
                                          std::string* msg)>;

  RetryDriver(RetryPolicy retry, FailoverPolicy failover);
  ~RetryDriver();
  void SetRouter(Router router);

  // Submits op's first attempt on `path`; retries go where the router says.
  void Submit(TransferOp op, TransferPath path);
  // The first attempts of several transfers from one call: those on the same
  // backend reach it together (Backend::SubmitGroup); retries go one by one.
  void SubmitGroup(std::vector<std::pair<TransferOp, TransferPath>> ops);
  // Where a transfer of the pair goes now (the router's answer).
  StatusCode Route(const MemoryDesc& local, const MemoryDesc& remote, TransferPath* path, std::string* msg) const;
  // Ends retrying: pending retries end with an error, later path failures
  // end their transfers. Idempotent.
  void Shutdown();

  PathHealth& health() { return health_; }
  RetryStats Stats() const;
  const RetryPolicy& policy() const { return policy_; }

 private:
  struct Transfer;
  // Keeps op (sharing its segments) for retries on other paths and hooks its
  // status, unless retrying is off; the first attempt is the caller's to send.
  void Track(const TransferOp& op, TransferPath& path);
  // The status's outcome hook for the current attempt of `t`.
  static void Arm(const std::shared_ptr<Transfer>& t);
  bool OnOutcome(const std::shared_ptr<Transfer>& t, StatusCode code, std::string* msg, bool path_failed);
  // Attempt after one that failed with (last_code, last_msg).
  void Retry(const std::shared_ptr<Transfer>& t, StatusCode last_code, const std::string& last_msg);
  // The router, or an empty one once shut down.
  Router CurrentRouter() const;

  const RetryPolicy policy_;
  PathHealth health_;
  DelayQueue delays_;
  mutable std::mutex mu_;
  Router router_;
  std::atomic<bool> shut_{false};
  std::atomic<uint64_t> retries_{0}, recovered_{0}, exhausted_{0};
};

}  // namespace mori_torch
