// A session pins one (local, remote) memory pair to its backend peer, so
// repeated transfers skip descriptor and backend lookups.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "core/transfer_args.h"

namespace mori_torch {

class Session {
 public:
  Session(std::shared_ptr<LocalMemory> local, MemoryDesc remote, std::shared_ptr<Backend> backend,
          std::shared_ptr<BackendPeer> peer, std::shared_ptr<std::atomic<uint64_t>> uids,
          std::shared_ptr<TransferCounters> counters)
      : local_(std::move(local)),
        remote_(std::move(remote)),
        backend_(std::move(backend)),
        peer_(std::move(peer)),
        uids_(std::move(uids)),
        counters_(std::move(counters)) {}

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
  BackendType backend_type() const { return backend_->Type(); }
  const MemoryDesc& local_desc() const { return local_->desc; }
  const MemoryDesc& remote_desc() const { return remote_; }
  // For stream-ordered transfers (csrc/torch/ops.cpp).
  const std::shared_ptr<LocalMemory>& local() const { return local_; }
  BackendPeer& peer() const { return *peer_; }

 private:
  StatusPtr Submit(bool is_read, Int64Span local_offsets, Int64Span remote_offsets, Int64Span sizes,
                   TransferUid uid);

  std::shared_ptr<LocalMemory> local_;
  MemoryDesc remote_;
  std::shared_ptr<Backend> backend_;
  std::shared_ptr<BackendPeer> peer_;
  std::shared_ptr<std::atomic<uint64_t>> uids_;
  std::shared_ptr<TransferCounters> counters_;  // the engine's, for this pair (null: not counted)
};

}  // namespace mori_torch
