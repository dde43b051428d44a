#include "core/stream_doorbell.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include "core/logging.h"

namespace mori_torch {
namespace {

constexpr size_t kWordBytes = 64;  // ring and done, alone on a cache line

uint32_t LoadWord(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void StoreWord(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

size_t RoundToPages(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

}  // namespace

StatusCode ExpandSegments(const gpu::StreamCopyArgs& segs, std::vector<int64_t>* lo, std::vector<int64_t>* ro,
                          std::vector<int64_t>* sz, std::string* msg) {
  lo->resize(segs.count);
  ro->resize(segs.count);
  sz->resize(segs.count);
  for (int64_t i = 0; i < segs.count; ++i) {
    gpu::SegmentBytes b;
    if (!gpu::SegmentAt(segs, i, &b)) {
      *msg = "segment " + std::to_string(i) + ": negative or overflowing value (local " +
             std::to_string(segs.local_offsets ? segs.local_offsets[i] : segs.local_offset) + ", remote " +
             std::to_string(segs.remote_offsets ? segs.remote_offsets[i] : segs.remote_offset) + ", scale " +
             std::to_string(segs.offset_scale) + ", size " + std::to_string(b.size) + ")";
      return StatusCode::ERR_INVALID_ARGS;
    }
    (*lo)[i] = b.local_offset;
    (*ro)[i] = b.remote_offset;
    (*sz)[i] = b.size;
  }
  return StatusCode::SUCCESS;
}

void SlotLease::ReleaseCallback(void* context) {
  auto* lease = static_cast<std::shared_ptr<SlotLease>*>(context);
  (*lease)->Retire();
  delete lease;  // host memory only: no CUDA call on the driver's thread
}

DoorbellSlot::DoorbellSlot(size_t entries) : entries_(entries) {
  bytes_ = RoundToPages(kWordBytes + 3 * entries * sizeof(int64_t));
  auto* base = static_cast<char*>(AllocHostWords(bytes_, &pinned_));
  words_ = reinterpret_cast<uint32_t*>(base);
  lists_ = reinterpret_cast<int64_t*>(base + kWordBytes);
}

DoorbellSlot::~DoorbellSlot() { FreeHostWords(words_, bytes_, pinned_); }

DoorbellService& DoorbellService::Instance() {
  // Never destroyed: captured graphs may ring it until the process ends.
  static DoorbellService* service = [] {
    auto* s = new DoorbellService();
    std::atexit([] { Instance().Stop(); });
    return s;
  }();
  return *service;
}

DoorbellService::DoorbellService() { thread_ = std::thread([this] { Loop(); }); }

void DoorbellService::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<DoorbellSlot> DoorbellService::Acquire(size_t entries) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i]->entries() >= entries) {
        auto s = std::move(free_[i]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return s;
      }
    }
  }
  return std::make_shared<DoorbellSlot>(entries < 64 ? 64 : entries);
}

void DoorbellService::Reserve(size_t count, size_t entries) {
  std::vector<std::shared_ptr<DoorbellSlot>> fresh;
  {
    std::lock_guard<std::mutex> lk(mu_);
    size_t have = 0;
    for (auto& s : free_) have += s->entries() >= entries ? 1 : 0;
    if (have >= count) return;
    count -= have;
  }
  for (size_t i = 0; i < count; ++i) fresh.push_back(std::make_shared<DoorbellSlot>(entries));
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& s : fresh) free_.push_back(std::move(s));
}

void DoorbellService::Watch(std::shared_ptr<DoorbellSlot> slot) {
  slot->phase_ = DoorbellSlot::Phase::Waiting;
  watched_count_.fetch_add(1);
  if (slot->lease) leased_count_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lk(mu_);
    incoming_.push_back(std::move(slot));
  }
  cv_.notify_one();
}

size_t DoorbellService::Watched() { return watched_count_.load(); }

size_t DoorbellService::Leased() { return leased_count_.load(); }

bool DoorbellService::Retired(DoorbellSlot& slot) {
  // The graph's launches are over when its lease is released, so the slot
  // is idle then; the checks only guard against a driver that released it
  // early: a pending ring or a running transfer is finished first.
  return slot.lease && slot.lease->retired() && slot.phase_ == DoorbellSlot::Phase::Waiting &&
         LoadWord(slot.ring()) == 0;
}

void DoorbellService::Recycle(size_t i) {
  std::shared_ptr<DoorbellSlot> slot = std::move(watched_[i]);
  watched_[i] = std::move(watched_.back());
  watched_.pop_back();
  if (slot->lease) leased_count_.fetch_sub(1);
  slot->session.reset();  // may end the session: this thread, not the driver's
  slot->errors.reset();
  slot->lease.reset();
  slot->inflight_.reset();
  slot->persistent = false;
  StoreWord(slot->done(), 0);
  {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(std::move(slot));
  }
  watched_count_.fetch_sub(1);
}

void DoorbellService::Finish(DoorbellSlot& slot, StatusCode code, const std::string& message) {
  if (IsError(code) && slot.errors) slot.errors->Record(code, "stream-ordered transfer failed: " + message);
  slot.inflight_.reset();
  slot.phase_ = slot.persistent ? DoorbellSlot::Phase::Waiting : DoorbellSlot::Phase::Draining;
  StoreWord(slot.done(), 1);  // releases the stream
}

void DoorbellService::Ring(DoorbellSlot& slot) {
  StoreWord(slot.ring(), 0);
  std::vector<int64_t> lo, ro, sz;
  std::string msg;
  StatusCode c = ExpandSegments(slot.segs, &lo, &ro, &sz, &msg);
  if (c != StatusCode::SUCCESS) return Finish(slot, c, msg);
  if (!slot.session) return Finish(slot, StatusCode::ERR_BAD_STATE, "no session");
  const TransferUid uid = slot.session->AllocateTransferUid();
  slot.inflight_ = slot.is_read ? slot.session->BatchRead(lo, ro, sz, uid) : slot.session->BatchWrite(lo, ro, sz, uid);
  slot.phase_ = DoorbellSlot::Phase::Moving;
}

bool DoorbellService::Step(DoorbellSlot& slot) {
  switch (slot.phase_) {
    case DoorbellSlot::Phase::Waiting:
      if (LoadWord(slot.ring()) == 0) return false;
      Ring(slot);
      return true;
    case DoorbellSlot::Phase::Moving: {
      const StatusCode c = slot.inflight_->Code();
      if (c == StatusCode::IN_PROGRESS || c == StatusCode::INIT) return false;
      Finish(slot, c, slot.inflight_->Message());
      return true;
    }
    case DoorbellSlot::Phase::Draining:
      return LoadWord(slot.done()) == 0;  // the stream passed: the caller recycles it
  }
  return false;
}

void DoorbellService::Loop() {
  // Backends called from here (TCP with GPU memory) may touch CUDA: never
  // break a capture on another thread.
  if (gpu::DeviceCount() > 0) {
    try {
      gpu::RelaxCaptureModeForThisThread();
    } catch (const Error& e) {
      MORI_LOG(Warning, "doorbell thread: " << e.what());
    }
  }
  using Clock = std::chrono::steady_clock;
  auto last_activity = Clock::now();
  while (true) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (watched_.empty() && incoming_.empty()) cv_.wait(lk, [&] { return stop_ || !incoming_.empty(); });
      if (stop_) return;
      for (auto& s : incoming_) watched_.push_back(std::move(s));
      incoming_.clear();
    }
    bool progressed = false;
    for (size_t i = 0; i < watched_.size();) {
      DoorbellSlot& s = *watched_[i];
      bool release = false;
      if (Retired(s)) {
        release = true;  // its graph is gone: no stream will ring it again
      } else {
        const bool drained_before = s.phase_ == DoorbellSlot::Phase::Draining;
        if (Step(s)) {
          progressed = true;
          release = drained_before;  // the stream passed it: back to the pool
        }
      }
      if (release) {
        progressed = true;
        Recycle(i);
        continue;
      }
      ++i;
    }
    const auto now = Clock::now();
    if (progressed) {
      last_activity = now;
    } else if (now - last_activity < std::chrono::microseconds(500)) {
      std::this_thread::yield();  // a burst is likely to go on: stay hot
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

}  // namespace mori_torch
