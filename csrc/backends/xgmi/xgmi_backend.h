// BackendType.XGMI: GPU peer copies between GPUs of one node (NVLink, XGMI
// or PCIe), in one process or across processes. Remote memory is mapped once
// per (peer, memory) from its IPC handle. Few large segments go to the copy
// engines (async copies on a pool of streams, picked by LanePicker); batches of small segments go
// to one gather/scatter kernel launch reading its list from device memory.
// Completion: an event per transfer, polled by the status (Code/Wait) and by
// a completion thread, so statuses end even if nobody polls.
// Revocation (xgmi_ownership.h): before it first maps a memory, a peer
// registers with the owner as a watcher; when the owner deregisters it, the
// peer refuses further transfers to it, waits for the copies in flight and
// closes the mapping before acknowledging, so the owner's deregister_memory
// returns only once nothing here can write into that memory.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "backends/xgmi/lane_picker.h"
#include "backends/xgmi/xgmi_ownership.h"
#include "core/backend.h"
#include "core/peer_cache.h"
#include "gpu/gpu_runtime.h"

namespace mori_torch {
namespace xgmi {

// FromMap sets every field; defaults, ranges and docs: base/config_table.cpp.
struct XgmiConfig {
  int64_t num_streams{};
  int64_t num_events{};
  // Batches with at least this many segments (after merging) use the copy
  // kernel; fewer go to the copy engines...
  int64_t kernel_min_segments{};  // 2 x H200 grid: 4 lost at 1-4 MiB x 4
  // ...and so do batches whose segments average at least this many bytes.
  // Both measured (kernel vs copy engines over count x size): see the XGMI
  // section of docs/BENCHMARK.md and `benchmarks/bench_xgmi.py --grid`.
  int64_t kernel_max_avg_bytes{};
  static XgmiConfig FromMap(const BackendConfig& m);
};

class XgmiBackend;
struct PendingCopy;

// A kernel's segment list, in pinned host memory mapped into the device's
// address space: the kernel reads its entries from there (no upload, no
// second stream: written by the host, then one launch). Lists are pooled
// per device and reused by later transfers once their last kernel ran.
struct SegmentList {
  gpu::CopySegment* host = nullptr;  // pinned, mapped
  uint64_t device_view = 0;          // the same memory's address on the device
  size_t capacity = 0;
  gpu::Event consumed = nullptr;  // its last kernel ran: it may be rewritten
};

// Per-device resources: a pool of lanes (copy streams) and a pool of
// segment lists (at most one per lane).
struct DeviceContext {
  struct Lane {
    gpu::Stream stream = nullptr;  // copies and kernels
    std::mutex mu;                 // one submitter at a time per lane
  };
  int device = -1;
  uint32_t resident_groups = 1;  // segment-copy thread groups that run at once
  std::vector<std::unique_ptr<Lane>> lanes;
  std::unique_ptr<LanePicker> picker;  // over `lanes`
  std::mutex lists_mu;
  std::deque<std::unique_ptr<SegmentList>> idle_lists;  // oldest returned first
  size_t list_count = 0;
};

class XgmiPeer : public BackendPeer {
 public:
  XgmiPeer(XgmiBackend* backend, EngineDesc remote);
  ~XgmiPeer() override;
  void Submit(TransferOp op) override;
  // Held (shared) from RemoteAddress until the copies that use the address
  // are enqueued: revocation takes it exclusively.
  std::shared_lock<std::shared_mutex> UseLock() { return std::shared_lock<std::shared_mutex>(use_mu_); }
  // op's remote memory as mapped here, in *base; false with op.status ended
  // when the peer is closed or the memory cannot be mapped. `lookup_only`:
  // only a mapping made before counts (no watch, no IPC open).
  bool RemoteAddress(TransferOp& op, uint64_t* base, bool lookup_only = false);
  bool Alive() const override { return !closed_.load(); }
  void Close();
  // The owner deregistered `ids`: see the file comment.
  void Revoke(const std::vector<MemoryId>& ids);
  // Remote memories mapped and not revoked (for tests and leak checks).
  size_t MappedCount();
  // Stream-ordered transfers (xgmi_stream.cpp): one bounds-checked copy
  // kernel on the caller's stream.
  bool RunsOnStream() const override { return true; }
  void PrepareStream(const LocalMemory& local, const MemoryDesc& remote) override;
  void LaunchOnStream(const LocalMemory& local, const MemoryDesc& remote, gpu::StreamCopyArgs args,
                      gpu::Stream stream) override;

 private:
  // Address of remote memory `d` in this process; the first use of a memory
  // watches it at its owner and maps it. `on_stream`: the address goes into
  // work on a caller's stream (maybe a CUDA graph), which this backend cannot
  // wait for, so the mapping then stays open until the peer closes. Callers
  // hold use_mu_ shared until the copies are enqueued.
  uint64_t RemoteBase(const MemoryDesc& d, int local_device, bool on_stream, bool lookup_only = false);

  XgmiBackend* backend_;
  const EngineDesc remote_;
  const bool same_process_;
  std::atomic<bool> closed_{false};
  // Shared from address lookup to enqueue, exclusive while revoking: no copy
  // can be enqueued with an address that is being taken back.
  std::shared_mutex use_mu_;
  std::mutex map_mu_;
  struct Mapping {
    uint64_t addr = 0;      // the registered range in this process
    uint64_t ipc_base = 0;  // what OpenIpcHandle returned; 0 in one process
    gpu::IpcHandle handle{};
    uint64_t remote_data = 0;  // the owner's address and size, as watched
    uint64_t size = 0;
    int device = -1;
    bool on_streams = false;
  };
  // Both under map_mu_. Registrations inside one allocation share its IPC
  // handle: it is opened once per (handle, device) and closed with its last user.
  uint64_t OpenShared(const gpu::IpcHandle& handle, int device);
  void Unmap(MemoryId id, const Mapping& m);
  struct Opened {
    uint64_t base = 0;
    int users = 0;
  };
  std::map<std::pair<gpu::IpcHandle, int>, Opened> opened_;
  std::unordered_map<MemoryId, Mapping> mapped_;
  std::vector<std::pair<MemoryId, Mapping>> retained_;  // revoked, used by stream work: closed with the peer
  std::unordered_set<MemoryId> revoked_;
};

class XgmiBackend : public Backend {
 public:
  XgmiBackend(const XgmiConfig& cfg, const BackendContext& ctx);
  ~XgmiBackend() override;
  BackendType Type() const override { return BackendType::XGMI; }
  bool CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc& remote_engine) const override;
  std::shared_ptr<BackendPeer> Peer(const EngineDesc& remote) override;
  // The pairs of an engine-level batch: those whose local memory is on one
  // GPU run together (RunOnDevice).
  void SubmitGroup(std::vector<PeerOp> ops) override;
  void RemovePeer(const std::string& key, const std::string& reason) override;
  // Owner `owner_key` deregistered `ids` (MemoryOwnership's revoker): later
  // transfers to them fail, and when this returns no copy of ours touches them.
  void RevokeRemoteMemory(const std::string& owner_key, const std::vector<MemoryId>& ids);
  void Shutdown() override;
  // Waits until every copy enqueued so far on this backend's streams ran.
  void DrainCopies();
  size_t MappedRemoteMemories() override;

  // Runs the copies of one transfer and tracks its completion.
  void Run(TransferOp op, uint64_t remote_base);
  // A transfer with the address of its remote memory in this process.
  struct Located {
    TransferOp op;
    uint64_t remote_base = 0;
  };
  // Runs transfers whose local memory is on one GPU: those of small
  // segments share one Enqueue (one kernel launch, one completion) when
  // together they are enough for the kernel (KernelSuits), else each goes
  // alone; those of large segments go alone, as Run does. Every status
  // ends.
  void RunOnDevice(std::vector<Located> ops);
  // Largest piece one thread group of the copy kernel takes: segments are
  // cut so that a batch of few large segments still fills the device.
  static uint64_t KernelPieceBytes(uint64_t total_bytes, uint32_t resident_groups);
  const BackendContext& ctx() const { return ctx_; }
  MemoryOwnership& ownership() { return *ownership_; }
  bool shut_down() const { return shut_.load(); }
  // Held by a submitter from before its shut-down check to the end of its
  // enqueue or launch; Shutdown waits until none is. A count, not a lock:
  // a stream of submitters turned away cannot starve the shutdown.
  class SubmitScope {
   public:
    explicit SubmitScope(XgmiBackend* b) : b_(b) { b_->submitting_.fetch_add(1); }
    ~SubmitScope() { b_->submitting_.fetch_sub(1); }
    SubmitScope(const SubmitScope&) = delete;
    SubmitScope& operator=(const SubmitScope&) = delete;

   private:
    XgmiBackend* b_;
  };

 private:
  DeviceContext& Device(int device);
  // One transfer's segments with the addresses they are relative to.
  struct CopySource {
    SegmentSpan segs;
    uint64_t device_view;  // of segs' entries when the GPU can read them in place (DeviceViewOf), else 0
    uint64_t dst_base;
    uint64_t src_base;
    bool is_read;
    uint64_t max_bytes;  // of *segs' entries
    // Where segment s is copied to and from, as addresses in this process.
    uint64_t Dst(const Segment& s) const { return dst_base + (is_read ? s.local_off : s.remote_off); }
    uint64_t Src(const Segment& s) const { return src_base + (is_read ? s.remote_off : s.local_off); }
  };
  // A transfer ready to enqueue: its local memory held, its segments placed.
  struct Prepared {
    StatusPtr status;
    MemoryUse use;
    CopySource source;
    uint64_t bytes;
    SharedSegments list;  // holds source.segs
  };
  // Segments that average fewer bytes than kernel_max_avg_bytes.
  bool SmallSegments(size_t segments, uint64_t total) const;
  // The kernel (rather than the copy engines) for this many segments and bytes.
  bool KernelSuits(size_t segments, uint64_t total) const;
  // Enqueues `batch` on one lane of GPU `dev` (kernel or copy engines, chosen
  // for the whole) and tracks its completion; on any failure ends every
  // status of the batch, after the copies already enqueued ran.
  void Enqueue(int dev, std::vector<Prepared> batch);
  // A batch of one; `p` is taken only once the batch exists (until then a
  // failure leaves it to the caller, who ends its status).
  void EnqueueAlone(int dev, Prepared& p);
  // Enqueues the copy kernel(s) for the sources' `segments` segments
  // (`total` bytes, none empty) on `lane`. True when the kernel reads the
  // sources' lists in place: they must then live until it ran.
  bool EnqueueKernel(DeviceContext& dc, DeviceContext::Lane& lane, const std::vector<CopySource>& sources,
                     size_t segments, uint64_t total);
  // A list of at least `entries` entries: the oldest idle one when the GPU
  // is done with it, else a new one while fewer than num_streams exist.
  std::unique_ptr<SegmentList> TakeList(DeviceContext& dc, size_t entries);
  void ReturnList(DeviceContext& dc, std::unique_ptr<SegmentList> list);
  void FreeList(SegmentList& list, int device);
  gpu::Event TakeEvent(int device);
  void ReturnEvent(gpu::Event e, int device);
  void CompletionLoop();
  // Polls pending transfers old enough (kLeftToPollers) and releases the
  // resources of finished ones; returns when to pass again (0: none left).
  std::chrono::microseconds Reap();
  // The completion thread's pace: a nap while transfers come and go, a
  // short one while an old copy runs, and the age before which a copy is
  // left to its status's pollers (a 4 KiB transfer's p99 on one H200 fell
  // from 1.9-2.5x its p50 to 1.7-1.9x once the thread stopped querying
  // events that a caller was polling).
  static constexpr std::chrono::microseconds kReapNap{200};
  static constexpr std::chrono::microseconds kReapPoll{20};
  static constexpr std::chrono::microseconds kLeftToPollers{1000};

  const XgmiConfig cfg_;
  const BackendContext ctx_;
  std::shared_ptr<MemoryOwnership> ownership_;
  std::atomic<bool> shut_{false};
  std::atomic<int64_t> submitting_{0};  // SubmitScopes alive

  std::mutex dev_mu_;
  std::unordered_map<int, std::unique_ptr<DeviceContext>> devices_;
  std::mutex event_mu_;
  std::unordered_map<int, std::vector<gpu::Event>> free_events_;

  std::mutex pending_mu_;
  std::condition_variable pending_cv_;
  bool reaper_asleep_ = false;  // guarded by pending_mu_: Run wakes the completion thread only then
  std::deque<std::shared_ptr<PendingCopy>> pending_;
  std::thread completion_thread_;

  PeerCache<XgmiPeer> peers_;
};

}  // namespace xgmi
}  // namespace mori_torch
