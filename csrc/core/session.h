// A session pins one (local, remote) memory pair to its backend peer, so
// repeated transfers skip descriptor and backend lookups. It follows
// failover: while some path is down its transfers are routed one by one
// (core/failover.h), and once all are healthy again it pins afresh.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "core/backend.h"
#include "core/retry_driver.h"
#include "core/transfer_args.h"

namespace mori_torch {

class Session {
 public:
  Session(std::shared_ptr<LocalMemory> local, MemoryDesc remote, TransferPath path, std::shared_ptr<RetryDriver> driver,
          std::shared_ptr<std::atomic<uint64_t>> uids)
      : local_(std::move(local)),
        remote_(std::move(remote)),
        path_(std::move(path)),
        driver_(std::move(driver)),
        generation_(driver_->health().Generation()),
        uids_(std::move(uids)),
        counters_(path_.counters) {}

  StatusPtr Read(int64_t local_offset, int64_t remote_offset, int64_t size, TransferUid uid);
  StatusPtr Write(int64_t local_offset, int64_t remote_offset, int64_t size, TransferUid uid);
  // Vectors convert to spans; callers holding int64 arrays (tensors) pass
  // them without a copy.
  StatusPtr BatchRead(Int64Span local_offsets, Int64Span remote_offsets, Int64Span sizes, TransferUid uid);
  StatusPtr BatchWrite(Int64Span local_offsets, Int64Span remote_offsets, Int64Span sizes, TransferUid uid);
  // The same transfer with `local` standing in for the session's local
  // memory: stream ordering moves GPU pages through a pinned staging slot,
  // so the host thread reads and writes only host memory (csrc/stream).
  StatusPtr SubmitVia(const std::shared_ptr<LocalMemory>& local, bool is_read, Int64Span local_offsets,
                      Int64Span remote_offsets, Int64Span sizes, TransferUid uid);
  bool Alive() const;
  TransferUid AllocateTransferUid() { return uids_->fetch_add(1, std::memory_order_relaxed); }
  // The pinned backend (the one failover routes to may differ for a while).
  BackendType backend_type() const;
  const MemoryDesc& local_desc() const { return local_->desc; }
  const MemoryDesc& remote_desc() const { return remote_; }
  // For stream-ordered transfers (csrc/torch/ops.cpp).
  const std::shared_ptr<LocalMemory>& local() const { return local_; }
  std::shared_ptr<BackendPeer> peer() const;

 private:
  StatusPtr Submit(bool is_read, Int64Span local_offsets, Int64Span remote_offsets, Int64Span sizes, TransferUid uid);

  // The pinned path, or a freshly routed one while some path is down.
  TransferPath CurrentPath();

  std::shared_ptr<LocalMemory> local_;
  MemoryDesc remote_;
  mutable std::mutex mu_;
  TransferPath path_;  // guarded by mu_
  std::shared_ptr<RetryDriver> driver_;
  uint64_t generation_;  // of PathHealth when path_ was pinned; guarded by mu_
  std::shared_ptr<std::atomic<uint64_t>> uids_;
  // The engine's counters for this pair and the first backend (null: not counted).
  std::shared_ptr<TransferCounters> counters_;
};

}  // namespace mori_torch
