// Target side of one QP. The initiator's RDMA operations need nothing from
// us (the NIC serves them against our registrations); this side only keeps
// receive buffers posted for completion notices and counts them (per
// connection) into the engine's notification table.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/rdma/rdma_qp.h"
#include "backends/rdma/rdma_send_qp.h"
#include "core/notification_table.h"

namespace mori_torch {
namespace rdma {

// Counts the parts (one per QP used) of each transfer announced on one
// initiator's connection and hands a transfer to the engine's notification
// table only once all of its parts have arrived. The parts of a transfer
// that never completes (its initiator failed midway: one failed work request
// breaks the whole connection) go with the connection instead of staying in
// the table for ever.
class NoticeCollector {
 public:
  // `table` may be nullptr (notifications off here: notices are counted and
  // dropped). `max_parts`: the connection's QP count (a transfer has at most
  // one part per QP); notices claiming more are dropped.
  NoticeCollector(NotificationTable* table, std::string peer_key, uint32_t max_parts);
  ~NoticeCollector();
  void Arrive(uint64_t uid, uint32_t parts_total);

 private:
  struct Partial {
    uint32_t arrived = 0;
    uint32_t total = 0;
  };
  NotificationTable* const table_;
  const std::string peer_key_;
  const uint32_t max_parts_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Partial> partial_;
};

// Process-wide counts of the target side, for tests and diagnostics.
struct NoticeCounters {
  uint64_t received = 0;    // well-formed notices received (one per part)
  uint64_t incomplete = 0;  // transfers with some but not all parts arrived, now
};
NoticeCounters TargetNoticeCounters();

class RecvQp : public RdmaQp {
 public:
  // `recv_depth` notice buffers (0: the initiator sends none).
  RecvQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t recv_depth,
         std::string peer_key, std::shared_ptr<NoticeCollector> notices);
  ~RecvQp() override;
  void OnCompletion(const ibv_wc& wc) override;

 private:
  void PostRecv(uint32_t index);

  const std::string peer_key_;
  std::shared_ptr<NoticeCollector> notices_;
  std::vector<NoticeWire> bufs_;
  ibv_mr* mr_ = nullptr;
};

}  // namespace rdma
}  // namespace mori_torch
