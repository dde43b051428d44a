#include "core/event_loop.h"

#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>

#include "base/config_table.h"
#include "core/cpu.h"
#include "core/logging.h"
#include "core/net.h"
#include "core/thread_name.h"
#include "core/types.h"

namespace mori_torch {

WorkerPool::WorkerPool(std::string name, std::string thread_name, int threads)
    : name_(std::move(name)), thread_name_(std::move(thread_name)) {
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

WorkerPool::~WorkerPool() { Stop(); }

bool WorkerPool::Post(std::function<void()> fn) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_) return false;
  q_.push_back(std::move(fn));
  cv_.notify_one();
  return true;
}

void WorkerPool::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) return;
    stopping_ = true;
    cv_.notify_all();
  }
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  // Dropped tasks are destroyed outside mu_: one may hold the last reference
  // to an object whose destructor takes its own lock, which other threads
  // hold while they Post().
  std::deque<std::function<void()>> dropped;
  {
    std::lock_guard<std::mutex> lk(mu_);
    dropped.swap(q_);
  }
}

void WorkerPool::Run() {
  SetThreadName(thread_name_.c_str());
  while (true) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stopping_ || !q_.empty(); });
      if (stopping_) return;
      fn = std::move(q_.front());
      q_.pop_front();
    }
    try {
      fn();
    } catch (const std::exception& e) {
      MORI_LOG(Error, name_ << ": task failed: " << e.what());
    }
  }
}

namespace {

// MORI_TORCH_LOOP_SPIN_US, with -1 (the default) resolved by the CPUs this
// process may use: measured 4 KiB TCP round trips at 0.77-1.04x a plain
// socket's without the window and 0.56x with it on 2 vCPUs, but 4 ms when
// those 2 were oversubscribed; on 32 cores 1.72-1.87x without, 1.14-1.53x
// with (docs/BENCHMARK.md). Where CPUs are many, spare ones are likely.
int64_t LoopSpinUs() {
  const int64_t v = config::EnvInt("MORI_TORCH_LOOP_SPIN_US");
  if (v >= 0) return v;
  constexpr int kManyCpus = 16;
  constexpr int64_t kSpinUs = 50;
  return UsableCpus() >= kManyCpus ? kSpinUs : 0;
}

}  // namespace

EventLoop::EventLoop(int threads) : spin_us_(LoopSpinUs()) {
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) throw Error(StatusCode::ERR_BAD_STATE, std::string("epoll_create1: ") + std::strerror(errno));
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ::close(epfd_);
    throw Error(StatusCode::ERR_BAD_STATE, std::string("eventfd: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;  // level-triggered: once written, every thread sees it
  ev.data.u64 = UINT64_MAX;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
}

EventLoop::~EventLoop() {
  Stop();
  ::close(wake_fd_);
  ::close(epfd_);
}

void EventLoop::Stop() {
  if (stopping_.exchange(true)) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : watches_) ::epoll_ctl(epfd_, EPOLL_CTL_DEL, kv.first, nullptr);
  watches_.clear();
}

void EventLoop::Add(int fd, uint32_t events, int64_t idle_ms, Handler h) {
  std::lock_guard<std::mutex> lk(mu_);
  auto w = std::make_shared<Watch>(Watch{fd, next_gen_++, std::move(h), idle_ms, SteadyMs(), false, {}});
  epoll_event ev{};
  ev.events = events | EPOLLONESHOT;
  ev.data.u64 = (w->gen << 32) | static_cast<uint32_t>(fd);
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    throw Error(StatusCode::ERR_BAD_STATE, std::string("epoll_ctl(ADD): ") + std::strerror(errno));
  }
  watches_[fd] = std::move(w);
}

void EventLoop::Rearm(int fd, uint32_t events, int64_t idle_ms) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = watches_.find(fd);
  if (it == watches_.end()) return;
  if (idle_ms != kKeepIdle) it->second->idle_ms = idle_ms;
  it->second->armed_at_ms = SteadyMs();
  epoll_event ev{};
  ev.events = events | EPOLLONESHOT;
  ev.data.u64 = (it->second->gen << 32) | static_cast<uint32_t>(fd);
  ::epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev);
}

void EventLoop::Remove(int fd) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = watches_.find(fd);
  if (it == watches_.end()) return;
  std::shared_ptr<Watch> w = std::move(it->second);
  watches_.erase(it);
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  if (w->runner != std::this_thread::get_id()) done_cv_.wait(lk, [&] { return !w->running; });
}

void EventLoop::Dispatch(const std::shared_ptr<Watch>& w, uint32_t events) {
  try {
    w->handler(events);
  } catch (const std::exception& e) {
    MORI_LOG(Error, "event loop: handler of fd " << w->fd << " failed: " << e.what());
  }
  std::lock_guard<std::mutex> lk(mu_);
  w->running = false;
  w->runner = std::thread::id();
  done_cv_.notify_all();
}

void EventLoop::Every(int period_ms, std::function<void()> fn) {
  std::lock_guard<std::mutex> lk(mu_);
  periodic_.push_back({period_ms, SteadyMs() + period_ms, std::move(fn)});
}

size_t EventLoop::Watched() {
  std::lock_guard<std::mutex> lk(mu_);
  return watches_.size();
}

void EventLoop::CheckIdle() {
  const int64_t now = SteadyMs();
  std::vector<std::shared_ptr<Watch>> idle;
  std::vector<std::function<void()>*> due;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& kv : watches_) {
      Watch& w = *kv.second;
      if (w.idle_ms < 0 || w.armed_at_ms < 0 || now - w.armed_at_ms < w.idle_ms) continue;
      w.armed_at_ms = -1;  // taken: a readiness report racing with this one is ignored
      w.running = true;
      w.runner = std::this_thread::get_id();
      epoll_event ev{};
      ev.data.u64 = (w.gen << 32) | static_cast<uint32_t>(w.fd);
      ::epoll_ctl(epfd_, EPOLL_CTL_MOD, w.fd, &ev);  // disarmed until re-armed
      idle.push_back(kv.second);
    }
  }
  for (auto& w : idle) Dispatch(w, kIdle);
  if (periodic_running_.exchange(true)) return;  // another loop thread runs them
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& p : periodic_) {
      if (now < p.next_ms) continue;
      p.next_ms = now + p.period_ms;
      run.push_back(p.fn);
    }
  }
  for (auto& fn : run) {
    try {
      fn();
    } catch (const std::exception& e) {
      MORI_LOG(Error, "event loop: periodic task failed: " << e.what());
    }
  }
  periodic_running_.store(false);
}

void EventLoop::Run() {
  SetThreadName("mori-loop");
  constexpr int kTickMs = 50;
  epoll_event evs[64];
  int64_t next_check = SteadyMs() + kTickMs;
  auto spin_until = std::chrono::steady_clock::time_point::min();
  while (!stopping_.load()) {
    const bool spinning = spin_us_ > 0 && std::chrono::steady_clock::now() < spin_until;
    int n = ::epoll_wait(epfd_, evs, 64, spinning ? 0 : kTickMs);
    if (n > 0 && spin_us_ > 0) spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    if (n == 0 && spinning) std::this_thread::yield();
    if (n < 0 && errno != EINTR) {
      MORI_LOG(Error, "event loop: epoll_wait: " << std::strerror(errno));
      return;
    }
    for (int i = 0; i < n && !stopping_.load(); ++i) {
      if (evs[i].data.u64 == UINT64_MAX) continue;  // the wake fd: Stop()
      const int fd = static_cast<int>(evs[i].data.u64 & 0xffffffffu);
      const uint64_t gen = evs[i].data.u64 >> 32;
      std::shared_ptr<Watch> w;
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = watches_.find(fd);
        if (it == watches_.end() || it->second->gen != gen || it->second->armed_at_ms < 0) continue;
        it->second->armed_at_ms = -1;
        it->second->running = true;
        it->second->runner = std::this_thread::get_id();
        w = it->second;
      }
      Dispatch(w, evs[i].events);
    }
    if (stopping_.load()) return;
    const int64_t now = SteadyMs();
    if (now >= next_check) {
      next_check = now + kTickMs;
      CheckIdle();
    }
  }
}

}  // namespace mori_torch
