// Completion threads. Each owns a set of CQs and hands every work completion
// to the CQ's owner. POLLING: polls its CQs back to back, backing off to
// short sleeps when nothing completes for a while. EVENT: blocks on the
// rails' completion channels (and an eventfd for shutdown) and polls only
// the CQs that signalled.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backends/rdma/rdma_config.h"
#include "backends/rdma/rdma_device.h"
#include "core/net.h"

namespace mori_torch {
namespace rdma {

class CqOwner {
 public:
  virtual ~CqOwner() = default;
  // Runs on a completion thread (or the thread draining a QP at teardown).
  virtual void OnCompletion(const ibv_wc& wc) = 0;
  // Runs on the completion thread at least every kProgressCheckMs while it
  // returns true: whether work is in flight (the owner judges a stall).
  virtual bool CheckProgress(Clock::time_point /*now*/) { return false; }
};

// How often completion threads ask their CQs' owners about stalls while
// work is in flight (CqOwner::CheckProgress).
constexpr int kProgressCheckMs = 100;

// Polls `cq` empty, handing each completion to `owner`; returns how many.
int DrainCq(ibv_cq* cq, CqOwner* owner);

// The name (comm) of every completion thread.
constexpr const char* kCompletionThreadName = "mori-rdma-cq";

class CompletionWorker {
 public:
  CompletionWorker(PollCqMode mode, const std::vector<std::shared_ptr<RdmaDevice>>& rails);
  ~CompletionWorker();
  // The completion channel CQs on `rail` must be created with (nullptr when polling).
  ibv_comp_channel* Channel(size_t rail) const { return channels_.empty() ? nullptr : channels_[rail]; }
  void Add(ibv_cq* cq, CqOwner* owner);
  // After it returns, the worker no longer touches `cq`.
  void Remove(ibv_cq* cq);
  // An owner posted work while it had none in flight: an EVENT thread asleep
  // without a timeout wakes up to watch it (CheckProgress). Cheap otherwise.
  void WorkPosted();

 private:
  using Owners = std::vector<std::pair<ibv_cq*, CqOwner*>>;
  void PollLoop();
  void EventLoop();
  // mu_ held: `owners` copied from cqs_ again if an Add or Remove came since
  // *seen_version (a loop's own copy, so each wake-up copies nothing).
  void Refresh(Owners* owners, uint64_t* seen_version);
  // CheckProgress on every owner (mu_ held); true if any has work in flight.
  bool CheckAll(Clock::time_point now, const Owners& owners);

  const PollCqMode mode_;
  std::vector<std::shared_ptr<RdmaDevice>> rails_;
  std::vector<ibv_comp_channel*> channels_;
  int wake_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};  // EVENT: blocked with nothing in flight to watch
  std::mutex mu_;                      // held while polling, so Remove waits for a running poll
  std::unordered_map<ibv_cq*, CqOwner*> cqs_;
  std::atomic<uint64_t> version_{0};
  std::thread thread_;
};

}  // namespace rdma
}  // namespace mori_torch
