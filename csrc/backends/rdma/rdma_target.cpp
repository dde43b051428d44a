#include "backends/rdma/rdma_target.h"

#include "backends/rdma/rdma_protocol.h"
#include "backends/rdma/rdma_recv_qp.h"
#include "core/byte_io.h"
#include "core/control_plane.h"
#include "core/logging.h"

namespace mori_torch {
namespace rdma {
namespace {

constexpr int kFrameTimeoutMs = 5000;

class TargetConnection {
 public:
  TargetConnection(std::shared_ptr<RdmaShared> shared, const EngineDesc& peer)
      : shared_(std::move(shared)), peer_(peer) {}

  std::vector<uint8_t> Handle(const std::vector<uint8_t>& req) {
    ByteReader r(req.data(), req.size(), "RDMA request");
    const auto op = static_cast<RdmaOp>(r.Get<uint8_t>("op"));
    if (op == RdmaOp::Connect) return Connect(r);
    if (op == RdmaOp::MemKey) return MemKey(r);
    throw Error(StatusCode::ERR_INVALID_ARGS, "unknown RDMA request op " + std::to_string(static_cast<int>(op)));
  }

 private:
  std::vector<uint8_t> Connect(ByteReader& r) {
    const bool notify = r.Get<uint8_t>("notify") != 0;
    const uint32_t buffers = r.Get<uint32_t>("notice buffers");
    const uint32_t n = r.Get<uint32_t>("QP count");
    if (n == 0 || n > kMaxQpsPerConnection || buffers > kMaxNoticeBuffersPerQp) {
      throw Error(StatusCode::ERR_INVALID_ARGS, "RDMA Connect: " + std::to_string(n) + " QPs with " +
                                                    std::to_string(buffers) + " notice buffers each is out of range");
    }
    std::vector<QpInfo> theirs;
    for (uint32_t i = 0; i < n; ++i) theirs.push_back(QpInfo::Get(&r));
    r.ExpectEnd();
    qps_.clear();  // a repeated Connect replaces the QPs
    const auto& rails = shared_->rails;
    NotificationTable* table = shared_->cfg.enable_notification ? shared_->ctx.notices : nullptr;
    auto notices = std::make_shared<NoticeCollector>(table, peer_.key, n);
    ByteWriter w;
    w.Put<uint32_t>(n);
    for (uint32_t i = 0; i < n; ++i) {
      const size_t rail = i % rails.size();
      const uint32_t depth =
          notify ? std::min<uint32_t>(buffers, static_cast<uint32_t>(std::max(1, rails[rail]->max_qp_wr - 1))) : 0;
      auto qp = std::make_unique<RecvQp>(rails[rail], rail, shared_->NextWorker(), depth, peer_.key, notices);
      qp->Connect(theirs[i]);
      qp->Info().Put(&w);
      qps_.push_back(std::move(qp));
    }
    return std::move(w.bytes());
  }

  std::vector<uint8_t> MemKey(ByteReader& r) {
    const uint64_t id = r.Get<uint64_t>("memory id");
    const Incarnation incarnation = r.Get<uint64_t>("incarnation");
    MemoryToken token;
    r.GetBytes(token.data(), token.size(), "token");
    r.ExpectEnd();
    // The rkeys are the NIC's handle to the memory: handed out only for the
    // memory's token and this process's incarnation. Held while registering,
    // so a concurrent deregistration waits for us and then drops what we
    // registered.
    std::string msg;
    MemoryUse use(shared_->ctx.memory->FindForPeer(id, incarnation, token, &msg));
    if (!use) {
      if (msg.empty()) msg = "memory " + std::to_string(id) + " was deregistered";
      throw Error(StatusCode::ERR_NOT_FOUND, msg);
    }
    const auto& rails = shared_->rails;
    std::vector<bool> used(rails.size(), false);
    for (auto& q : qps_) used[q->rail()] = true;
    ByteWriter w;
    w.Put<uint64_t>(use->desc.data);
    w.Put<uint64_t>(use->desc.size);
    w.Put<uint32_t>(static_cast<uint32_t>(rails.size()));
    for (size_t i = 0; i < rails.size(); ++i) w.Put<uint32_t>(used[i] ? shared_->mrs.Get(i, use->desc)->rkey : 0);
    return std::move(w.bytes());
  }

  std::shared_ptr<RdmaShared> shared_;
  const EngineDesc peer_;
  std::vector<std::unique_ptr<RecvQp>> qps_;
};

}  // namespace

void ServeRdmaConnection(const std::shared_ptr<RdmaShared>& shared, const EngineDesc& peer, int fd) {
  TargetConnection conn(shared, peer);
  for (;;) {
    Frame req;
    IoResult r = ReadFrame(fd, &req, -1, kFrameTimeoutMs);
    if (!r.ok) return;  // closed (initiator gone or shutdown): QPs go with `conn`
    if (req.type != FrameType::BackendRequest) {
      MORI_LOG(Warning, "RDMA connection from '" << peer.key << "': unexpected frame type "
                                                 << static_cast<int>(req.type) << "; closing");
      return;
    }
    Frame reply;
    try {
      reply.payload = conn.Handle(req.payload);
      reply.type = FrameType::BackendReply;
    } catch (const Error& e) {
      reply.type = FrameType::Error;
      reply.payload = EncodeErrorPayload(e.code(), e.what());
    }
    if (!WriteFrame(fd, reply.type, reply.payload, kFrameTimeoutMs).ok) return;
  }
}

}  // namespace rdma
}  // namespace mori_torch
