// The status object every transfer returns at once. Thread-safe: backends
// complete it from their threads while callers poll or wait on it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/transfer_stats.h"
#include "core/types.h"

namespace mori_torch {

class TransferStatus {
 public:
  TransferStatus() = default;
  TransferStatus(const TransferStatus&) = delete;
  TransferStatus& operator=(const TransferStatus&) = delete;

  // Code() runs the progress hook first, so polling alone drives
  // poll-completed transfers (GPU events) to their end, and a poller of a
  // small TCP transfer receives its response itself.
  StatusCode Code();
  StatusCode PeekCode() const { return static_cast<StatusCode>(code_.load(std::memory_order_acquire)); }
  std::string Message() const;

  bool Init() { return Code() == StatusCode::INIT; }
  bool InProgress() { return Code() == StatusCode::IN_PROGRESS; }
  bool Succeeded() { return Code() == StatusCode::SUCCESS; }
  bool Failed() { return IsError(Code()); }

  // Moves the status forward. Once an error is set it sticks: later calls,
  // SUCCESS included, are ignored (first error wins). `path_failed` marks an
  // error of the path (connection reset or closed, QP in error): the bytes
  // may be re-sent over another connection or backend (core/retry_driver.h).
  // Bounds, auth, deregistration and timeout errors are never path errors.
  void Update(StatusCode code, const std::string& message = "", bool path_failed = false);

  // Sees the terminal outcome of one attempt before the caller does; may
  // rewrite the message. Returning true takes the outcome (the status stays
  // in progress: another attempt will end it). One-shot: called at most once
  // per installation, with no lock of the status held.
  using OutcomeHook = std::function<bool(StatusCode code, std::string* message, bool path_failed)>;
  void SetOutcomeHook(OutcomeHook hook);
  // Raw setters for user-owned statuses (mori.io compatibility).
  void SetCode(StatusCode code);
  void SetMessage(const std::string& message);

  // Blocks until the status is terminal.
  void Wait();
  // timeout_ms < 0: wait until terminal; 0: poll once; > 0: wait at most that
  // long. Returns the code seen last (IN_PROGRESS at the deadline).
  StatusCode WaitFor(int64_t timeout_ms);

  // Installed by backends whose completion is polled. Called with no lock
  // held, possibly from several threads at once. `polled_only`: nothing but
  // polling ends the transfer (a GPU event), so Wait() polls too; false: a
  // poll only may end it sooner (another thread ends it anyway), so Wait()
  // sleeps until told as for any status.
  void SetProgressHook(std::function<void()> hook, bool polled_only = true);

  // The engine's counters for this transfer: ended (TransferCounters::End)
  // with the first terminal code, on the thread that sets it.
  void SetRecord(TransferRecord record);

 private:
  void NotifyIfTerminal(StatusCode code);
  // mu_ held: hands out the record when `code` ends the transfer.
  TransferRecord TakeRecordIfEnded(StatusCode old_code, StatusCode code);
  static void EndRecord(TransferRecord& r, StatusCode code);

  std::atomic<int> code_{static_cast<int>(StatusCode::INIT)};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string message_;
  std::shared_ptr<std::function<void()>> progress_;
  bool polled_only_ = false;  // of progress_ (SetProgressHook)
  TransferRecord record_;
  OutcomeHook outcome_;
};

using StatusPtr = std::shared_ptr<TransferStatus>;

inline StatusPtr MakeStatus(StatusCode code = StatusCode::IN_PROGRESS, const std::string& msg = "") {
  auto s = std::make_shared<TransferStatus>();
  s->Update(code, msg);
  return s;
}

}  // namespace mori_torch
