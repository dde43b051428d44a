#include "backends/rdma/rdma_recv_qp.h"

#include <cerrno>
#include <cstring>

#include "core/logging.h"

namespace mori_torch {
namespace rdma {

RecvQp::RecvQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t recv_depth,
               std::string peer_key, NotificationTable* table)
    : RdmaQp(std::move(dev), rail, worker, 1, recv_depth), peer_key_(std::move(peer_key)), table_(table),
      bufs_(recv_depth) {
  if (recv_depth == 0) return;
  mr_ = dev_->api->reg_mr(dev_->pd, bufs_.data(), bufs_.size() * sizeof(NoticeWire), IBV_ACCESS_LOCAL_WRITE);
  if (!mr_) {
    throw Error(StatusCode::ERR_RDMA_OP,
                "RDMA (" + dev_->name + "): ibv_reg_mr of notice receive buffers: " + std::strerror(errno));
  }
  for (uint32_t i = 0; i < recv_depth; ++i) PostRecv(i);
}

RecvQp::~RecvQp() {
  Close();
  if (mr_) dev_->api->dereg_mr(mr_);
}

void RecvQp::PostRecv(uint32_t index) {
  ibv_sge sge{reinterpret_cast<uint64_t>(&bufs_[index]), sizeof(NoticeWire), mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = index;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  int rc = ibv_post_recv(qp_, &wr, &bad);
  if (rc && !closed()) {
    MORI_LOG(Warning, "RDMA: re-posting a notice buffer for engine '" << peer_key_ << "' failed: "
                                                                      << std::strerror(rc));
  }
}

void RecvQp::OnCompletion(const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR) {
      MORI_LOG(Warning, "RDMA: notice receive from engine '" << peer_key_ << "' failed: "
                                                             << dev_->api->wc_status_str(wc.status));
    }
    return;
  }
  const auto index = static_cast<uint32_t>(wc.wr_id);
  if (index >= bufs_.size()) return;
  const NoticeWire n = bufs_[index];
  if (wc.opcode == IBV_WC_RECV && wc.byte_len == sizeof(NoticeWire) && n.magic == kNoticeMagic && table_) {
    table_->Arrive(peer_key_, n.uid, n.parts_total);
  }
  if (!closed()) PostRecv(index);
}

}  // namespace rdma
}  // namespace mori_torch
