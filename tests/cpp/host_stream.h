// A host thread standing in for a GPU stream (StreamDriver), so the enqueue
// path's protocol runs without a GPU: work items run in order on one thread;
// "device" memory is host memory; a wait holds every later item, as a stream
// wait-value does. Capture records the items into a graph that Replay puts on
// the stream again (with the graph's user-object releases run by Destroy).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "stream/stream_driver.h"

namespace mori_torch {
namespace testing_util {

class HostStream : public StreamDriver {
 public:
  struct Graph {
    std::vector<std::function<void()>> items;
    std::vector<std::pair<void (*)(void*), void*>> releases;
  };

  HostStream() : worker_([this] { Run(); }) {}
  ~HostStream() override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  void BeginCapture() { capture_ = std::make_unique<Graph>(); }
  std::unique_ptr<Graph> EndCapture() { return std::move(capture_); }
  void Replay(const Graph& g) {
    for (const auto& item : g.items) Push(item);
  }
  // What destroying a CUDA graph does to its user objects.
  void Destroy(std::unique_ptr<Graph> g) {
    Synchronize();
    for (auto& r : g->releases) r.first(r.second);
  }
  // False when a wait was still holding the stream after `timeout_ms`.
  bool Synchronize(int timeout_ms = 30000) {
    std::unique_lock<std::mutex> lk(mu_);
    return idle_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return queue_.empty() && !busy_; });
  }

  bool Capturing() override { return capture_ != nullptr; }
  void Copy(void* dst, const void* src, size_t bytes) override {
    Push([=] { std::memcpy(dst, src, bytes); });
  }
  void* AllocScratch(size_t bytes) override { return std::calloc(1, bytes ? bytes : 1); }
  ScratchFree scratch_free() override {
    return [](void* p, int) { std::free(p); };
  }
  int scratch_domain() override { return -1; }
  void PackOffsets(const int64_t* sizes, int64_t stride, int64_t count, int64_t* packed) override {
    Push([=] {
      int64_t at = 0;
      for (int64_t i = 0; i < count; ++i) {
        packed[i] = at;
        const int64_t v = sizes[i * stride];
        at += v < 0 ? 0 : v;
      }
    });
  }
  // The copy kernel's rules, on the host: a skip flag, every segment checked
  // against both sides, refused segments move nothing.
  void CopySegments(const gpu::StreamCopyArgs& a) override {
    Push([a, this] {
      if (a.skip_flag && __atomic_load_n(a.skip_flag, __ATOMIC_ACQUIRE) != 0) {
        skipped_copies.fetch_add(1);
        return;
      }
      for (int64_t i = 0; i < a.count; ++i) {
        gpu::SegmentBytes b;
        if (!gpu::SegmentAt(a, i, &b) || !gpu::InsideRange(b.local_offset, b.size, a.local_size) ||
            !gpu::InsideRange(b.remote_offset, b.size, a.remote_size)) {
          refused_segments.fetch_add(1);
          continue;
        }
        auto* local = reinterpret_cast<char*>(a.local_base + b.local_offset);
        auto* remote = reinterpret_cast<char*>(a.remote_base + b.remote_offset);
        if (a.is_read) {
          std::memcpy(local, remote, b.size);
        } else {
          std::memcpy(remote, local, b.size);
        }
      }
    });
  }
  void WriteFlag(uint32_t* flag, uint32_t value) override {
    Push([=] { __atomic_store_n(flag, value, __ATOMIC_RELEASE); });
  }
  void WaitFlag(uint32_t* flag, uint32_t value) override {
    Push([=] {
      while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) != value) {
        if (stop_) return;
        std::this_thread::yield();
      }
    });
  }
  bool ReleaseWithGraph(void (*release)(void*), void* context) override {
    if (!capture_) return false;
    capture_->releases.emplace_back(release, context);
    return true;
  }
  bool is_gpu_stream() const override { return false; }
  gpu::Stream native() override { return nullptr; }

  std::atomic<int> skipped_copies{0};
  std::atomic<int> refused_segments{0};

 private:
  void Push(std::function<void()> item) {
    if (capture_) {
      capture_->items.push_back(std::move(item));
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_one();
  }
  void Run() {
    std::unique_lock<std::mutex> lk(mu_);
    while (true) {
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      auto item = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lk.unlock();
      item();
      lk.lock();
      busy_ = false;
      if (queue_.empty()) idle_cv_.notify_all();
    }
  }

  std::unique_ptr<Graph> capture_;
  std::mutex mu_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;
  std::atomic<bool> stop_{false};
  std::thread worker_;
};

}  // namespace testing_util
}  // namespace mori_torch
