#include "stream/doorbell.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include "base/config_table.h"

#include "core/logging.h"
#include "core/thread_name.h"

namespace mori_torch {
namespace {

constexpr size_t kWordBytes = 64;  // ring, done and failed, alone on a cache line
constexpr size_t kLists = 4;
constexpr size_t kStagingAlign = 4096;  // page copies stay aligned
// Staging registrations get ids no engine hands out (engines count from 0).
constexpr MemoryId kStagingIdBase = MemoryId{1} << 62;
std::atomic<MemoryId> g_next_staging_id{kStagingIdBase};

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

std::string DescribeSegment(const gpu::StreamCopyArgs& segs, int64_t i) {
  const int64_t lo = segs.local_offsets ? segs.local_offsets[i] : segs.local_offset;
  const int64_t ro = segs.remote_offsets ? segs.remote_offsets[i] : segs.remote_offset;
  const int64_t size = segs.sizes ? segs.sizes[i * segs.size_stride] : segs.uniform_size;
  if (segs.offset_scale != 1) {
    return "local page " + std::to_string(lo) + ", remote page " + std::to_string(ro) + " (page_bytes " +
           std::to_string(segs.offset_scale) + ")";
  }
  return "local offset " + std::to_string(lo) + ", remote offset " + std::to_string(ro) + ", size " +
         std::to_string(size);
}

void SlotLease::ReleaseCallback(void* context) {
  auto* lease = static_cast<std::shared_ptr<SlotLease>*>(context);
  (*lease)->Retire();
  delete lease;  // host memory only: no CUDA call on the driver's thread
}

DoorbellSlot::DoorbellSlot(size_t entries, size_t staging_bytes) : entries_(entries), staging_bytes_(staging_bytes) {
  const size_t head =
      (kWordBytes + kLists * entries * sizeof(int64_t) + kStagingAlign - 1) / kStagingAlign * kStagingAlign;
  bytes_ = RoundToPages(head + staging_bytes);
  base_ = static_cast<char*>(AllocHostWords(bytes_, &pinned_));
  words_ = reinterpret_cast<uint32_t*>(base_);
  lists_ = reinterpret_cast<int64_t*>(base_ + kWordBytes);
  staging_ = base_ + head;
  MemoryDesc d;
  d.id = g_next_staging_id.fetch_add(1);
  d.data = reinterpret_cast<uint64_t>(staging_);
  d.size = staging_bytes;
  d.loc = MemoryLocationType::CPU;
  staging_memory_ = std::make_shared<LocalMemory>(std::move(d));
}

DoorbellSlot::~DoorbellSlot() {
  if (scratch_ && free_scratch_) free_scratch_(scratch_, scratch_domain_);
  FreeHostWords(base_, bytes_, pinned_);
}

DoorbellService& DoorbellService::Instance() {
  // Never destroyed: captured graphs may ring it until the process ends.
  static DoorbellService* service = [] {
    // Read here, on the first caller's thread, so a bad value is that
    // caller's error rather than the progress thread's.
    auto* s = new DoorbellService(std::chrono::microseconds(config::EnvInt("MORI_TORCH_DOORBELL_SPIN_US")));
    std::atexit([] { Instance().Stop(); });
    return s;
  }();
  return *service;
}

DoorbellService::DoorbellService(std::chrono::microseconds spin) : spin_(spin) {
  thread_ = std::thread([this] {
    SetThreadName("mori-doorbell");
    Loop();
  });
}

void DoorbellService::Stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<DoorbellSlot> DoorbellService::Acquire(size_t entries, size_t staging_bytes, int domain) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    size_t best = free_.size();
    for (size_t i = 0; i < free_.size(); ++i) {
      const DoorbellSlot& s = *free_[i];
      if (s.entries() < entries || s.staging_bytes() < staging_bytes) continue;
      if (staging_bytes > 0 && s.scratch_ && s.scratch_domain_ != domain) continue;
      if (best == free_.size() || s.staging_bytes() < free_[best]->staging_bytes()) best = i;
    }
    if (best != free_.size()) {
      auto s = std::move(free_[best]);
      free_[best] = std::move(free_.back());
      free_.pop_back();
      return s;
    }
  }
  return std::make_shared<DoorbellSlot>(entries < 64 ? 64 : entries, staging_bytes);
}

void DoorbellService::Reserve(size_t count, size_t entries, size_t staging_bytes) {
  std::vector<std::shared_ptr<DoorbellSlot>> fresh;
  {
    std::lock_guard<std::mutex> lk(mu_);
    size_t have = 0;
    for (auto& s : free_) have += s->entries() >= entries && s->staging_bytes() >= staging_bytes ? 1 : 0;
    if (have >= count) return;
    count -= have;
  }
  for (size_t i = 0; i < count; ++i) fresh.push_back(std::make_shared<DoorbellSlot>(entries, staging_bytes));
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& s : fresh) free_.push_back(std::move(s));
}

size_t DoorbellService::PooledBytes() {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (auto& s : free_) n += s->bytes_;
  return n;
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
  slot->staged = false;
  StoreWord(slot->done(), 0);
  StoreWord(slot->failed(), 0);
  {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(std::move(slot));
  }
  watched_count_.fetch_sub(1);
}

void DoorbellService::Finish(DoorbellSlot& slot, StatusCode code, const std::string& message) {
  if (IsError(code)) {
    if (slot.errors) {
      slot.errors->Record(code, std::string("stream-ordered ") + (slot.is_read ? "read from" : "write to") +
                                    " engine '" + slot.peer_ + "' failed: " + message);
    }
    StoreWord(slot.failed(), 1);  // before done: a staged read's scatter skips
  }
  slot.inflight_.reset();
  slot.phase_ = slot.persistent ? DoorbellSlot::Phase::Waiting : DoorbellSlot::Phase::Draining;
  StoreWord(slot.done(), 1);  // releases the stream
}

void DoorbellService::Ring(DoorbellSlot& slot) {
  StoreWord(slot.ring(), 0);
  StoreWord(slot.failed(), 0);
  if (!slot.session) return Finish(slot, StatusCode::ERR_BAD_STATE, "no session");
  slot.peer_ = slot.session->remote_desc().engine_key;
  if (slot.segs.count == 0) return Finish(slot, StatusCode::SUCCESS, "");  // ordering only
  std::string msg;
  StatusCode c = slot.staged ? StartStaged(slot, &msg) : StatusCode::SUCCESS;
  if (!slot.staged) {
    std::vector<int64_t> lo, ro, sz;
    c = ExpandSegments(slot.segs, &lo, &ro, &sz, &msg);
    if (c == StatusCode::SUCCESS) {
      const TransferUid uid = slot.session->AllocateTransferUid();
      slot.inflight_ =
          slot.is_read ? slot.session->BatchRead(lo, ro, sz, uid) : slot.session->BatchWrite(lo, ro, sz, uid);
    }
  }
  if (c != StatusCode::SUCCESS) return Finish(slot, c, msg);
  slot.phase_ = DoorbellSlot::Phase::Moving;
}

// GPU pages through the slot: the stream packed them (writes) or will
// unpack them (reads) at the exclusive prefix sums of the sizes; the local
// offsets are checked here, against the bytes the kernels touch, so a bad
// entry fails the transfer before any byte goes out or comes in.
StatusCode DoorbellService::StartStaged(DoorbellSlot& slot, std::string* msg) {
  const gpu::StreamCopyArgs& a = slot.segs;
  std::vector<int64_t> packed(a.count), ro(a.count), sz(a.count);
  int64_t at = 0;
  for (int64_t i = 0; i < a.count; ++i) {
    gpu::SegmentBytes b;
    if (!gpu::SegmentAt(a, i, &b)) {
      *msg = "segment " + std::to_string(i) + " (" + DescribeSegment(a, i) + "): negative or overflowing value";
      return StatusCode::ERR_INVALID_ARGS;
    }
    if (!gpu::InsideRange(b.local_offset, b.size, slot.local_size)) {
      *msg = "segment " + std::to_string(i) + " (" + DescribeSegment(a, i) + "): local bytes [" +
             std::to_string(b.local_offset) + ", +" + std::to_string(b.size) + ") lie outside the local tensor of " +
             std::to_string(slot.local_size) + " bytes; nothing moved";
      return StatusCode::ERR_INVALID_ARGS;
    }
    packed[i] = at;
    ro[i] = b.remote_offset;
    sz[i] = b.size;
    at += b.size;  // each size <= local_size: no overflow
    if (static_cast<uint64_t>(at) > slot.staging_bytes()) {
      *msg = "the transfer needs more than the " + std::to_string(slot.staging_bytes()) +
             " staging bytes reserved when the op was enqueued (at segment " + std::to_string(i) + "); nothing moved";
      return StatusCode::ERR_INVALID_ARGS;
    }
  }
  const TransferUid uid = slot.session->AllocateTransferUid();
  slot.inflight_ = slot.session->SubmitVia(slot.staging_memory(), slot.is_read, packed, ro, sz, uid);
  return StatusCode::SUCCESS;
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
  // Precise short sleeps: the default 50 us timer slack would add to every
  // ring found after a sleep. This thread makes no GPU call (see header).
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  const auto spin = spin_;
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
    } else if (now - last_activity < spin) {
      std::this_thread::yield();  // a burst is likely to go on: stay hot
    } else {
      // Back off: 10 us right after the spin, up to 50 us when long idle.
      const auto idle = std::chrono::duration_cast<std::chrono::microseconds>(now - last_activity - spin).count();
      std::this_thread::sleep_for(std::chrono::microseconds(idle < 1000 ? 10 : 50));
    }
  }
}

}  // namespace mori_torch
