#include "core/loop_timer.h"

#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/types.h"

namespace mori_torch {

std::shared_ptr<LoopTimer> LoopTimer::Make(EventLoop* loop, std::function<void()> fn) {
  std::shared_ptr<LoopTimer> t(new LoopTimer(loop, std::move(fn)));
  t->fd_ = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (t->fd_ < 0) throw Error(StatusCode::ERR_BAD_STATE, std::string("timerfd_create: ") + std::strerror(errno));
  // Weak: a timer dropped by its owner while due ends once its fn returns.
  std::weak_ptr<LoopTimer> weak = t;
  try {
    loop->Add(t->fd_, EPOLLIN, /*idle_ms=*/-1, [weak](uint32_t) {
      if (auto self = weak.lock()) self->OnDue();
    });
  } catch (...) {
    ::close(t->fd_);
    t->fd_ = -1;
    throw;
  }
  return t;
}

void LoopTimer::Stop() {
  int fd;
  {
    std::lock_guard<std::mutex> lk(mu_);
    fd = fd_;
    fd_ = -1;
  }
  if (fd < 0) return;
  loop_->Remove(fd);
  ::close(fd);
}

void LoopTimer::ArmIfIdle(int64_t delay_us) {
  if (armed_.load(std::memory_order_relaxed) || armed_.exchange(true)) return;
  itimerspec t{};
  delay_us = delay_us < 1 ? 1 : delay_us;  // all zeros would disarm it
  t.it_value.tv_sec = delay_us / 1000000;
  t.it_value.tv_nsec = (delay_us % 1000000) * 1000;
  std::lock_guard<std::mutex> lk(mu_);
  if (fd_ >= 0) ::timerfd_settime(fd_, 0, &t, nullptr);  // cannot fail with a valid timerfd and value
}

void LoopTimer::OnDue() {
  uint64_t expirations;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (fd_ < 0) return;
    (void)!::read(fd_, &expirations, sizeof expirations);  // clears the readiness
  }
  armed_.store(false);
  // Re-armed whatever fn does: a throw (logged by the loop) must not leave
  // the timer dead for good.
  struct Rearm {
    LoopTimer* t;
    ~Rearm() {
      std::lock_guard<std::mutex> lk(t->mu_);
      if (t->fd_ >= 0) t->loop_->Rearm(t->fd_, EPOLLIN);
    }
  } rearm{this};
  fn_();
}

}  // namespace mori_torch
