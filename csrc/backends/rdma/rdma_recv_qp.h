// Target side of one QP. The initiator's RDMA operations need nothing from
// us (the NIC serves them against our registrations); this side only keeps
// receive buffers posted for completion notices and records each notice in
// the engine's notification table.
#pragma once

#include <string>
#include <vector>

#include "backends/rdma/rdma_qp.h"
#include "backends/rdma/rdma_send_qp.h"
#include "core/notification_table.h"

namespace mori_torch {
namespace rdma {

class RecvQp : public RdmaQp {
 public:
  // `recv_depth` notice buffers (0: the initiator sends none); `table` may be
  // nullptr (notices are received and dropped: notifications off here).
  RecvQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t recv_depth,
         std::string peer_key, NotificationTable* table);
  ~RecvQp() override;
  void OnCompletion(const ibv_wc& wc) override;

 private:
  void PostRecv(uint32_t index);

  const std::string peer_key_;
  NotificationTable* table_;
  std::vector<NoticeWire> bufs_;
  ibv_mr* mr_ = nullptr;
};

}  // namespace rdma
}  // namespace mori_torch
