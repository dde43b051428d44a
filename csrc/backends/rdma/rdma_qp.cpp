#include "backends/rdma/rdma_qp.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "core/logging.h"
#include "core/net.h"
#include "core/types.h"

namespace mori_torch {
namespace rdma {
namespace {

[[noreturn]] void Throw(const RdmaDevice& d, const std::string& what, int err) {
  throw Error(StatusCode::ERR_RDMA_OP, "RDMA (" + d.name + "): " + what + ": " + std::strerror(err));
}

uint32_t RandomPsn() {
  static thread_local std::mt19937 rng(std::random_device{}());
  return rng() & 0xffffff;
}

}  // namespace

void QpInfo::Put(ByteWriter* w) const {
  w->Put<uint32_t>(qpn);
  w->Put<uint32_t>(psn);
  w->Put<uint16_t>(lid);
  w->Put<uint8_t>(mtu);
  w->Put<uint8_t>(rail);
  w->PutBytes(gid.raw, sizeof gid.raw);
}

QpInfo QpInfo::Get(ByteReader* r) {
  QpInfo q;
  q.qpn = r->Get<uint32_t>("qpn");
  q.psn = r->Get<uint32_t>("psn") & 0xffffff;
  q.lid = r->Get<uint16_t>("lid");
  q.mtu = r->Get<uint8_t>("mtu");
  q.rail = r->Get<uint8_t>("rail");
  r->GetBytes(q.gid.raw, sizeof q.gid.raw, "gid");
  if (q.mtu < IBV_MTU_256 || q.mtu > IBV_MTU_4096) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "QP info: bad MTU code " + std::to_string(q.mtu));
  }
  return q;
}

RdmaQp::RdmaQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t send_depth,
               uint32_t recv_depth)
    : dev_(std::move(dev)), rail_(rail), worker_(worker), psn_(RandomPsn()) {
  const VerbsApi* api = dev_->api;
  const int cqe = static_cast<int>(send_depth + recv_depth + 1);
  cq_ = api->create_cq(dev_->ctx, cqe, this, worker_->Channel(rail_), 0);
  if (!cq_) Throw(*dev_, "ibv_create_cq(" + std::to_string(cqe) + ")", errno);
  ibv_qp_init_attr init{};
  init.send_cq = cq_;
  init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signaling: only each chain's last WR
  init.cap.max_send_wr = send_depth;
  init.cap.max_recv_wr = recv_depth ? recv_depth : 1;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  qp_ = api->create_qp(dev_->pd, &init);
  if (!qp_) {
    const int e = errno;
    api->destroy_cq(cq_);
    cq_ = nullptr;
    Throw(*dev_, "ibv_create_qp(max_send_wr " + std::to_string(send_depth) + ")", e);
  }
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = dev_->port;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  int rc = api->modify_qp(qp_, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc) {
    Destroy();
    Throw(*dev_, "modify QP to INIT", rc);
  }
}

RdmaQp::~RdmaQp() { Destroy(); }

QpInfo RdmaQp::Info() const {
  QpInfo q;
  q.qpn = qp_->qp_num;
  q.psn = psn_;
  q.lid = dev_->lid;
  q.mtu = static_cast<uint8_t>(dev_->active_mtu);
  q.rail = static_cast<uint8_t>(rail_);
  q.gid = dev_->gid;
  return q;
}

void RdmaQp::Connect(const QpInfo& remote) {
  const VerbsApi* api = dev_->api;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(dev_->active_mtu, remote.mtu));
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = static_cast<uint8_t>(std::min(dev_->max_rd_atomic, 255));
  a.min_rnr_timer = 1;  // 0.01 ms: notice receive buffers are re-posted at once
  a.ah_attr.port_num = dev_->port;
  a.ah_attr.dlid = remote.lid;
  if (dev_->roce || remote.lid == 0) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = remote.gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(dev_->gid_index);
    a.ah_attr.grh.hop_limit = 64;
  }
  int rc = api->modify_qp(qp_, &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc)
    Throw(*dev_, "modify QP to RTR (remote GID " + GidText(remote.gid) + ", QPN " + std::to_string(remote.qpn) + ")",
          rc);
  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.timeout = 14;  // 4.096 us * 2^14 = 67 ms per try
  s.retry_cnt = 7;
  s.rnr_retry = 7;  // receiver-not-ready: retry without limit
  s.sq_psn = psn_;
  s.max_rd_atomic = static_cast<uint8_t>(std::min(dev_->max_rd_atomic, 255));
  rc = api->modify_qp(
      qp_, &s,
      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc) Throw(*dev_, "modify QP to RTS", rc);
  started_.store(true);
  worker_->Add(cq_, this);
}

void RdmaQp::Fail() {
  if (!qp_) return;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  dev_->api->modify_qp(qp_, &a, IBV_QP_STATE);
}

void RdmaQp::Close() {
  if (closed_.exchange(true)) return;
  Fail();
  // From here this thread alone polls the CQ. Flushed work completes
  // promptly; the bound only guards against a broken provider: whatever is
  // still outstanding after it is failed by OnClosed.
  if (started_.load()) worker_->Remove(cq_);
  const Deadline deadline = DeadlineAfterMs(3000);
  while (!Idle() && Clock::now() < deadline) {
    if (DrainCq(cq_, this) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  DrainCq(cq_, this);
  Destroy();
  OnClosed();
}

void RdmaQp::Destroy() {
  if (qp_) dev_->api->destroy_qp(qp_);
  qp_ = nullptr;
  if (cq_) dev_->api->destroy_cq(cq_);
  cq_ = nullptr;
}

}  // namespace rdma
}  // namespace mori_torch
