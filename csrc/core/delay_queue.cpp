#include "core/delay_queue.h"

#include <vector>

namespace mori_torch {

void DelayQueue::After(int64_t delay_ms, Task task) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!stopped_) {
      tasks_.emplace(DeadlineAfterMs(delay_ms < 0 ? 0 : delay_ms), std::move(task));
      if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
      cv_.notify_one();
      return;
    }
  }
  task(false);
}

void DelayQueue::Stop() {
  std::multimap<Deadline, Task> left;
  std::thread t;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopped_ = true;
    left.swap(tasks_);
    t.swap(thread_);
    cv_.notify_all();
  }
  if (t.joinable()) t.join();
  for (auto& kv : left) kv.second(false);
}

size_t DelayQueue::Pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  return tasks_.size();
}

void DelayQueue::Loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stopped_) {
    if (tasks_.empty()) {
      cv_.wait(lk);
      continue;
    }
    auto first = tasks_.begin();
    if (Clock::now() < first->first) {
      cv_.wait_until(lk, first->first);
      continue;
    }
    Task task = std::move(first->second);
    tasks_.erase(first);
    lk.unlock();
    task(true);
    lk.lock();
  }
}

}  // namespace mori_torch
