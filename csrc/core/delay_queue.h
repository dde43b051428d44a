// Runs tasks after a delay on one thread of its own, started on first use
// (an engine that never retries never starts it). Used for retry backoff.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "core/net.h"

namespace mori_torch {

class DelayQueue {
 public:
  // run == false: the queue stopped before the task's time (it must still
  // end whatever it stands for).
  using Task = std::function<void(bool run)>;

  DelayQueue() = default;
  ~DelayQueue() { Stop(); }
  DelayQueue(const DelayQueue&) = delete;
  DelayQueue& operator=(const DelayQueue&) = delete;

  // Runs task(true) once `delay_ms` have passed; after Stop(), task(false)
  // at once on the caller's thread.
  void After(int64_t delay_ms, Task task);
  // Calls every pending task with false, then joins the thread. Idempotent.
  void Stop();
  size_t Pending() const;

 private:
  void Loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<Deadline, Task> tasks_;
  std::thread thread_;
  bool stopped_ = false;
};

}  // namespace mori_torch
