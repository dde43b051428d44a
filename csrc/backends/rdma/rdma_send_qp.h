// Initiator side of one QP. Work requests are posted in chains, only the
// last one signaled; a chain's completion frees its send-queue slots and
// reports one part of its transfer. Slots are counted here, so posting never
// overruns the send queue: Reserve waits for room up to a deadline.
// Completion notices ride at the end of a chain, in slots reserved with it,
// so a notice can never take room a data chain was promised.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>

#include "backends/rdma/rdma_qp.h"
#include "core/memory_registry.h"
#include "core/net.h"
#include "core/transfer_tracker.h"

namespace mori_torch {
namespace rdma {

// What a transfer keeps alive until its last chain completes.
struct SendTransfer {
  MemoryUse local;  // deregistration waits for this
  std::shared_ptr<TransferTracker> tracker;
  const char* verb = "RDMA WRITE";
};

struct Chain {
  std::shared_ptr<SendTransfer> xfer;
  uint32_t slots = 0;
  StatusCode code = StatusCode::SUCCESS;
  std::string msg;
  bool path_failed = false;  // the QP failed (not the request): retry elsewhere
};

// The notice a target receives: one part of (initiator, uid) is in place.
struct NoticeWire {
  uint32_t magic;
  uint32_t parts_total;
  uint64_t uid;
};
constexpr uint32_t kNoticeMagic = 0x4e54434d;  // "MCTN"

// Test hook: the next `n` chains posted in this process find their QP moved
// to the error state (ibv_modify_qp to IBV_QPS_ERR) just before they are
// posted, as after a NIC or link failure: their work requests complete with
// flush errors.
void FailNextPostedQpsForTest(int n);

class SendQp : public RdmaQp {
 public:
  // `inactivity_ms`: see CheckProgress.
  SendQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t depth, std::string peer_key,
         int64_t inactivity_ms);
  ~SendQp() override;

  uint32_t depth() const { return depth_; }
  // Waits until `n` slots are free (or the deadline passes, or the QP fails).
  bool Reserve(uint32_t n, Deadline deadline, std::string* why);
  // True once the QP failed on its own (in error, peer gone): its failures
  // are path failures. A QP broken on purpose (peer removed, backend
  // removed, engine shut down) is not.
  bool path_broken() const;
  void Unreserve(uint32_t n);
  // Fills the next notice buffer and returns its scatter entry.
  ibv_sge Notice(uint64_t uid, uint32_t parts_total);
  // Posts the linked list `first` (chain->slots WRs, reserved) as `chain`.
  // False with *why if nothing was posted (chain not taken); a partial post
  // (the provider refused midway) breaks the QP: the chain then ends with
  // the flush.
  bool Post(ibv_send_wr* first, Chain* chain, std::string* why);
  // Fails the QP with `reason`; reported for every flushed chain.
  // `path_failed`: the path broke (false: closed on purpose).
  void Break(const std::string& reason, bool path_failed = true);
  // Called (on the completion thread) when a work request fails for a reason
  // other than a flush: the QP is then in the error state and unusable.
  void SetOnError(std::function<void(const std::string&)> f) { on_error_ = std::move(f); }

  void OnCompletion(const ibv_wc& wc) override;
  // A QP with chains in flight that completed none of them for
  // `inactivity_ms` (a lost peer that keeps its socket, a path whose
  // retransmissions never get through: RC retries without limit at
  // retry_cnt 7 on Soft-RoCE, RNR retries do everywhere) fails the path
  // (SetOnError's callback, else Break), so its chains end and are retried.
  bool CheckProgress(Clock::time_point now) override;

 protected:
  bool Idle() override;
  void OnClosed() override;

 private:
  void Finish(Chain* c);

  const uint32_t depth_;
  const std::string peer_key_;
  const int64_t inactivity_ms_;
  mutable std::mutex mu_;
  std::condition_variable room_;
  uint32_t used_ = 0;
  bool broken_ = false;
  std::string broken_reason_;
  bool broken_path_ = true;          // broken_ by a failure of the path (Break's path_failed)
  std::deque<Chain*> outstanding_;   // in posting order; completions come in order
  Clock::time_point last_progress_;  // the last chain's end, or the post that ended idleness
  std::vector<NoticeWire> notices_;
  ibv_mr* notice_mr_ = nullptr;
  uint32_t next_notice_ = 0;
  std::function<void(const std::string&)> on_error_;
};

}  // namespace rdma
}  // namespace mori_torch
