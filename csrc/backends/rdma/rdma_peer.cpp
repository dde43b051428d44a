// Initiator side: connection setup, remote keys, and the data path (segments
// merged, split to the message limit, spread over QPs, posted in chains).
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "backends/rdma/rdma_backend.h"
#include "backends/rdma/rdma_protocol.h"
#include "core/byte_io.h"
#include "core/control_plane.h"
#include "core/crypto.h"
#include "core/logging.h"
#include "core/thread_name.h"

namespace mori_torch {
namespace rdma {
namespace {

// Below this many bytes per QP a transfer is not spread further: each extra
// stripe costs a notice and a completion.
constexpr uint64_t kMinStripeBytes = 64 << 10;

// One work request before it is posted.
struct Piece {
  uint64_t local_off;
  uint64_t remote_off;
  uint32_t size;
};

void AppendPieces(SegmentSpan segs, uint64_t max_piece, std::vector<Piece>* out) {
  for (const Segment& s : segs) {
    for (uint64_t done = 0; done < s.size;) {
      const uint64_t n = std::min(max_piece, s.size - done);
      out->push_back({s.local_off + done, s.remote_off + done, static_cast<uint32_t>(n)});
      done += n;
    }
  }
}

bool SortedByRemote(SegmentSpan segs) {
  for (size_t i = 1; i < segs.size(); ++i) {
    if (segs[i].remote_off < segs[i - 1].remote_off) return false;
  }
  return true;
}

}  // namespace

RdmaPeer::RdmaPeer(std::shared_ptr<RdmaShared> shared, EngineDesc remote)
    : shared_(std::move(shared)), remote_(std::move(remote)) {}

RdmaPeer::~RdmaPeer() { Close("peer removed"); }

void RdmaPeer::Close(const std::string& reason) {
  std::shared_ptr<Conn> c;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_.exchange(true)) return;
    close_reason_ = reason;
    c.swap(conn_);
  }
  if (c) c->Break(reason, /*path_failed=*/false);  // on purpose: nothing to retry
  // The QPs flush and fail what is in flight once the last submit using the
  // connection lets go of it (here, unless one is running).
}

RdmaPeer::Conn::~Conn() {
  // A failing completion must not reach Break() while the QPs are torn down.
  broken.store(true);
  if (stop_fd >= 0) {
    uint64_t one = 1;
    (void)!::write(stop_fd, &one, sizeof one);
  }
  if (watcher.joinable()) watcher.join();
  if (stop_fd >= 0) ::close(stop_fd);
  qps.clear();  // flush, drain, fail leftovers, destroy
}

void RdmaPeer::Conn::Break(const std::string& reason, bool path_failed) {
  if (broken.exchange(true)) return;
  for (auto& q : qps) q->Break(reason, path_failed);
  sock.Shutdown();
}

std::shared_ptr<RdmaPeer::Conn> RdmaPeer::Connection() {
  std::shared_ptr<Conn> old;
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_.load()) {
    throw Error(StatusCode::ERR_BAD_STATE, "RDMA peer '" + remote_.key + "' is closed: " + close_reason_);
  }
  if (conn_ && !conn_->broken.load()) return conn_;
  old.swap(conn_);  // a broken connection is replaced: the peer may be back
  conn_ = Connect();
  return conn_;
}

std::shared_ptr<RdmaPeer::Conn> RdmaPeer::Connect() {
  const RdmaConfig& cfg = shared_->cfg;
  auto c = std::make_shared<Conn>();
  c->shared = shared_;
  const std::string where = "RDMA connection to engine '" + remote_.key + "'";
  c->sock =
      OpenEngineConnection(*shared_->ctx.self, remote_, ConnectionKind::Data, static_cast<uint8_t>(BackendType::RDMA),
                           static_cast<int>(cfg.connect_timeout_ms), shared_->ctx.secret);
  const size_t rails = std::min<size_t>(shared_->rails.size(), static_cast<size_t>(cfg.num_nics_per_transfer));
  const size_t nqp = static_cast<size_t>(cfg.qp_per_transfer) * rails;
  // One depth for every QP: the smallest limit of the rails in use.
  int64_t depth_limit = cfg.sq_depth;
  for (size_t i = 0; i < rails; ++i) depth_limit = std::min<int64_t>(depth_limit, shared_->rails[i]->max_qp_wr);
  const auto depth = static_cast<uint32_t>(std::max<int64_t>(2, depth_limit));
  c->rails = rails;
  ByteWriter w;
  w.Put<uint8_t>(static_cast<uint8_t>(RdmaOp::Connect));
  w.Put<uint8_t>(cfg.enable_notification ? 1 : 0);
  w.Put<uint32_t>(static_cast<uint32_t>(std::min<int64_t>(cfg.notif_per_qp, kMaxNoticeBuffersPerQp)));
  w.Put<uint32_t>(static_cast<uint32_t>(nqp));
  for (size_t i = 0; i < nqp; ++i) {
    const size_t rail = i % rails;
    c->qps.push_back(std::make_unique<SendQp>(shared_->rails[rail], rail, shared_->NextWorker(), depth, remote_.key,
                                              cfg.inactivity_timeout_ms));
    c->qps.back()->Info().Put(&w);
    // A failed work request leaves its QP in the error state: drop the whole
    // connection, so the next transfer reconnects with fresh QPs.
    Conn* raw = c.get();
    c->qps.back()->SetOnError([raw](const std::string& why) { raw->Break(why); });
  }
  std::vector<uint8_t> reply = CallBackend(c->sock.fd(), w.bytes(), static_cast<int>(cfg.connect_timeout_ms), where);
  ByteReader r(reply.data(), reply.size(), "RDMA Connect reply");
  if (r.Get<uint32_t>("QP count") != nqp) throw Error(StatusCode::ERR_BAD_STATE, where + ": QP count mismatch");
  for (size_t i = 0; i < nqp; ++i) {
    QpInfo theirs = QpInfo::Get(&r);
    c->qps[i]->Connect(theirs);
    c->remote_rail.push_back(theirs.rail);
  }
  r.ExpectEnd();
  // Liveness: the target closes this socket when its process or backend
  // goes; everything in flight then fails at once instead of at QP timeout.
  c->stop_fd = ::eventfd(0, EFD_CLOEXEC);
  Conn* raw = c.get();
  const std::string key = remote_.key;
  c->watcher = std::thread([raw, key] {
    SetThreadName("mori-rdma-watch");
    pollfd fds[2] = {{raw->sock.fd(), POLLRDHUP, 0}, {raw->stop_fd, POLLIN, 0}};
    while (::poll(fds, 2, -1) < 0 && errno == EINTR) {
    }
    if (!(fds[1].revents & POLLIN)) raw->Break("engine '" + key + "' closed the RDMA connection (process gone?)");
  });
  MORI_LOG(Debug, "RDMA: connected to engine '" << remote_.key << "' with " << nqp << " QPs on " << rails
                                                << " rail(s), send queue depth " << depth);
  return c;
}

size_t RdmaPeer::ConnectedRails() {
  std::lock_guard<std::mutex> lk(mu_);
  return conn_ && !conn_->broken.load() ? conn_->rails : 0;
}

uint32_t RdmaPeer::ConnectedSqDepth() {
  std::lock_guard<std::mutex> lk(mu_);
  return conn_ && !conn_->broken.load() && !conn_->qps.empty() ? conn_->qps[0]->depth() : 0;
}

RdmaPeer::RemoteKeys RdmaPeer::KeysOf(Conn& c, const MemoryDesc& remote) {
  {
    std::lock_guard<std::mutex> lk(c.keys_mu);
    auto it = c.keys.find(remote.id);
    // Keys only for the token they were handed out for; another (forged)
    // descriptor of the same id asks the target, which refuses it.
    if (it != c.keys.end() &&
        crypto::ConstantTimeEqual(it->second.token.data(), remote.token.data(), remote.token.size())) {
      return it->second;
    }
  }
  ByteWriter w;
  w.Put<uint8_t>(static_cast<uint8_t>(RdmaOp::MemKey));
  w.Put<uint64_t>(remote.id);
  w.Put<uint64_t>(remote.incarnation);
  w.PutBytes(remote.token.data(), remote.token.size());
  std::vector<uint8_t> reply;
  {
    std::lock_guard<std::mutex> lk(c.sock_mu);
    reply = CallBackend(c.sock.fd(), w.bytes(), static_cast<int>(shared_->cfg.connect_timeout_ms),
                        "RDMA key request to engine '" + remote_.key + "'");
  }
  ByteReader r(reply.data(), reply.size(), "RDMA MemKey reply");
  RemoteKeys k;
  k.addr = r.Get<uint64_t>("address");
  k.size = r.Get<uint64_t>("size");
  const uint32_t n = r.Get<uint32_t>("rail count");
  if (n > 256) throw Error(StatusCode::ERR_BAD_STATE, "RDMA MemKey reply: " + std::to_string(n) + " rails");
  for (uint32_t i = 0; i < n; ++i) k.rkeys.push_back(r.Get<uint32_t>("rkey"));
  r.ExpectEnd();
  k.token = remote.token;
  for (uint8_t rail : c.remote_rail) {
    if (rail >= k.rkeys.size()) throw Error(StatusCode::ERR_BAD_STATE, "RDMA MemKey reply lacks a rail's key");
  }
  std::lock_guard<std::mutex> lk(c.keys_mu);
  c.keys[remote.id] = k;
  return k;
}

void RdmaPeer::PrepareStream(const LocalMemory& local, const MemoryDesc& /*remote*/) {
  if (local.desc.loc != MemoryLocationType::GPU) return;
  try {
    shared_->mrs.RegisterOnAllRails(local.desc);
  } catch (const Error& e) {
    MORI_LOG(Info,
             "RDMA: stream-ordered transfers of GPU memory " << local.desc.id << " use pinned staging: " << e.what());
  }
}

bool RdmaPeer::PostsFromDeviceMemory(const LocalMemory& local) const {
  return local.desc.loc == MemoryLocationType::GPU && shared_->mrs.DmaBufOnAllRails(local.desc.id);
}

void RdmaPeer::Submit(TransferOp op) {
  try {
    std::shared_ptr<Conn> c = Connection();
    Post(*c, op);
  } catch (const Error& e) {
    // ERR_RDMA_OP: the path could not be set up (QP, memory registration):
    // another backend may serve the transfer. Others are the request's.
    op.status->Update(e.code(), e.what(), e.code() == StatusCode::ERR_RDMA_OP);
  }
}

void RdmaPeer::Post(Conn& c, TransferOp& op) {
  const RdmaConfig& cfg = shared_->cfg;
  auto xfer = std::make_shared<SendTransfer>();
  xfer->local = MemoryUse(op.local);
  xfer->verb = op.is_read ? "RDMA READ" : "RDMA WRITE";
  if (!xfer->local) {
    throw Error(StatusCode::ERR_NOT_FOUND,
                "local memory " + std::to_string(op.local->desc.id) + " was deregistered before the transfer started");
  }
  const MemoryDesc& local = xfer->local->desc;
  const RemoteKeys keys = KeysOf(c, op.remote);
  if (keys.addr != op.remote.data || keys.size != op.remote.size) {
    throw Error(StatusCode::ERR_NOT_FOUND, "remote memory " + std::to_string(op.remote.id) + " of engine '" +
                                               remote_.key + "' no longer matches its descriptor");
  }

  // Segments: sorted by remote offset where they are not (and merged
  // then), cut at the message limit (or the chunk size), spread over the
  // QPs by bytes.
  // Sorted into a copy where needed: the shared list stays as built for
  // later attempts.
  std::vector<Segment> scratch;
  SegmentSpan segs = op.segs->segs;
  if (!SortedByRemote(segs)) {
    scratch.assign(segs.begin(), segs.end());
    std::sort(scratch.begin(), scratch.end(),
              [](const Segment& a, const Segment& b) { return a.remote_off < b.remote_off; });
    MergeContiguousInPlace(&scratch);
    segs = scratch;
  }
  const uint64_t total = op.segs->total_bytes;
  if (total == 0) {
    op.status->Update(StatusCode::SUCCESS);
    return;
  }
  uint64_t max_piece = shared_->max_msg_bytes;
  if (cfg.enable_transfer_chunking) {
    const auto chunks = static_cast<uint64_t>(cfg.max_chunks_per_transfer);
    max_piece = std::min(max_piece, std::max<uint64_t>(cfg.chunk_bytes, (total + chunks - 1) / chunks));
  }
  const size_t nqp = c.qps.size();
  const size_t nstripes = std::max<size_t>(1, std::min<uint64_t>(nqp, total / kMinStripeBytes));
  auto stripes = SplitIntoStripes(segs, total, nstripes);
  const size_t first_qp = c.next_qp.fetch_add(1) % nqp;

  struct Plan {
    SendQp* qp;
    uint32_t lkey;
    uint32_t rkey;
    size_t qp_index;
    std::vector<Piece> pieces;
    size_t per_chain;
    size_t next = 0;
    // With notices: the pieces of the last chain, which carries the notice.
    size_t tail = 0;
  };
  std::vector<Plan> plans;
  uint32_t chains = 0;
  for (size_t s = 0; s < stripes.size(); ++s) {
    const size_t q = (first_qp + s) % nqp;
    Plan p;
    p.qp = c.qps[q].get();
    p.qp_index = q;
    p.lkey = shared_->mrs.Get(p.qp->rail(), local)->lkey;
    p.rkey = keys.rkeys[c.remote_rail[q]];
    AppendPieces(stripes[s], max_piece, &p.pieces);
    // One chain per QP by default (post_batch_size -1); never more than the
    // send queue minus the notice's slot.
    const size_t cap = p.qp->depth() - 1;
    p.per_chain = cfg.post_batch_size > 0 ? static_cast<size_t>(cfg.post_batch_size) : p.pieces.size();
    p.per_chain = std::max<size_t>(1, std::min(p.per_chain, cap));
    const size_t n_chains = (p.pieces.size() + p.per_chain - 1) / p.per_chain;
    chains += static_cast<uint32_t>(n_chains);
    p.tail = p.pieces.size() - p.per_chain * (n_chains - 1);
    plans.push_back(std::move(p));
  }
  xfer->tracker = std::make_shared<TransferTracker>(op.status, chains);
  const bool notify = cfg.enable_notification;
  const auto parts_total = static_cast<uint32_t>(plans.size());
  const uint64_t local_base = local.data;
  const uint64_t remote_base = op.remote.data;

  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;
  std::string failure;  // set once: every chain not yet posted fails with it
  // Builds the chain of p's next `n` pieces (plus the notice if `notice`) in
  // its `slots` reserved slots and posts it; false (slots given back, part
  // failed, `failure` set) if the QP refused it.
  auto post_chain = [&](Plan& p, size_t n, bool notice, uint32_t slots) {
    auto* chain = new Chain;
    chain->xfer = xfer;
    chain->slots = slots;
    const size_t count = n + (notice ? 1 : 0);
    wrs.assign(count, ibv_send_wr{});
    sges.resize(count);
    for (size_t i = 0; i < n; ++i) {
      const Piece& pc = p.pieces[p.next + i];
      sges[i] = {local_base + pc.local_off, pc.size, p.lkey};
      ibv_send_wr& wr = wrs[i];
      wr.sg_list = &sges[i];
      wr.num_sge = 1;
      wr.opcode = op.is_read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      wr.wr.rdma.remote_addr = remote_base + pc.remote_off;
      wr.wr.rdma.rkey = p.rkey;
      wr.next = i + 1 < count ? &wrs[i + 1] : nullptr;
    }
    if (notice) {
      // Behind the data on the same QP; after reads, fenced so it waits
      // until they are done.
      sges[n] = p.qp->Notice(op.uid, parts_total);
      ibv_send_wr& wr = wrs[n];
      wr.sg_list = &sges[n];
      wr.num_sge = 1;
      wr.opcode = IBV_WR_SEND;
      wr.send_flags = op.is_read ? IBV_SEND_FENCE : 0;
    }
    p.next += n;
    std::string why;
    if (p.qp->Post(wrs.data(), chain, &why)) return true;
    p.qp->Unreserve(slots);
    delete chain;
    if (failure.empty()) failure = why;
    xfer->tracker->PartDone(StatusCode::ERR_RDMA_OP, why, p.qp->path_broken());
    return false;
  };

  // Phase 1: every chain without a notice, round-robin over the QPs so all
  // of them work at once. Each wait for send-queue room is bounded on its
  // own: a long transfer that keeps moving never times out, a stuck queue
  // does.
  for (Plan& p : plans) p.tail = notify ? p.tail : 0;
  for (bool more = true; more;) {
    more = false;
    for (Plan& p : plans) {
      const size_t stop = p.pieces.size() - p.tail;
      if (p.next >= stop) continue;
      const size_t n = std::min(p.per_chain, stop - p.next);
      std::string why;
      if (failure.empty() && !p.qp->Reserve(static_cast<uint32_t>(n), DeadlineAfterMs(cfg.sq_full_timeout_ms), &why)) {
        failure = why;
      }
      if (failure.empty()) {
        post_chain(p, n, false, static_cast<uint32_t>(n));
      } else {
        p.next += n;
        xfer->tracker->PartDone(StatusCode::ERR_RDMA_OP, failure, p.qp->path_broken());
      }
      more = more || p.next < stop;
    }
  }
  if (!notify) return;

  // Phase 2: the chains that end with a notice, one per QP used. They are
  // posted only once every one of them has send-queue room, so a transfer
  // that fails for want of room has announced none of its parts (the target
  // never holds a partial notice of it). Room is taken in QP order: two
  // transfers never wait for each other's reservations in a circle.
  std::vector<size_t> order(plans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return plans[a].qp_index < plans[b].qp_index; });
  size_t reserved = 0;
  if (failure.empty()) {
    const Deadline deadline = DeadlineAfterMs(cfg.sq_full_timeout_ms);
    for (; reserved < order.size(); ++reserved) {
      Plan& p = plans[order[reserved]];
      std::string why;
      if (!p.qp->Reserve(static_cast<uint32_t>(p.tail + 1), deadline, &why)) {
        failure = why;
        break;
      }
    }
  }
  size_t posted = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    Plan& p = plans[order[k]];
    const auto slots = static_cast<uint32_t>(p.tail + 1);
    if (!failure.empty()) {
      if (k < reserved) p.qp->Unreserve(slots);
      p.next += p.tail;
      xfer->tracker->PartDone(StatusCode::ERR_RDMA_OP, failure, p.qp->path_broken());
      continue;
    }
    if (post_chain(p, p.tail, true, slots)) {
      ++posted;
    } else if (posted > 0) {
      // Some of its notices are out and the rest never will be: the target
      // drops a connection's partial notices when it closes, so close it
      // (a QP that refuses a post is about to fail the connection anyway).
      c.Break(failure);
    }
  }
}

}  // namespace rdma
}  // namespace mori_torch
