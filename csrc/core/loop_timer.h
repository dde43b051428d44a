// A one-shot timer on an EventLoop: a timerfd the loop watches, so arming a
// delayed call costs the caller one system call and wakes no thread until it
// is due.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "core/event_loop.h"

namespace mori_torch {

class LoopTimer {
 public:
  // fn runs on a loop thread each time an armed timer is due. The loop must
  // outlive the timer or its Stop(). Throws Error if the timer cannot be made
  // or watched.
  static std::shared_ptr<LoopTimer> Make(EventLoop* loop, std::function<void()> fn);
  ~LoopTimer() { Stop(); }
  LoopTimer(const LoopTimer&) = delete;
  LoopTimer& operator=(const LoopTimer&) = delete;

  // Runs fn about delay_us from now, unless the timer is already armed (the
  // earlier deadline stands) or stopped. Safe from any thread. The timer is
  // disarmed before fn runs, so whatever arrives during fn arms it again.
  void ArmIfIdle(int64_t delay_us);
  // Off the loop (waits for a running fn unless called from it) and closed;
  // fn never runs again. Idempotent.
  void Stop();

 private:
  LoopTimer(EventLoop* loop, std::function<void()> fn) : loop_(loop), fn_(std::move(fn)) {}
  void OnDue();

  EventLoop* const loop_;
  const std::function<void()> fn_;
  std::mutex mu_;  // fd_ against Stop (taken only to arm and to stop)
  int fd_ = -1;
  std::atomic<bool> armed_{false};
};

}  // namespace mori_torch
