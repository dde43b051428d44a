#include "backends/tcp/tcp_backend.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>

#include "backends/tcp/tcp_notices.h"
#include "core/control_plane.h"
#include "core/local_engines.h"
#include "core/logging.h"

namespace mori_torch {
namespace tcp {

TcpPeer::TcpPeer(const EngineDesc& self, std::string secret, EngineDesc remote, const TcpConfig& cfg,
                 std::shared_ptr<gpu::StagingPool> staging, DataConnWorkers workers)
    : self_(self),
      secret_(std::move(secret)),
      remote_(std::move(remote)),
      cfg_(cfg),
      staging_(std::move(staging)),
      workers_(std::move(workers)),
      conns_(static_cast<size_t>(cfg.num_data_conns)) {
  const int64_t delay_us = NoticeDelayUs(cfg, *workers_.loop);
  if (!cfg.enable_notification || delay_us == 0) return;
  try {
    // `this` outlives the courier's use of it: Close (first in ~TcpPeer)
    // stops the courier's timer, the only caller of pick, before anything goes.
    courier_ = NoticeCourier::Make(workers_.loop, delay_us, cfg.op_timeout_ms, [this] { return ConnForNotices(); });
  } catch (const std::exception& e) {  // no timerfd: each notice goes out at once, as with notice_delay_us=0
    MORI_LOG(Warning, "TCP peer '" << remote_.key << "': read notices are sent at once: " << e.what());
  }
}

TcpPeer::~TcpPeer() { Close("peer removed"); }

// The target stages GPU memory through its own GPU streams. When it is an
// engine of this process, those copies run in the same GPU context as the
// stream that waits for them, behind a wait CUDA cannot see (the doorbell's
// flag): the context's shared hardware queues can put the copies behind the
// wait, and neither ever finishes (measured on H200 with the target in this
// process: stalls until the inactivity timeout, every time with
// CUDA_DEVICE_MAX_CONNECTIONS=1). So such a pair is refused; a
// target in another process (as prefill and decode are deployed) has its own
// context and is fine. Asked when an op is enqueued on a stream: host-side
// (CPU tensor) ops and plain engine calls wait on the host and are fine.
void TcpPeer::CheckStreamWait(const MemoryDesc& remote) const {
  if (remote.loc == MemoryLocationType::GPU && InThisProcess(remote_)) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "stream-ordered TCP transfers of GPU memory served by an engine of this same process ('" + remote_.key +
                    "', memory " + std::to_string(remote.id) +
                    ") are refused: that engine's staging copies would queue on this process's GPU behind the "
                    "stream's wait for them and could deadlock; serve the memory from another process, or use XGMI");
  }
}

void TcpPeer::Close(const std::string& reason) {
  std::vector<PartPtr> notices;
  std::shared_ptr<DataConn> carrier;
  std::vector<std::shared_ptr<DataConn>> conns;
  {
    // A second Close waits here until the first has taken the notices and
    // the connections: else it could break the connection the first picked
    // for them, and they would be lost. Nothing here calls back into Close.
    std::lock_guard<std::mutex> ck(close_mu_);
    if (closed_.load()) return;
    // Before the peer closes (a flush under way still finds a connection, and
    // one may be opened for the waiting notices): from here no notice waits.
    if (courier_) notices = courier_->Close();
    if (!notices.empty()) carrier = ConnForNotices();
    std::lock_guard<std::mutex> lk(mu_);
    closed_.store(true);
    close_reason_ = reason;
    conns.swap(conns_);
  }
  SendBeforeClosing(std::move(notices), carrier, conns);
  for (auto& c : conns) {
    if (c) c->Break(reason);
  }
  conns.clear();
}

void TcpPeer::SendBeforeClosing(std::vector<PartPtr> notices, const std::shared_ptr<DataConn>& carrier,
                                const std::vector<std::shared_ptr<DataConn>>& conns) {
  // Bounded: a large transfer being sent ahead of a notice must not hold a
  // shutdown up.
  constexpr int64_t kDrainMs = 200;
  if (carrier) carrier->EnqueueNotices(std::move(notices));
  // Every connection: notices queued there (by requests, the courier, or a
  // read that ended just now) are written before it breaks. A reset (a
  // transfer still in flight) may still drop what the kernel has not sent.
  const Deadline until = DeadlineAfterMs(kDrainMs);
  for (auto& c : conns) {
    if (!c) continue;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    c->DrainNotices(std::max<int64_t>(left, 0));
  }
}

std::shared_ptr<DataConn> TcpPeer::ConnForNotices() {
  size_t start;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_.load() || conns_.empty()) return nullptr;
    const size_t n = conns_.size();
    start = next_conn_.fetch_add(1, std::memory_order_relaxed) % n;
    for (size_t k = 0; k < n; ++k) {
      const auto& c = conns_[(start + k) % n];
      if (c && c->Ready()) return c;
    }
    for (size_t k = 0; k < n; ++k) {  // none open: one still connecting will do
      const auto& c = conns_[(start + k) % n];
      if (c && c->Usable()) return c;
    }
  }
  std::string err;
  return Conn(start, &err);  // none at all: open one
}

std::shared_ptr<DataConn> TcpPeer::Conn(size_t i, std::string* err) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_.load()) {
    *err = "TCP peer '" + remote_.key + "' is closed: " + close_reason_;
    return nullptr;
  }
  auto& c = conns_[i];
  if (c && c->Usable()) return c;
  // Connecting happens in the connection's first send job: a slow or hung
  // peer never blocks the caller's submit. It gives up by op_timeout_ms too:
  // the transfers waiting on it have failed by then anyway, and a peer that
  // accepts but never answers (stopped, hung) must not hold them longer.
  auto connect = [self = self_, remote = remote_, cfg = cfg_, secret = secret_]() {
    const auto timeout_ms = static_cast<int>(std::min(cfg.connect_timeout_ms, cfg.op_timeout_ms));
    Socket s = OpenEngineConnection(self, remote, ConnectionKind::Data, static_cast<uint8_t>(BackendType::TCP),
                                    timeout_ms, secret);
    // Requests are written whole: with NODELAY they never wait for acks.
    SetNoDelay(s.fd(), cfg.enable_ctrl_nodelay);
    SetBufferSizes(s.fd(), static_cast<int>(cfg.sock_sndbuf_bytes), static_cast<int>(cfg.sock_rcvbuf_bytes));
    SetKeepalive(s.fd(), cfg.enable_keepalive, static_cast<int>(cfg.keepalive_idle_sec),
                 static_cast<int>(cfg.keepalive_intvl_sec), static_cast<int>(cfg.keepalive_cnt));
    return s;
  };
  c = std::make_shared<DataConn>(std::move(connect), remote_.key, cfg_, staging_, workers_, courier_);
  return c;
}

void TcpPeer::Submit(TransferOp op) {
  const SegmentSpan segs = op.segs->segs;
  const uint64_t total = op.segs->total_bytes;
  const auto nconns = static_cast<uint64_t>(cfg_.num_data_conns);
  const auto threshold = static_cast<uint64_t>(cfg_.striping_threshold_bytes);
  uint64_t nparts = 1;
  if (total >= threshold && nconns > 1) nparts = std::min<uint64_t>(nconns, (total + threshold - 1) / threshold);
  auto stripes = SplitIntoStripes(segs, total, nparts);
  auto tracker = std::make_shared<TransferTracker>(op.status, static_cast<uint32_t>(stripes.size()));
  const Deadline deadline = DeadlineAfterMs(cfg_.op_timeout_ms);
  const uint64_t first = next_conn_.fetch_add(stripes.size(), std::memory_order_relaxed);
  for (size_t i = 0; i < stripes.size(); ++i) {
    std::string err;
    auto conn = Conn((first + i) % nconns, &err);
    if (!conn) {
      tracker->PartDone(StatusCode::ERR_BAD_STATE, err);
      continue;
    }
    auto p = std::make_shared<Part>();
    p->op = op.is_read ? Op::Read : Op::Write;
    p->notify = cfg_.enable_notification;
    p->local = op.local;
    p->mem_id = op.remote.id;
    p->incarnation = op.remote.incarnation;
    p->token = op.remote.token;
    p->segs = std::move(stripes[i]);
    p->total = TotalBytes(p->segs);
    p->uid = op.uid;
    p->parts_total = static_cast<uint32_t>(stripes.size());
    p->part_index = static_cast<uint32_t>(i);
    p->attempt = op.attempt;
    p->tracker = tracker;
    p->deadline = deadline;
    if (stripes.size() == 1 && conn->CallerMayReceive(*p)) {
      // Polling the status reads the response as soon as it is here.
      std::weak_ptr<DataConn> weak = conn;
      op.status->SetProgressHook(
          [weak] {
            if (auto c = weak.lock()) c->ReceiveForCaller();
          },
          /*polled_only=*/false);
    }
    // Read notices waiting for a ride go with the first stripe.
    conn->Enqueue(std::move(p), i == 0 && courier_ ? courier_->Take() : std::vector<PartPtr>{});
  }
}

}  // namespace tcp
}  // namespace mori_torch
