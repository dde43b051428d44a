#include "backends/rdma/rdma_recv_qp.h"

#include <cerrno>
#include <cstring>

#include "core/logging.h"

namespace mori_torch {
namespace rdma {
namespace {

std::atomic<uint64_t> g_received{0};
std::atomic<uint64_t> g_incomplete{0};

}  // namespace

NoticeCounters TargetNoticeCounters() {
  NoticeCounters c;
  c.received = g_received.load();
  c.incomplete = g_incomplete.load();
  return c;
}

NoticeCollector::NoticeCollector(NotificationTable* table, std::string peer_key, uint32_t max_parts)
    : table_(table), peer_key_(std::move(peer_key)), max_parts_(max_parts) {}

NoticeCollector::~NoticeCollector() {
  if (!partial_.empty()) {
    MORI_LOG(Debug, "RDMA: connection from engine '" << peer_key_ << "' closed with " << partial_.size()
                                                     << " transfer(s) only partly announced; dropped");
  }
  g_incomplete.fetch_sub(partial_.size());
}

void NoticeCollector::Arrive(uint64_t uid, uint32_t parts_total) {
  g_received.fetch_add(1);
  if (parts_total == 0 || parts_total > max_parts_) {
    MORI_LOG(Warning, "RDMA: notice from engine '" << peer_key_ << "' claims " << parts_total << " parts (at most "
                                                   << max_parts_ << "); dropped");
    return;
  }
  if (parts_total > 1) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = partial_.find(uid);
    if (it == partial_.end()) {
      it = partial_.emplace(uid, Partial{0, parts_total}).first;
      g_incomplete.fetch_add(1);
    }
    if (++it->second.arrived < it->second.total) return;
    partial_.erase(it);
    g_incomplete.fetch_sub(1);
  }
  if (table_) table_->Arrive(peer_key_, uid, 1);
}

RecvQp::RecvQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t recv_depth,
               std::string peer_key, std::shared_ptr<NoticeCollector> notices)
    : RdmaQp(std::move(dev), rail, worker, 1, recv_depth),
      peer_key_(std::move(peer_key)),
      notices_(std::move(notices)),
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
    MORI_LOG(Warning,
             "RDMA: re-posting a notice buffer for engine '" << peer_key_ << "' failed: " << std::strerror(rc));
  }
}

void RecvQp::OnCompletion(const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR) {
      MORI_LOG(Warning, "RDMA: notice receive from engine '" << peer_key_
                                                             << "' failed: " << dev_->api->wc_status_str(wc.status));
    }
    return;
  }
  const auto index = static_cast<uint32_t>(wc.wr_id);
  if (index >= bufs_.size()) return;
  const NoticeWire n = bufs_[index];
  // The buffer goes back first: once a notice is visible to pop, its buffer
  // is posted again (the initiator may rely on that, and it narrows the
  // window in which a notice finds no buffer and must be retried).
  if (!closed()) PostRecv(index);
  if (wc.opcode == IBV_WC_RECV && wc.byte_len == sizeof(NoticeWire) && n.magic == kNoticeMagic && notices_) {
    notices_->Arrive(n.uid, n.parts_total);
  }
}

}  // namespace rdma
}  // namespace mori_torch
