// The engine's I/O threads: an epoll reactor (EventLoop) that waits on every
// socket the engine serves, and bounded pools of workers (WorkerPool) that it
// hands ready sockets to. Thread count depends on configuration only, never
// on how many connections are open.
#pragma once

#include <sys/epoll.h>

#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace mori_torch {

// A fixed set of threads running posted tasks in order of posting.
class WorkerPool {
 public:
  // `name` goes into log lines, `thread_name` (<= 15 bytes, "mori-...")
  // names its threads.
  WorkerPool(std::string name, std::string thread_name, int threads);
  ~WorkerPool();  // Stop()
  // Runs fn on a worker; false (fn dropped) once stopped.
  bool Post(std::function<void()> fn);
  // Finishes the running tasks, drops queued ones, joins. Idempotent.
  void Stop();
  int threads() const { return static_cast<int>(threads_.size()); }

 private:
  void Run();
  const std::string name_;
  const std::string thread_name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// epoll reactor, one-shot: a watched fd reports readiness once and stays
// quiet until its owner re-arms it, so its handler never runs on two loop
// threads at a time (an owner that also reads the fd from other threads,
// as the TCP data connections' pollers do, arbitrates that itself). An armed fd that stays quiet longer than its idle
// timeout is reported once with kIdle instead.
class EventLoop {
 public:
  static constexpr uint32_t kIdle = 1u << 30;  // not an epoll bit
  // events: the epoll bits that fired, or kIdle.
  using Handler = std::function<void(uint32_t events)>;

  explicit EventLoop(int threads = 1);
  ~EventLoop();  // Stop()
  // Starts watching fd for `events` (EPOLLIN, EPOLLOUT, ...). idle_ms < 0:
  // no idle timeout. Throws Error on failure.
  void Add(int fd, uint32_t events, int64_t idle_ms, Handler h);
  // Arms fd again after a report, with a new idle timeout (kKeepIdle: the
  // one it had). No-op if it was removed.
  static constexpr int64_t kKeepIdle = INT64_MIN;
  void Rearm(int fd, uint32_t events, int64_t idle_ms = kKeepIdle);
  // Whether the loop polls epoll for a while after events (spin_us_) rather
  // than sleeping at once.
  bool Spins() const { return spin_us_ > 0; }
  // One loop thread (the default): an fd's handler and another thread's
  // re-arm of it can never start a second run of that handler meanwhile.
  bool OneThread() const { return threads_.size() == 1; }
  // Stops watching fd. When it returns, fd's handler is not running (unless
  // called from that handler) and will not run again, so the fd may close.
  void Remove(int fd);
  // Runs fn on a loop thread every period_ms (housekeeping: timeouts, retries).
  void Every(int period_ms, std::function<void()> fn);
  // Joins the loop threads; handlers are not called afterwards. Idempotent.
  void Stop();
  size_t Watched();

 private:
  struct Watch {
    int fd;
    uint64_t gen;
    Handler handler;
    int64_t idle_ms;
    int64_t armed_at_ms;  // -1 while not armed (reported, being handled)
    bool running = false;
    std::thread::id runner;
  };
  // Runs w's handler, marked running for Remove().
  void Dispatch(const std::shared_ptr<Watch>& w, uint32_t events);
  void Run();
  void CheckIdle();

  // After handling events, epoll is polled without sleeping for this long
  // (MORI_TORCH_LOOP_SPIN_US; by default 50 us with 16 or more CPUs, else
  // 0): the next message of a conversation (a response, the next small
  // request) is then found without a wake-up. Off on small machines: with
  // more runnable threads than cores the spinning loops starve the one that
  // has work (4 ms p50 measured on 2 vCPUs, against 40-90 us without).
  int64_t spin_us_ = 0;
  int epfd_ = -1;
  int wake_fd_ = -1;  // eventfd: wakes the threads for Stop()
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable done_cv_;
  uint64_t next_gen_ = 1;
  std::unordered_map<int, std::shared_ptr<Watch>> watches_;
  struct Periodic {
    int period_ms;
    int64_t next_ms;
    std::function<void()> fn;
  };
  std::vector<Periodic> periodic_;
  std::atomic<bool> periodic_running_{false};
  std::vector<std::thread> threads_;
};

}  // namespace mori_torch
