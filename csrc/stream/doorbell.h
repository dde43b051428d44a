// The doorbell that orders host-driven transfers (TCP, RDMA) on a GPU stream
// (docs/ARCHITECTURE.md, "Stream-ordered ops"). For each stream-ordered op a
// slot of pinned, device-mapped
// host memory is enqueued on the stream (enqueue.cpp) as
//   [block lists -> slot] [GPU pages -> staging (writes)] -> ring := 1
//   -> wait done == 1 -> done := 0 [staging -> GPU pages (reads)]
// The progress thread sees ring, clears it, runs the transfer through the
// session (reading the lists the stream just staged) between the peer and
// either the registered host memory or the slot's staging bytes, and sets
// done when the transfer ended; errors go to the session's StreamErrors and
// set the slot's `failed` word, so a staged read scatters nothing. Because
// the stream re-arms done itself, a slot captured into a CUDA graph works on
// every replay: such "persistent" slots are watched as long as the graph may
// replay. The op ties each to its graph with a SlotLease released by a graph
// user object; once the graph is destroyed the progress thread stops
// watching the slot, drops its session and returns it to the pool. Where
// that tie is unavailable (HIP without graph user objects, such as HIP 5.2)
// a persistent slot is watched for the life of the process. One-shot slots
// return to the pool once the stream has passed them.
//
// The progress thread makes no GPU call at all (flags, lists and staging
// bytes are plain host memory), so it can never wait on a module load, an
// implicit device synchronization or the stream it is about to release
// (docs/GPU_FACTS.md, lazy-loading deadlock).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/session.h"
#include "stream/stream_errors.h"

namespace mori_torch {

// Ties a persistent slot to the graph that captured it. Retire() says the
// graph is gone (every executable destroyed, no launch pending); it takes no
// lock and makes no CUDA call, so a graph user object's destructor, which
// runs on a driver thread, may call it. The progress thread then stops
// watching the slot, drops its session and returns it to the pool.
class SlotLease {
 public:
  void Retire() { retired_.store(true, std::memory_order_release); }
  bool retired() const { return retired_.load(std::memory_order_acquire); }
  // A release callback for gpu::ReleaseWithCapturedGraph: `context` is a
  // heap-allocated std::shared_ptr<SlotLease>, retired and deleted here.
  static void ReleaseCallback(void* context);

 private:
  std::atomic<bool> retired_{false};
};

class DoorbellSlot {
 public:
  // Lists of `entries` values each, and `staging_bytes` of staging for GPU
  // pages (0: the slot only orders host memory).
  DoorbellSlot(size_t entries, size_t staging_bytes);
  ~DoorbellSlot();
  DoorbellSlot(const DoorbellSlot&) = delete;
  DoorbellSlot& operator=(const DoorbellSlot&) = delete;

  uint32_t* ring() const { return &words_[0]; }
  uint32_t* done() const { return &words_[1]; }
  // 1 when the last transfer failed (a staged read's scatter then skips).
  uint32_t* failed() const { return &words_[2]; }
  // List `which` (0 local offsets, 1 remote offsets, 2 sizes, 3 packed
  // staging offsets): `entries` int64 values the stream or the host fills.
  int64_t* list(int which) const { return lists_ + which * entries_; }
  size_t entries() const { return entries_; }
  char* staging() const { return staging_; }
  size_t staging_bytes() const { return staging_bytes_; }
  // The staging bytes as a host registration the backends move bytes from
  // and into (never registered with an engine; a process-unique id).
  const std::shared_ptr<LocalMemory>& staging_memory() const { return staging_memory_; }
  // Device memory of staging_bytes() on device scratch_domain_ where the
  // stream packs pages before the DMA into staging (and unpacks after it);
  // made by the enqueue path on first staged use, freed with the slot.
  void* scratch_ = nullptr;
  int scratch_domain_ = -2;
  void (*free_scratch_)(void*, int) = nullptr;

  // The transfer, set by the op before Watch. segs' array pointers point
  // into list(...) (host addresses) or are null.
  std::shared_ptr<Session> session;
  bool is_read = false;
  gpu::StreamCopyArgs segs;
  // Staged: local GPU bytes travel through staging(); local_size bounds the
  // local offsets (the bytes the stream's kernels touch).
  bool staged = false;
  uint64_t local_size = 0;
  std::shared_ptr<StreamErrors> errors;
  bool persistent = false;
  // For a persistent slot captured into a graph: its tie to that graph
  // (null: watched for good).
  std::shared_ptr<SlotLease> lease;

 private:
  friend class DoorbellService;
  enum class Phase { Waiting, Moving, Draining };
  Phase phase_ = Phase::Waiting;
  StatusPtr inflight_;
  std::string peer_;  // for error messages

  size_t entries_;
  size_t staging_bytes_;
  size_t bytes_;
  bool pinned_ = false;
  char* base_;
  uint32_t* words_;
  int64_t* lists_;
  char* staging_;
  std::shared_ptr<LocalMemory> staging_memory_;
};

class DoorbellService {
 public:
  // The process-wide service; its thread starts on first use and is
  // stopped at exit.
  static DoorbellService& Instance();

  // An idle slot whose lists hold at least `entries` values each and whose
  // staging holds at least `staging_bytes` (the smallest that fits).
  // A staged slot (staging_bytes > 0) also matches `domain`, the device its
  // scratch lives on, or has no scratch yet.
  std::shared_ptr<DoorbellSlot> Acquire(size_t entries, size_t staging_bytes = 0, int domain = -2);
  // Pools `count` idle slots of `entries` now, so that ops captured into a
  // graph later need no host-memory registration during the capture.
  void Reserve(size_t count, size_t entries, size_t staging_bytes = 0);
  // Pinned bytes held by idle slots (leak checks).
  size_t PooledBytes();
  // Starts watching `slot`: its ring/wait/reset are on a stream already.
  void Watch(std::shared_ptr<DoorbellSlot> slot);
  // Slots watched now (persistent ones included), for tests.
  size_t Watched();
  // Watched slots tied to a captured graph by a lease (freed when that graph
  // is destroyed), for tests.
  size_t Leased();
  void Stop();

 private:
  explicit DoorbellService(std::chrono::microseconds spin);
  void Loop();
  // Advances one slot; true when something happened.
  bool Step(DoorbellSlot& slot);
  void Ring(DoorbellSlot& slot);
  StatusCode StartStaged(DoorbellSlot& slot, std::string* msg);
  void Finish(DoorbellSlot& slot, StatusCode code, const std::string& message);
  // True when the graph that captured the slot is gone and the slot is idle
  // (no transfer running, no ring pending): it may leave the watch list.
  static bool Retired(DoorbellSlot& slot);
  // Drops watched_[i] (the loop's thread): back to the pool, without session.
  void Recycle(size_t i);

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<std::shared_ptr<DoorbellSlot>> incoming_;
  std::vector<std::shared_ptr<DoorbellSlot>> free_;
  std::atomic<size_t> watched_count_{0};
  std::atomic<size_t> leased_count_{0};
  std::vector<std::shared_ptr<DoorbellSlot>> watched_;  // the loop's own
  std::thread thread_;
  // How long the progress thread stays hot after its last ring or completion
  // (MORI_TORCH_DOORBELL_SPIN_US; 0 sleeps at once): a ring found while
  // spinning costs a few microseconds, one found after a sleep up to the
  // sleep. Idle, it sleeps in steps of at most 50 us.
  const std::chrono::microseconds spin_;
};

// Expands the segment description of a doorbell or host transfer into byte
// lists; ERR_INVALID_ARGS with *msg for negative or overflowing values.
StatusCode ExpandSegments(const gpu::StreamCopyArgs& segs, std::vector<int64_t>* local_offsets,
                          std::vector<int64_t>* remote_offsets, std::vector<int64_t>* sizes, std::string* msg);
// Segment i's raw list entries, for messages ("local 7 x 4096, ...").
std::string DescribeSegment(const gpu::StreamCopyArgs& segs, int64_t i);

}  // namespace mori_torch
