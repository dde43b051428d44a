#include "backends/rdma/rdma_completion.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include "core/logging.h"
#include "core/types.h"

namespace mori_torch {
namespace rdma {

int DrainCq(ibv_cq* cq, CqOwner* owner) {
  ibv_wc wc[32];
  int total = 0;
  for (;;) {
    int n = ibv_poll_cq(cq, 32, wc);
    if (n <= 0) return total;
    for (int i = 0; i < n; ++i) owner->OnCompletion(wc[i]);
    total += n;
  }
}

CompletionWorker::CompletionWorker(PollCqMode mode, const std::vector<std::shared_ptr<RdmaDevice>>& rails)
    : mode_(mode), rails_(rails) {
  if (mode_ == PollCqMode::EVENT) {
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) throw Error(StatusCode::ERR_RDMA_OP, std::string("RDMA: eventfd: ") + std::strerror(errno));
    for (auto& r : rails_) {
      ibv_comp_channel* ch = r->api->create_comp_channel(r->ctx);
      if (!ch) {
        for (size_t i = 0; i < channels_.size(); ++i) rails_[i]->api->destroy_comp_channel(channels_[i]);
        ::close(wake_fd_);
        throw Error(StatusCode::ERR_RDMA_OP, "RDMA: ibv_create_comp_channel failed on " + r->name);
      }
      // Non-blocking: a spurious wake-up must not block in ibv_get_cq_event.
      ::fcntl(ch->fd, F_SETFL, ::fcntl(ch->fd, F_GETFL) | O_NONBLOCK);
      channels_.push_back(ch);
    }
    thread_ = std::thread([this] { EventLoop(); });
  } else {
    thread_ = std::thread([this] { PollLoop(); });
  }
  // Named, so tools (and the tests) can tell it apart: /proc/PID/task/*/comm.
  pthread_setname_np(thread_.native_handle(), kCompletionThreadName);
}

CompletionWorker::~CompletionWorker() {
  stop_.store(true);
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)!::write(wake_fd_, &one, sizeof one);
  }
  if (thread_.joinable()) thread_.join();
  for (size_t i = 0; i < channels_.size(); ++i) rails_[i]->api->destroy_comp_channel(channels_[i]);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void CompletionWorker::Add(ibv_cq* cq, CqOwner* owner) {
  std::lock_guard<std::mutex> lk(mu_);
  cqs_[cq] = owner;
  version_.fetch_add(1, std::memory_order_release);
  if (mode_ == PollCqMode::EVENT) ibv_req_notify_cq(cq, 0);
}

void CompletionWorker::Remove(ibv_cq* cq) {
  std::lock_guard<std::mutex> lk(mu_);
  cqs_.erase(cq);
  version_.fetch_add(1, std::memory_order_release);
}

void CompletionWorker::WorkPosted() {
  if (!sleeping_.load() || !sleeping_.exchange(false)) return;
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
}

void CompletionWorker::Refresh(Owners* owners, uint64_t* seen_version) {
  const uint64_t v = version_.load(std::memory_order_acquire);
  if (v == *seen_version) return;
  owners->assign(cqs_.begin(), cqs_.end());
  *seen_version = v;
}

bool CompletionWorker::CheckAll(Clock::time_point now, const Owners& owners) {
  bool busy = false;
  for (auto& e : owners) busy = e.second->CheckProgress(now) || busy;
  return busy;
}

void CompletionWorker::PollLoop() {
  using namespace std::chrono;
  Owners snapshot;
  uint64_t seen_version = ~uint64_t{0};
  unsigned idle = 0;
  Clock::time_point next_check = Clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    int got = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      Refresh(&snapshot, &seen_version);
      for (auto& e : snapshot) got += DrainCq(e.first, e.second);
      const Clock::time_point now = Clock::now();
      if (now >= next_check) {
        CheckAll(now, snapshot);
        next_check = now + milliseconds(kProgressCheckMs);
      }
    }
    if (got) {
      idle = 0;
      continue;
    }
    // Spin a little for latency, then sleep: busy polling starves the
    // emulated or shared cores that software RDMA (rxe) itself runs on.
    if (++idle < 256) continue;
    std::this_thread::sleep_for(microseconds(idle < 4096 ? 20 : 200));
  }
}

void CompletionWorker::EventLoop() {
  std::vector<pollfd> fds;
  fds.push_back({wake_fd_, POLLIN, 0});
  for (auto* ch : channels_) fds.push_back({ch->fd, POLLIN, 0});
  Owners owners;
  uint64_t seen_version = ~uint64_t{0};
  while (!stop_.load()) {
    bool busy = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      Refresh(&owners, &seen_version);
      busy = CheckAll(Clock::now(), owners);
      if (!busy) {
        // From here WorkPosted wakes us; asked again after saying so, so
        // that work posted in between is watched too.
        sleeping_.store(true);
        busy = CheckAll(Clock::now(), owners);
        if (busy) sleeping_.store(false);
      }
    }
    // Idle (nothing in flight): really blocks until a CQ signals or work
    // is posted; otherwise wakes to check for stalls.
    int rc = ::poll(fds.data(), fds.size(), busy ? kProgressCheckMs : -1);
    sleeping_.store(false);
    if (rc < 0) {
      if (errno == EINTR) continue;
      MORI_LOG(Error, "RDMA completion thread: poll: " << std::strerror(errno));
      return;
    }
    if (fds[0].revents & POLLIN) {
      uint64_t count = 0;
      (void)!::read(wake_fd_, &count, sizeof count);  // non-blocking: a WorkPosted (or the stop) consumed
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      ibv_cq* cq = nullptr;
      void* ctx = nullptr;
      while (rails_[i - 1]->api->get_cq_event(channels_[i - 1], &cq, &ctx) == 0) {
        rails_[i - 1]->api->ack_cq_events(cq, 1);  // at once: destroy_cq waits for acks
        std::lock_guard<std::mutex> lk(mu_);
        auto it = cqs_.find(cq);
        if (it == cqs_.end()) continue;  // removed meanwhile
        // Re-arm before draining, so a completion racing the drain still signals.
        ibv_req_notify_cq(cq, 0);
        DrainCq(cq, it->second);
      }
    }
  }
}

}  // namespace rdma
}  // namespace mori_torch
