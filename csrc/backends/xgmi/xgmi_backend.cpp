#include "backends/xgmi/xgmi_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>

#include "backends/xgmi/pinned_segment_lists.h"
#include "base/config_table.h"
#include "core/cpu.h"
#include "core/local_engines.h"
#include "core/logging.h"
#include "core/thread_name.h"
#include "gpu/stream_ops.h"

namespace mori_torch {
namespace xgmi {

XgmiConfig XgmiConfig::FromMap(const BackendConfig& m) {
  constexpr const char* kName = "XgmiBackendConfig";  // defaults and ranges: base/config_table.cpp
  config::CheckKnownKeys(m, kName);
  XgmiConfig c;
  c.num_streams = config::Value(m, kName, "num_streams");
  c.num_events = config::Value(m, kName, "num_events");
  c.kernel_min_segments = config::Value(m, kName, "kernel_min_segments");
  c.kernel_max_avg_bytes = config::Value(m, kName, "kernel_max_avg_bytes");
  return c;
}

// The completion of the transfers enqueued together (one, or the pairs of
// an engine-level batch on one GPU), shared by the completion thread and
// their statuses' progress hooks (which may outlive the backend, so they
// hold only this object).
struct PendingCopy {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point enqueued = Clock::now();
  std::mutex mu;
  std::vector<StatusPtr> statuses;
  gpu::Event event = nullptr;  // null once released
  int device = -1;
  std::atomic<bool> done{false};  // written under mu; read without it to skip work
  std::vector<MemoryUse> uses;
  std::vector<SharedSegments> lists;  // read in place by the kernel, until done
  LanePicker* picker = nullptr;       // the lane taken for the copies, until done
  size_t lane = 0;

  // Under mu, once: the copies ran (or never will), so the lane is free.
  void Finish() {
    done = true;
    if (picker) picker->Release(lane);
    picker = nullptr;
  }

  // Checks the event; ends the statuses when the copies finished or failed.
  void Poll() {
    std::unique_lock<std::mutex> lk(mu);
    PollLocked();
  }
  // The same, unless another thread polls it now (that one ends it): a
  // poller never sleeps on the lock, whose wake-up cost a polling caller
  // 10-20 us on the GPU VMs.
  void TryPoll() {
    std::unique_lock<std::mutex> lk(mu, std::try_to_lock);
    if (lk.owns_lock()) PollLocked();
  }

 private:
  void PollLocked() {
    gpu::RelaxedCaptureScope relaxed;  // callers' threads must not break a capture elsewhere
    if (done || !event) return;
    StatusCode code = StatusCode::SUCCESS;
    std::string msg;
    try {
      if (gpu::QueryEvent(event) == 0) return;
    } catch (const Error& e) {
      code = StatusCode::ERR_GPU_OP;
      msg = e.what();
    }
    Finish();  // before the statuses end: the caller's next transfer finds the lane free
    for (const StatusPtr& s : statuses) s->Update(code, msg);
  }
};

XgmiBackend::XgmiBackend(const XgmiConfig& cfg, const BackendContext& ctx) : cfg_(cfg), ctx_(ctx) {
  if (gpu::DeviceCount() == 0) {
    throw Error(StatusCode::ERR_BAD_STATE, gpu::Compiled() ? "create_backend(XGMI): no GPU is visible"
                                                           : "create_backend(XGMI): this build has no GPU support");
  }
  // From now on batches are built where the copy kernel can read them.
  UsePinnedSegmentLists();
  ownership_ = FindService<MemoryOwnership>(ctx_);
  if (!ownership_) throw Error(StatusCode::ERR_BAD_STATE, "create_backend(XGMI): the engine has no memory ownership");
  ownership_->SetRevoker(
      [this](const std::string& owner, const std::vector<MemoryId>& ids) { RevokeRemoteMemory(owner, ids); });
  completion_thread_ = std::thread([this] {
    SetThreadName("mori-xgmi-done");
    CompletionLoop();
  });
}

XgmiBackend::~XgmiBackend() { Shutdown(); }

bool XgmiBackend::CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc& remote_engine) const {
  return local.loc == MemoryLocationType::GPU && remote.loc == MemoryLocationType::GPU &&
         remote_engine.node_id == ctx_.self->node_id;
}

std::shared_ptr<BackendPeer> XgmiBackend::Peer(const EngineDesc& remote) {
  return peers_.GetOrCreate(remote.key, [&] {
    auto p = std::make_shared<XgmiPeer>(this, remote);
    if (shut_.load()) p->Close();
    return p;
  });
}

void XgmiBackend::RemovePeer(const std::string& key, const std::string& /*reason*/) {
  if (auto p = peers_.Take(key)) p->Close();
}

void XgmiBackend::RevokeRemoteMemory(const std::string& owner_key, const std::vector<MemoryId>& ids) {
  if (auto p = peers_.Find(owner_key)) p->Revoke(ids);
}

void XgmiBackend::DrainCopies() {
  gpu::RelaxedCaptureScope relaxed;  // runs on a control-plane thread: never break a capture elsewhere
  std::lock_guard<std::mutex> lk(dev_mu_);
  for (auto& kv : devices_) {
    for (auto& lane : kv.second->lanes) {
      gpu::SynchronizeStream(lane->stream);
    }
  }
}

size_t XgmiBackend::MappedRemoteMemories() {
  size_t n = 0;
  for (auto& p : peers_.All()) n += p->MappedCount();
  return n;
}

DeviceContext& XgmiBackend::Device(int device) {
  std::lock_guard<std::mutex> lk(dev_mu_);
  auto& dc = devices_[device];
  if (!dc) {
    auto fresh = std::make_unique<DeviceContext>();
    fresh->device = device;
    gpu::WarmUpKernels(device);
    fresh->resident_groups = gpu::SegmentCopyResidentGroups(device);
    for (int64_t i = 0; i < cfg_.num_streams; ++i) {
      auto lane = std::make_unique<DeviceContext::Lane>();
      lane->stream = gpu::CreateStream(device);
      fresh->lanes.push_back(std::move(lane));
    }
    fresh->picker = std::make_unique<LanePicker>(fresh->lanes.size());
    std::lock_guard<std::mutex> ek(event_mu_);
    auto& pool = free_events_[device];
    for (int64_t i = 0; i < cfg_.num_events; ++i) pool.push_back(gpu::CreateEvent(device));
    dc = std::move(fresh);
  }
  return *dc;
}

gpu::Event XgmiBackend::TakeEvent(int device) {
  {
    LockSpinningFirst(event_mu_);  // the completion thread returns events under it
    std::lock_guard<std::mutex> lk(event_mu_, std::adopt_lock);
    auto& pool = free_events_[device];
    if (!pool.empty()) {
      gpu::Event e = pool.back();
      pool.pop_back();
      return e;
    }
  }
  return gpu::CreateEvent(device);  // pool exhausted: grow
}

void XgmiBackend::ReturnEvent(gpu::Event e, int device) {
  std::lock_guard<std::mutex> lk(event_mu_);
  free_events_[device].push_back(e);
}

uint64_t XgmiBackend::KernelPieceBytes(uint64_t total_bytes, uint32_t resident_groups) {
  // About two pieces per resident group, in whole 4 KiB units (which keeps
  // 16-byte alignment; a group's pass of loads is 4 KiB).
  constexpr uint64_t kUnit = 4096;
  const uint64_t want = total_bytes / (2 * static_cast<uint64_t>(resident_groups > 0 ? resident_groups : 1));
  return std::max(kUnit, (want + kUnit - 1) / kUnit * kUnit);
}

std::unique_ptr<SegmentList> XgmiBackend::TakeList(DeviceContext& dc, size_t entries) {
  std::unique_ptr<SegmentList> list;
  {
    std::lock_guard<std::mutex> lk(dc.lists_mu);
    // The list returned longest ago is taken if the GPU is done with it
    // (grown below if too small); a new one only while it is still busy.
    // Skipping a too-small idle list instead made a batch that outgrew the
    // pool allocate a new list every time until num_streams lists existed.
    auto& idle = dc.idle_lists;
    const bool front_ready = !idle.empty() && gpu::QueryEvent(idle.front()->consumed) == 1;
    if (front_ready || (!idle.empty() && dc.list_count >= static_cast<size_t>(cfg_.num_streams))) {
      list = std::move(idle.front());
      idle.pop_front();
    } else {
      ++dc.list_count;
    }
  }
  if (!list) {
    list = std::make_unique<SegmentList>();
    try {
      list->consumed = gpu::CreateEvent(dc.device);
    } catch (...) {
      FreeList(*list, dc.device);
      std::lock_guard<std::mutex> lk(dc.lists_mu);
      --dc.list_count;
      throw;
    }
  }
  // A reused list may be rewritten (or freed to grow) once its last kernel ran.
  while (gpu::QueryEvent(list->consumed) == 0) std::this_thread::yield();
  if (list->capacity < entries) {
    gpu::PinnedFree(list->host, list->capacity * sizeof(gpu::CopySegment));
    list->host = nullptr;
    list->device_view = 0;
    list->capacity = 0;
    size_t cap = 1024;
    while (cap < entries) cap *= 2;
    try {
      list->host = static_cast<gpu::CopySegment*>(gpu::PinnedAlloc(cap * sizeof(gpu::CopySegment), -1));
      list->device_view = gpu::DevicePointerOfPinned(list->host);
    } catch (...) {
      gpu::PinnedFree(list->host, cap * sizeof(gpu::CopySegment));
      list->host = nullptr;
      ReturnList(dc, std::move(list));
      throw;
    }
    list->capacity = cap;
  }
  return list;
}

void XgmiBackend::ReturnList(DeviceContext& dc, std::unique_ptr<SegmentList> list) {
  std::lock_guard<std::mutex> lk(dc.lists_mu);
  dc.idle_lists.push_back(std::move(list));
}

void XgmiBackend::FreeList(SegmentList& list, int device) {
  gpu::PinnedFree(list.host, list.capacity * sizeof(gpu::CopySegment));
  if (list.consumed) gpu::DestroyEvent(list.consumed, device);
}

bool XgmiBackend::EnqueueKernel(DeviceContext& dc, DeviceContext::Lane& lane, const std::vector<CopySource>& sources,
                                size_t segments, uint64_t total) {
  const uint64_t piece = KernelPieceBytes(total, dc.resident_groups);
  // Few pieces travel in the launch parameters: no list upload at all.
  if (segments <= gpu::kInlineSegments) {
    gpu::CopySegment inl[gpu::kInlineSegments];
    uint32_t n = 0;
    bool fits = true;
    for (const CopySource& src : sources) {
      for (const Segment& s : src.segs) {
        const uint64_t d = src.Dst(s), r = src.Src(s);
        for (uint64_t off = 0; off < s.size && fits; off += piece) {
          if (n == gpu::kInlineSegments)
            fits = false;
          else
            inl[n++] = {d + off, r + off, std::min(piece, s.size - off)};
        }
      }
    }
    if (fits) {
      gpu::LaunchInlineSegmentCopy(inl, n, lane.stream);
      return false;
    }
  }
  // Transfers whose segments need no cutting (up to kMaxBaseSets of them)
  // go up as the engine validated them: offsets, to which the kernel adds
  // each transfer's two bases.
  static_assert(sizeof(Segment) == sizeof(gpu::CopySegment) && offsetof(Segment, local_off) == 0 &&
                    offsetof(Segment, remote_off) == 8 && offsetof(Segment, size) == 16,
                "a Segment is uploaded as a CopySegment of offsets");
  bool as_offsets = sources.size() <= gpu::kMaxBaseSets;
  for (const CopySource& src : sources) as_offsets = as_offsets && src.max_bytes <= piece;
  gpu::SegmentBases bases{};
  if (as_offsets) {
    uint64_t first = 0;
    for (const CopySource& src : sources) {
      const uint32_t k = bases.sets++;
      bases.first[k] = first;
      bases.dst_base[k] = src.dst_base;
      bases.src_base[k] = src.src_base;
      if (!src.is_read) bases.swap |= 1u << k;
      first += src.segs.size();
    }
  }
  // One transfer's list built in device-mapped memory (a session's batch)
  // is read where it is: no list to take and fill, which cost a 16,384-page
  // batch 8-10 us of its ~180 before the kernel started (one H200).
  if (as_offsets && sources.size() == 1 && sources[0].device_view != 0) {
    gpu::LaunchSegmentCopy(reinterpret_cast<const gpu::CopySegment*>(sources[0].device_view), segments, lane.stream,
                           bases);
    return true;
  }
  // Otherwise the sources' lists are copied, back to back, into one of the
  // backend's pinned lists (offsets as they are, not rewritten entry by
  // entry), or cut into pieces there.
  std::unique_ptr<SegmentList> list = TakeList(dc, segments + total / piece + 1);
  // The whole list is written, then one launch copies it: a launch per
  // chunk, to start the GPU sooner, cost more at each kernel boundary than
  // it saved (one H100, 16,384 permuted 16 KiB pages, host time from the
  // first entry written to the copy done: chunks of 1,024 growing 4x 227.8
  // us; the whole list written by four threads, then one launch, 206.9).
  gpu::CopySegment* const host = list->host;
  size_t written = 0;
  try {
    if (as_offsets) {
      // The sources' lists back to back, copied in ranges on the submit
      // helpers: 16,384 entries are 384 KiB, 10.5 us on one core.
      std::vector<SegmentSpan> lists;
      lists.reserve(sources.size());
      for (const CopySource& src : sources) lists.push_back(src.segs);
      written = CopyBackToBack(lists, host);
    } else {
      for (const CopySource& src : sources) {
        for (const Segment& s : src.segs) {
          const uint64_t d = src.Dst(s), r = src.Src(s);
          for (uint64_t off = 0; off < s.size; off += piece) {
            host[written++] = {d + off, r + off, std::min(piece, s.size - off)};
          }
        }
      }
    }
    gpu::LaunchSegmentCopy(reinterpret_cast<const gpu::CopySegment*>(list->device_view), written, lane.stream, bases);
    gpu::RecordEvent(list->consumed, lane.stream);
  } catch (...) {
    // Whatever was enqueued still reads the list: wait for it before reuse.
    try {
      gpu::SynchronizeStream(lane.stream);
    } catch (const Error& e) {
      MORI_LOG(Warning, "XGMI: waiting for a failed batch's copies: " << e.what());
    }
    ReturnList(dc, std::move(list));
    throw;
  }
  ReturnList(dc, std::move(list));
  return false;
}

void XgmiBackend::Run(TransferOp op, uint64_t remote_base) {
  std::vector<Located> one;
  one.push_back({std::move(op), remote_base});
  RunOnDevice(std::move(one));
}

void XgmiBackend::SubmitGroup(std::vector<PeerOp> ops) {
  SubmitScope submitting(this);
  // First each memory is mapped (a watch round trip and an IPC open on its
  // first use) under its own peer's lock only, as Submit does: a slow owner
  // never holds up another owner's revocation.
  std::vector<PeerOp*> mapped;
  for (PeerOp& p : ops) {
    auto* peer = static_cast<XgmiPeer*>(p.peer.get());
    std::shared_lock<std::shared_mutex> use = peer->UseLock();
    uint64_t base = 0;
    if (peer->RemoteAddress(p.op, &base)) mapped.push_back(&p);  // else its status ended
  }
  // Then every distinct peer's lock, in address order (no two groups wait
  // on each other), from the addresses' lookup until the copies are
  // enqueued: a revocation in between fails its transfers here.
  std::vector<XgmiPeer*> peers;
  for (PeerOp* p : mapped) peers.push_back(static_cast<XgmiPeer*>(p->peer.get()));
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  std::vector<std::shared_lock<std::shared_mutex>> locks;
  locks.reserve(peers.size());
  for (XgmiPeer* peer : peers) locks.push_back(peer->UseLock());
  std::vector<std::vector<Located>> by_device;  // in order of first appearance
  for (PeerOp* p : mapped) {
    uint64_t base = 0;
    if (!static_cast<XgmiPeer*>(p->peer.get())->RemoteAddress(p->op, &base, /*lookup_only=*/true)) continue;
    const int dev = p->op.local->desc.device_id;
    auto g = std::find_if(by_device.begin(), by_device.end(),
                          [&](const std::vector<Located>& v) { return v.front().op.local->desc.device_id == dev; });
    if (g == by_device.end()) g = by_device.insert(by_device.end(), std::vector<Located>());
    g->push_back({std::move(p->op), base});
  }
  for (std::vector<Located>& group : by_device) RunOnDevice(std::move(group));
}

bool XgmiBackend::SmallSegments(size_t segments, uint64_t total) const {
  return segments > 0 && total / segments < static_cast<uint64_t>(cfg_.kernel_max_avg_bytes);
}

bool XgmiBackend::KernelSuits(size_t segments, uint64_t total) const {
  return segments >= static_cast<size_t>(cfg_.kernel_min_segments) && SmallSegments(segments, total);
}

void XgmiBackend::RunOnDevice(std::vector<Located> ops) {
  gpu::RelaxedCaptureScope relaxed;  // lane setup allocates: never break a capture elsewhere
  std::vector<Prepared> shared;      // the transfers of small segments
  size_t shared_segments = 0;
  uint64_t shared_bytes = 0;
  size_t handed = 0;  // ops[0, handed) belong to an Enqueue now
  try {
    for (; handed < ops.size(); ++handed) {
      TransferOp& op = ops[handed].op;
      MemoryUse use = MemoryUse(op.local);
      if (!use) {
        op.status->Update(StatusCode::ERR_NOT_FOUND,
                          "local memory " + std::to_string(op.local->desc.id) + " was deregistered");
        continue;
      }
      const SegmentVector& segs = op.segs->segs;
      const uint64_t local_base = op.local->desc.data, remote_base = ops[handed].remote_base;
      Prepared p{op.status,
                 std::move(use),
                 {segs, DeviceViewOf(segs), op.is_read ? local_base : remote_base,
                  op.is_read ? remote_base : local_base, op.is_read, op.segs->max_bytes},
                 op.segs->total_bytes,
                 op.segs};
      // Transfers of small segments (the kernel's kind) are gathered: if
      // together they are enough for the kernel, they share one launch and
      // one completion (eight one-page pairs: one launch, not eight copies
      // and events). Large segments each go alone to the copy engines.
      if (ops.size() > 1 && SmallSegments(segs.size(), op.segs->total_bytes)) {
        shared_segments += segs.size();
        shared_bytes += op.segs->total_bytes;
        shared.push_back(std::move(p));
      } else {
        EnqueueAlone(op.local->desc.device_id, p);
      }
    }
    const int dev = ops.front().op.local->desc.device_id;
    if (KernelSuits(shared_segments, shared_bytes)) {
      Enqueue(dev, std::move(shared));
    } else {
      // Too few for the kernel: each on its own lane and completion, so that
      // one transfer's failure to enqueue fails only that transfer.
      for (; !shared.empty(); shared.erase(shared.begin())) EnqueueAlone(dev, shared.front());
    }
  } catch (const std::exception& e) {
    // Before Enqueue (which ends its own transfers on any failure): memory.
    // Every transfer not handed to an Enqueue yet ends here.
    for (Prepared& p : shared) {
      if (p.status) p.status->Update(StatusCode::ERR_GPU_OP, std::string("XGMI: ") + e.what());  // else handed on
    }
    for (size_t i = handed; i < ops.size(); ++i) {
      ops[i].op.status->Update(StatusCode::ERR_GPU_OP, std::string("XGMI: ") + e.what());
    }
  }
}

void XgmiBackend::EnqueueAlone(int dev, Prepared& p) {
  std::vector<Prepared> alone;
  alone.push_back(std::move(p));
  Enqueue(dev, std::move(alone));
}

void XgmiBackend::Enqueue(int dev, std::vector<Prepared> batch) {
  std::shared_ptr<PendingCopy> pending;
  DeviceContext::Lane* lane = nullptr;
  try {
    // Inside the try: the callers hand the batch over, so nothing may
    // escape without ending its statuses.
    pending = std::make_shared<PendingCopy>();
    pending->device = dev;
    std::vector<CopySource> sources;
    sources.reserve(batch.size());
    size_t segments = 0;
    uint64_t total = 0;
    for (Prepared& p : batch) {
      pending->statuses.push_back(p.status);
      pending->uses.push_back(std::move(p.use));
      sources.push_back(p.source);
      segments += p.source.segs.size();
      total += p.bytes;
    }
    DeviceContext& dc = Device(dev);
    pending->lane = dc.picker->Take();
    pending->picker = dc.picker.get();
    lane = dc.lanes[pending->lane].get();
    std::lock_guard<std::mutex> lk(lane->mu);
    gpu::DeviceScope on_device(dev);  // restores the caller's device: torch reads it
    if (KernelSuits(segments, total)) {
      if (EnqueueKernel(dc, *lane, sources, segments, total)) {
        for (Prepared& p : batch) pending->lists.push_back(std::move(p.list));
      }
    } else {
      for (const CopySource& src : sources) {
        for (const Segment& s : src.segs) {
          gpu::CopyAsync(src.Dst(s), src.Src(s), s.size, lane->stream);
        }
      }
    }
    pending->event = TakeEvent(dev);
    gpu::RecordEvent(pending->event, lane->stream);
  } catch (const std::exception& e) {
    if (pending && pending->event) ReturnEvent(pending->event, dev);
    if (pending) pending->Finish();  // frees its lane, if it took one
    // Copies enqueued before the failure may still run: they finish before
    // the statuses end and the local memory is let go.
    if (lane != nullptr) {
      try {
        gpu::SynchronizeStream(lane->stream);
      } catch (const Error&) {
      }
    }
    const auto* err = dynamic_cast<const Error*>(&e);
    const StatusCode code =
        err != nullptr && err->code() == StatusCode::ERR_INVALID_ARGS ? err->code() : StatusCode::ERR_GPU_OP;
    const std::string msg = batch.size() > 1 ? "XGMI batch of " + std::to_string(batch.size()) + " transfers on GPU " +
                                                   std::to_string(dev) + ": " + e.what()
                                             : std::string(e.what());
    for (const Prepared& p : batch) p.status->Update(code, msg);
    return;
  }
  for (const StatusPtr& s : pending->statuses) s->SetProgressHook([pending] { pending->TryPoll(); });
  bool wake;
  {
    LockSpinningFirst(pending_mu_);  // the completion thread swaps the queue under it
    std::lock_guard<std::mutex> lk(pending_mu_, std::adopt_lock);
    pending_.push_back(pending);
    wake = reaper_asleep_;
  }
  if (wake) pending_cv_.notify_one();
}

std::chrono::microseconds XgmiBackend::Reap() {
  std::deque<std::shared_ptr<PendingCopy>> work;
  {
    std::lock_guard<std::mutex> lk(pending_mu_);
    work.swap(pending_);
  }
  const auto now = PendingCopy::Clock::now();
  auto next = kReapNap;
  std::deque<std::shared_ptr<PendingCopy>> still;
  for (auto& p : work) {
    // A running copy younger than kLeftToPollers is its pollers' to end:
    // this thread's event queries would contend with theirs in the driver.
    const auto left = p->enqueued + kLeftToPollers - now;
    const bool young = left > std::chrono::microseconds(0);
    if (!young) p->TryPoll();
    std::unique_lock<std::mutex> lk(p->mu, std::defer_lock);
    if (p->done.load() && lk.try_lock()) {  // the lock is a poller's for a moment: next pass
      ReturnEvent(p->event, p->device);
      p->event = nullptr;
      p->uses.clear();
      p->lists.clear();
      continue;
    }
    next = std::min(next, young ? std::chrono::duration_cast<std::chrono::microseconds>(left) : kReapPoll);
    still.push_back(std::move(p));
  }
  std::lock_guard<std::mutex> lk(pending_mu_);
  for (auto& p : still) pending_.push_front(std::move(p));
  return pending_.empty() ? std::chrono::microseconds(0) : std::max(next, std::chrono::microseconds(1));
}

void XgmiBackend::CompletionLoop() {
  gpu::RelaxCaptureModeForThisThread();  // event queries must not break a capture elsewhere
  // While transfers come and go the thread naps briefly instead of being
  // woken per transfer: a wake-up cost the submitting thread 3-4 us (p50 on
  // the build VM), a fifth of a small transfer's submission. After kSleepAfterIdle
  // without work it sleeps until Run wakes it. Polled statuses end as soon
  // as their copies are done; statuses nobody polls within kLeftToPollers
  // plus kReapPoll of it.
  using Clock = std::chrono::steady_clock;
  constexpr auto kSleepAfterIdle = std::chrono::milliseconds(20);
  auto idle_since = Clock::now();
  while (true) {
    {
      std::unique_lock<std::mutex> lk(pending_mu_);
      if (pending_.empty() && !shut_.load()) {
        if (Clock::now() - idle_since < kSleepAfterIdle) {
          pending_cv_.wait_for(lk, kReapNap);
        } else {
          reaper_asleep_ = true;
          pending_cv_.wait(lk, [&] { return shut_.load() || !pending_.empty(); });
          reaper_asleep_ = false;
        }
      }
      if (shut_.load()) return;
      if (pending_.empty()) continue;
    }
    const auto again = Reap();
    if (again.count() > 0) std::this_thread::sleep_for(again);
    idle_since = Clock::now();
  }
}

void XgmiBackend::Shutdown() {
  gpu::RelaxedCaptureScope relaxed;  // its waits must not break a capture elsewhere
  if (shut_.exchange(true)) return;
  ownership_->SetRevoker(nullptr);  // waits for a revocation in progress
  // Submitters that saw shut_ false finish enqueuing first (peers removed
  // from the cache too): nothing new reaches the streams or pending_ after.
  while (submitting_.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(50));
  {
    // The completion thread checks shut_ under this mutex: no lost wake-up.
    std::lock_guard<std::mutex> lk(pending_mu_);
  }
  pending_cv_.notify_all();
  if (completion_thread_.joinable()) completion_thread_.join();
  // Let running copies finish: their memory may be freed once we return.
  std::lock_guard<std::mutex> lk(dev_mu_);
  bool all_ran = true;
  for (auto& kv : devices_) {
    for (auto& lane : kv.second->lanes) {
      try {
        gpu::SynchronizeStream(lane->stream);
      } catch (const Error& e) {
        all_ran = false;
        MORI_LOG(Error, "XGMI shutdown: " << e.what());
      }
    }
  }
  for (auto& p : pending_) {
    p->Poll();
    std::lock_guard<std::mutex> pk(p->mu);
    if (!p->done) {
      for (const StatusPtr& s : p->statuses) {
        s->Update(StatusCode::ERR_BAD_STATE, "XGMI backend was removed or its engine shut down");
      }
      p->Finish();
    }
    p->event = nullptr;  // destroyed with the pools below
    p->uses.clear();
    // A kernel that may still run reads its lists: they are never reused
    // (kept for the process) rather than rewritten under it.
    if (!all_ran) {
      for (SharedSegments& l : p->lists) new SharedSegments(std::move(l));
    }
    p->lists.clear();
  }
  pending_.clear();
  for (auto& p : peers_.TakeAll()) p->Close();
  for (auto& kv : devices_) {
    {
      std::lock_guard<std::mutex> ll(kv.second->lists_mu);
      for (auto& list : kv.second->idle_lists) FreeList(*list, kv.first);
      kv.second->idle_lists.clear();
    }
    for (auto& lane : kv.second->lanes) {
      gpu::DestroyStream(lane->stream, kv.first);
    }
  }
  std::lock_guard<std::mutex> ek(event_mu_);
  for (auto& kv : free_events_) {
    for (auto e : kv.second) gpu::DestroyEvent(e, kv.first);
  }
  free_events_.clear();
}

XgmiPeer::XgmiPeer(XgmiBackend* backend, EngineDesc remote)
    : backend_(backend), remote_(std::move(remote)), same_process_(InThisProcess(remote_)) {}

XgmiPeer::~XgmiPeer() { Close(); }

uint64_t XgmiPeer::OpenShared(const gpu::IpcHandle& handle, int device) {
  Opened& o = opened_[{handle, device}];
  if (o.users == 0) {
    try {
      o.base = gpu::OpenIpcHandle(handle, device);
    } catch (...) {
      opened_.erase({handle, device});
      throw;
    }
  }
  ++o.users;
  return o.base;
}

void XgmiPeer::Unmap(MemoryId id, const Mapping& m) {
  if (!m.ipc_base) return;  // same process: nothing was opened
  auto it = opened_.find({m.handle, m.device});
  if (it == opened_.end() || --it->second.users > 0) return;
  opened_.erase(it);
  try {
    gpu::RelaxedCaptureScope relaxed;
    gpu::CloseIpcHandle(m.ipc_base, m.device);
  } catch (const Error& e) {
    MORI_LOG(Warning, "XGMI: closing the mapping of " << remote_.key << "'s memory " << id << ": " << e.what());
  }
}

void XgmiPeer::Close() {
  if (closed_.exchange(true)) return;
  std::unique_lock<std::shared_mutex> use(use_mu_);
  std::lock_guard<std::mutex> lk(map_mu_);
  for (auto& kv : mapped_) Unmap(kv.first, kv.second);
  for (auto& kv : retained_) Unmap(kv.first, kv.second);
  mapped_.clear();
  retained_.clear();
}

void XgmiPeer::Revoke(const std::vector<MemoryId>& ids) {
  std::unique_lock<std::shared_mutex> use(use_mu_);  // nobody is between lookup and enqueue now
  std::vector<std::pair<MemoryId, Mapping>> unmap;
  bool was_mapped = false;
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    for (MemoryId id : ids) {
      revoked_.insert(id);
      auto it = mapped_.find(id);
      if (it == mapped_.end()) continue;
      was_mapped = true;
      if (it->second.on_streams) {
        retained_.emplace_back(*it);
      } else {
        unmap.emplace_back(*it);
      }
      mapped_.erase(it);
    }
  }
  if (!was_mapped) return;
  // Copies already enqueued may still read or write the memory: the owner
  // hears back only after they ran.
  try {
    backend_->DrainCopies();
  } catch (const Error& e) {
    MORI_LOG(Error, "XGMI: waiting for copies before revoking memory of '" << remote_.key << "': " << e.what());
  }
  std::lock_guard<std::mutex> lk(map_mu_);
  for (auto& kv : unmap) Unmap(kv.first, kv.second);
}

size_t XgmiPeer::MappedCount() {
  std::lock_guard<std::mutex> lk(map_mu_);
  return mapped_.size();
}

namespace {

// Test hook: MORI_TORCH_FAIL_IPC_OPENS=N makes the next N mappings of a
// peer's memory fail as an IPC open that the driver refused would (in the
// same process too, where nothing is opened), so tests can make XGMI fail
// over without breaking a GPU.
void MaybeInjectIpcOpenFailure() {
  static std::atomic<int64_t> left{config::EnvInt("MORI_TORCH_FAIL_IPC_OPENS")};
  if (left.load(std::memory_order_relaxed) <= 0) return;
  if (left.fetch_sub(1) > 0) {
    throw Error(StatusCode::ERR_GPU_OP, "IPC open failed (injected by MORI_TORCH_FAIL_IPC_OPENS)");
  }
}

}  // namespace

uint64_t XgmiPeer::RemoteBase(const MemoryDesc& d, int local_device, bool on_stream, bool lookup_only) {
  auto revoked = [&] {
    return Error(StatusCode::ERR_NOT_FOUND, "remote memory " + std::to_string(d.id) + " of engine '" + remote_.key +
                                                "' was deregistered by its owner");
  };
  auto found = [&](Mapping& m) {
    if (d.data != m.remote_data || d.size != m.size) {  // a stale or forged descriptor of a mapped id
      throw Error(StatusCode::ERR_NOT_FOUND, "remote memory " + std::to_string(d.id) + " of engine '" + remote_.key +
                                                 "' no longer matches its descriptor");
    }
    if (same_process_) gpu::EnablePeerAccess(local_device, d.device_id);
    m.on_streams |= on_stream;
    return m.addr;
  };
  {
    std::lock_guard<std::mutex> lk(map_mu_);
    if (revoked_.count(d.id)) throw revoked();
    auto it = mapped_.find(d.id);
    if (it != mapped_.end()) return found(it->second);
    if (lookup_only) {
      throw Error(StatusCode::ERR_NOT_FOUND, "remote memory " + std::to_string(d.id) + " of engine '" + remote_.key +
                                                 "' was unmapped while the transfer was submitted");
    }
  }
  // First use of this memory: become a watcher (one control round trip, which
  // also checks the descriptor against the owner's registration), then map.
  backend_->ownership().Watch(d);
  std::lock_guard<std::mutex> lk(map_mu_);
  if (revoked_.count(d.id)) throw revoked();
  auto it = mapped_.find(d.id);
  if (it == mapped_.end()) {
    Mapping m;
    m.device = local_device;
    m.size = d.size;
    m.remote_data = d.data;
    MaybeInjectIpcOpenFailure();
    if (same_process_) {
      m.addr = d.data;
    } else {
      m.handle = d.ipc_handle;
      m.ipc_base = OpenShared(m.handle, local_device);
      m.addr = m.ipc_base + d.ipc_offset;
    }
    it = mapped_.emplace(d.id, m).first;
  }
  return found(it->second);
}

bool XgmiPeer::RemoteAddress(TransferOp& op, uint64_t* base, bool lookup_only) {
  if (closed_.load() || backend_->shut_down()) {
    op.status->Update(StatusCode::ERR_BAD_STATE, "XGMI peer '" + remote_.key + "' is closed");
    return false;
  }
  try {
    *base = RemoteBase(op.remote, op.local->desc.device_id, false, lookup_only);
  } catch (const Error& e) {
    const bool gone = e.code() == StatusCode::ERR_NOT_FOUND || e.code() == StatusCode::ERR_BAD_STATE;
    // Memory that is gone fails the transfer; a mapping that could not be
    // made (IPC open refused) fails the path: another backend may serve it.
    op.status->Update(
        gone ? e.code() : StatusCode::ERR_GPU_OP,
        "mapping memory " + std::to_string(op.remote.id) + " of engine '" + remote_.key + "': " + e.what(),
        /*path_failed=*/!gone);
    return false;
  }
  return true;
}

void XgmiPeer::Submit(TransferOp op) {
  XgmiBackend::SubmitScope submitting(backend_);
  std::shared_lock<std::shared_mutex> use = UseLock();
  uint64_t base = 0;
  if (RemoteAddress(op, &base)) backend_->Run(std::move(op), base);
}

}  // namespace xgmi
}  // namespace mori_torch
