#include "core/transfer_status.h"

#include <chrono>
#include <thread>

#include "core/cpu.h"
#include "gpu/trace_ranges.h"

namespace mori_torch {

StatusCode TransferStatus::Code() {
  StatusCode c = PeekCode();
  if (!IsTerminal(c)) {
    std::shared_ptr<std::function<void()>> hook;
    {
      std::lock_guard<std::mutex> lk(mu_);
      hook = progress_;
    }
    if (hook) {
      (*hook)();
      c = PeekCode();
    }
  }
  return c;
}

std::string TransferStatus::Message() const {
  std::lock_guard<std::mutex> lk(mu_);
  return message_;
}

void TransferStatus::Update(StatusCode code, const std::string& message, bool path_failed) {
  if (IsTerminal(code)) {
    OutcomeHook hook;
    {
      std::lock_guard<std::mutex> lk(mu_);
      hook.swap(outcome_);
      // The attempt that ended is polled no more (a retry sets its own hook):
      // a stale one would have Wait() spin as if a GPU event could end it.
      if (hook) progress_.reset();
    }
    if (hook) {
      std::string msg = message;
      if (hook(code, &msg, path_failed)) return;
      return Update(code, msg);
    }
  }
  TransferRecord ended;
  {
    std::lock_guard<std::mutex> lk(mu_);
    StatusCode cur = PeekCode();
    if (IsError(cur)) return;
    if (cur == StatusCode::SUCCESS && !IsError(code)) return;
    message_ = message;
    code_.store(static_cast<int>(code), std::memory_order_release);
    if (IsTerminal(code)) progress_.reset();
    ended = TakeRecordIfEnded(cur, code);
  }
  EndRecord(ended, code);
  NotifyIfTerminal(code);
}

void TransferStatus::SetCode(StatusCode code) {
  TransferRecord ended;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ended = TakeRecordIfEnded(PeekCode(), code);
    code_.store(static_cast<int>(code), std::memory_order_release);
  }
  EndRecord(ended, code);
  NotifyIfTerminal(code);
}

void TransferStatus::SetRecord(TransferRecord record) {
  std::lock_guard<std::mutex> lk(mu_);
  record_ = std::move(record);
}

TransferRecord TransferStatus::TakeRecordIfEnded(StatusCode old_code, StatusCode code) {
  if (IsTerminal(old_code) || !IsTerminal(code)) return {};
  return std::move(record_);
}

void TransferStatus::EndRecord(TransferRecord& r, StatusCode code) {
  if (r.counters) r.counters->End(r.is_read, r.bytes, code, StatsNowNs() - r.start_ns);
  gpu::TraceRangeEnd(r.trace_range);
}

void TransferStatus::SetMessage(const std::string& message) {
  std::lock_guard<std::mutex> lk(mu_);
  message_ = message;
}

void TransferStatus::NotifyIfTerminal(StatusCode code) {
  if (IsTerminal(code)) cv_.notify_all();
}

void TransferStatus::SetProgressHook(std::function<void()> hook, bool polled_only) {
  std::lock_guard<std::mutex> lk(mu_);
  if (IsTerminal(PeekCode())) return;
  progress_ = std::make_shared<std::function<void()>>(std::move(hook));
  polled_only_ = polled_only;
}

void TransferStatus::SetOutcomeHook(OutcomeHook hook) {
  std::lock_guard<std::mutex> lk(mu_);
  outcome_ = std::move(hook);
}

void TransferStatus::Wait() { WaitFor(-1); }

StatusCode TransferStatus::WaitFor(int64_t timeout_ms) {
  using Clock = std::chrono::steady_clock;
  StatusCode c = Code();
  if (IsTerminal(c) || timeout_ms == 0) return c;
  const bool forever = timeout_ms < 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(forever ? 0 : timeout_ms);
  // Spin for a short while before sleeping: waking a sleeper costs tens of
  // microseconds, about what a small TCP round trip takes, and most GPU
  // copies end sooner still. Poll-completed statuses (GPU events) spin
  // longer, since nobody notifies them, and without yielding: polling alone
  // ends them (a 64 MiB copy on one H100 ended 4.9 us later on average
  // than when polled from Python while Wait() yielded). The others yield,
  // so that the thread that will end them can run on a busy machine.
  bool spin_long;
  {
    std::lock_guard<std::mutex> lk(mu_);
    spin_long = progress_ != nullptr && polled_only_;
  }
  const auto spin_until = Clock::now() + std::chrono::microseconds(spin_long ? 500 : 50);
  while (Clock::now() < spin_until && (forever || Clock::now() < deadline)) {
    c = Code();
    if (IsTerminal(c)) return c;
    if (spin_long) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
  std::unique_lock<std::mutex> lk(mu_);
  while (true) {
    c = PeekCode();
    if (IsTerminal(c)) return c;
    // Poll-completed statuses are re-polled every 20 us; others sleep until notified.
    const bool polled = progress_ != nullptr && polled_only_;
    auto until = polled ? Clock::now() + std::chrono::microseconds(20) : deadline;
    if (!forever && until > deadline) until = deadline;
    if (forever && !polled) {
      cv_.wait(lk);
    } else {
      cv_.wait_until(lk, until);
    }
    if (polled) {
      lk.unlock();
      c = Code();
      lk.lock();
      if (IsTerminal(c)) return c;
    }
    if (!forever && Clock::now() >= deadline) return PeekCode();
  }
}

}  // namespace mori_torch
