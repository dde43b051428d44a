// One reliable-connected queue pair with its own CQ: creation, the
// INIT -> RTR -> RTS walk from the peer's QpInfo, and teardown that flushes
// and drains what is in flight before anything is freed. The initiator
// (SendQp) and target (RecvQp) sides derive from it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "backends/rdma/rdma_completion.h"
#include "backends/rdma/rdma_device.h"
#include "core/byte_io.h"

namespace mori_torch {
namespace rdma {

// What a peer needs to connect to one of our QPs.
struct QpInfo {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint16_t lid = 0;
  uint8_t mtu = 0;   // ibv_mtu of the port
  uint8_t rail = 0;  // index of the NIC on its engine
  ibv_gid gid{};

  void Put(ByteWriter* w) const;
  static QpInfo Get(ByteReader* r);
};

class RdmaQp : public CqOwner {
 public:
  RdmaQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t send_depth,
         uint32_t recv_depth);
  ~RdmaQp() override;
  RdmaQp(const RdmaQp&) = delete;
  RdmaQp& operator=(const RdmaQp&) = delete;

  QpInfo Info() const;
  size_t rail() const { return rail_; }
  // INIT -> RTR -> RTS against `remote`; path MTU is the smaller of both
  // ports'. Starts completion handling. Throws Error(ERR_RDMA_OP).
  void Connect(const QpInfo& remote);
  // Moves the QP to the error state, so everything posted completes with a
  // flush error (the peer is gone or the connection is being dropped).
  void Fail();
  bool closed() const { return closed_.load(std::memory_order_acquire); }

 protected:
  // Derived destructors call this first: flush, drain until Idle() (bounded),
  // stop completion handling, destroy the QP and CQ, then OnClosed().
  void Close();
  virtual bool Idle() { return true; }
  virtual void OnClosed() {}

  std::shared_ptr<RdmaDevice> dev_;
  const size_t rail_;
  CompletionWorker* worker_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t psn_ = 0;

 private:
  void Destroy();
  std::atomic<bool> closed_{false};
  std::atomic<bool> started_{false};
};

}  // namespace rdma
}  // namespace mori_torch
