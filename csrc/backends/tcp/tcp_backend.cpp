#include "backends/tcp/tcp_backend.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <thread>

#include "backends/tcp/tcp_inline.h"
#include "backends/tcp/tcp_staged_io.h"
#include "core/logging.h"
#include "core/thread_name.h"

namespace mori_torch {
namespace tcp {

bool TcpBackend::CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc&) const {
  // GPU memory goes through pinned staging buffers on whichever side holds it.
  auto movable = [](const MemoryDesc& m) {
    return m.loc == MemoryLocationType::CPU || m.loc == MemoryLocationType::GPU;
  };
  return movable(local) && movable(remote);
}

std::shared_ptr<BackendPeer> TcpBackend::Peer(const EngineDesc& remote) {
  return peers_.GetOrCreate(remote.key, [&] {
    auto p = std::make_shared<TcpPeer>(*ctx_.self, ctx_.secret, remote, cfg_, staging_, workers_);
    if (shut_.load()) p->Close("TCP backend was removed");
    return p;
  });
}

void TcpBackend::RemovePeer(const std::string& key, const std::string& reason) {
  if (auto p = peers_.Take(key)) p->Close(reason);
}

TcpBackend::TcpBackend(const TcpConfig& cfg, const BackendContext& ctx)
    : cfg_(cfg),
      ctx_(ctx),
      staging_(std::make_shared<gpu::StagingPool>(static_cast<uint64_t>(cfg.staging_chunk_bytes),
                                                  static_cast<int>(cfg.staging_depth),
                                                  static_cast<size_t>(2 * cfg.num_data_conns))) {
  int threads = static_cast<int>(cfg.serve_threads);
  if (threads == 0) threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 4, 16);
  serve_pool_ = std::make_unique<WorkerPool>("TCP target", "mori-tcp-serve", threads);
  workers_.loop = ctx.loop;
  workers_.senders = std::make_shared<WorkerPool>("TCP send", "mori-tcp-send", threads);
  workers_.receivers = std::make_shared<WorkerPool>("TCP receive", "mori-tcp-recv", threads);
}

void TcpBackend::Shutdown() {
  if (shut_.exchange(true)) return;
  for (auto& p : peers_.TakeAll()) p->Close("TCP backend was removed or its engine shut down");
  std::unordered_map<int, InboundPtr> inbound;
  {
    std::lock_guard<std::mutex> lk(inbound_mu_);
    inbound.swap(inbound_);
  }
  for (auto& kv : inbound) {
    if (ctx_.loop) ctx_.loop->Remove(kv.first);
    kv.second->conn.sock.Shutdown();  // ends a worker's blocking I/O on it at once
  }
  serve_pool_->Stop();
  // Peers are closed: their connections are broken, and any job still
  // running ends at once on its shut-down socket.
  workers_.senders->Stop();
  workers_.receivers->Stop();
  for (auto& kv : inbound) staging_->Give(std::move(kv.second->staging));
  staging_->Close();
}

bool TcpBackend::AdoptData(const EngineDesc& peer, InboundConnection& conn) {
  if (!ctx_.loop) return false;
  auto in = std::make_shared<Inbound>();
  in->peer = peer;
  in->conn = std::move(conn);
  const int fd = in->conn.sock.fd();
  SetNoDelay(fd, cfg_.enable_ctrl_nodelay);
  SetBufferSizes(fd, static_cast<int>(cfg_.sock_sndbuf_bytes), static_cast<int>(cfg_.sock_rcvbuf_bytes));
  SetKeepalive(fd, cfg_.enable_keepalive, static_cast<int>(cfg_.keepalive_idle_sec),
               static_cast<int>(cfg_.keepalive_intvl_sec), static_cast<int>(cfg_.keepalive_cnt));
  in->room.Attach(fd);
  in->reader.Attach(fd);
  {
    std::lock_guard<std::mutex> lk(inbound_mu_);
    if (shut_.load()) return true;  // dropped: the socket closes with `in`
    inbound_[fd] = in;
  }
  try {
    ctx_.loop->Add(fd, EPOLLIN | EPOLLRDHUP, in->conn.idle_timeout_ms,
                   [this, in](uint32_t ev) { OnInboundEvent(in, ev); });
  } catch (const Error& e) {
    MORI_LOG(Warning, "TCP data connection from '" << peer.key << "': " << e.what() << "; closing");
    std::lock_guard<std::mutex> lk(inbound_mu_);
    inbound_.erase(fd);
  }
  return true;
}

void TcpBackend::OnInboundEvent(const InboundPtr& in, uint32_t events) {
  if (events == EventLoop::kIdle) {
    MORI_LOG(Info, "TCP data connection from '" << in->peer.key << "' idle; closing");
    return DropInbound(in);
  }
  const int fd = in->conn.sock.fd();
  in->reader.NewEvent();
  for (int n = 0; n < kInlineMaxPerEvent && ReadyInline(*in); ++n) {
    if (shut_.load() || !ServeRequest(*in)) return DropInbound(in);
  }
  // Nothing more now: wait for it (re-arming reports bytes that came in between).
  if (!in->reader.MoreNow()) return ctx_.loop->Rearm(fd, EPOLLIN | EPOLLRDHUP);
  if (!serve_pool_->Post([this, in] { ServeReady(in); })) DropInbound(in);
}

bool TcpBackend::ReadyInline(Inbound& in) const {
  RequestHeader h;
  // Anything unusual (a malformed header, a retry that may wait for its
  // earlier attempt, GPU memory) is the workers' to handle.
  if (cfg_.inline_max_bytes == 0 || !in.reader.Ready(sizeof(h))) return false;
  std::memcpy(&h, in.reader.data(), sizeof(h));
  if (h.magic != kRequestMagic || h.attempt != 0 || h.num_segs > kInlineMaxSegments ||
      h.total_bytes > static_cast<uint64_t>(cfg_.inline_max_bytes)) {
    return false;
  }
  const auto op = static_cast<Op>(h.op);
  if (op != Op::Write && op != Op::Read && op != Op::Notice) return false;
  if (!in.reader.Ready(RequestWireBytes(op, h.num_segs, h.total_bytes))) return false;
  if (op == Op::Notice) return true;  // no response, no memory
  const uint64_t response = kWireAlign + kMaxMessageBytes + (op == Op::Read ? WireRound(h.total_bytes) : 0);
  if (!in.room.Fits(response)) return false;
  auto m = ctx_.memory->Find(h.mem_id);  // where it lives; ServeRequest checks the rest
  return m && m->desc.loc == MemoryLocationType::CPU;
}

void TcpBackend::ServeReady(const InboundPtr& in) {
  const int fd = in->conn.sock.fd();
  // Requests back to back while they keep coming (a batch of stripes, a
  // pipeline of small transfers); the loop takes over when the socket is idle.
  do {
    if (shut_.load() || !ServeRequest(*in)) return DropInbound(in);
  } while (in->reader.MoreNow());
  ctx_.loop->Rearm(fd, EPOLLIN | EPOLLRDHUP);
}

void TcpBackend::DropInbound(const InboundPtr& in) {
  const int fd = in->conn.sock.fd();
  {
    std::lock_guard<std::mutex> lk(inbound_mu_);
    auto it = inbound_.find(fd);
    if (it == inbound_.end() || it->second != in) return;  // Shutdown() took it
    inbound_.erase(it);
  }
  ctx_.loop->Remove(fd);
  in->conn.sock.Shutdown();
  staging_->Give(std::move(in->staging));
}

bool TcpBackend::ServeRequest(Inbound& in) {
  const EngineDesc& peer = in.peer;
  const int fd = in.conn.sock.fd();
  std::unique_ptr<gpu::StagingSet>* staging = &in.staging;
  const IoDeadline deadline{DeadlineAfterMs(cfg_.op_timeout_ms), cfg_.inactivity_timeout_ms};
  RequestHeader h;
  IoResult r = in.reader.ReadFull(&h, sizeof(h), deadline);
  if (!r.ok) {
    if (r.error != "peer closed the connection") {
      MORI_LOG(Warning, "TCP data connection from '" << peer.key << "': " << r.error);
    }
    return false;
  }
  if (h.magic != kRequestMagic || h.op < 1 || h.op > 3 || h.num_segs > kMaxSegmentsPerRequest) {
    MORI_LOG(Warning, "TCP data connection from '" << peer.key << "': malformed request header (op "
                                                   << static_cast<int>(h.op) << ", " << h.num_segs
                                                   << " segments); closing");
    return false;
  }
  // The table and its padding, in one read (the padding is whole WireSegments).
  static_assert(sizeof(RequestHeader) % sizeof(WireSegment) == 0 && kWireAlign % sizeof(WireSegment) == 0,
                "table layout");
  const uint64_t table_bytes = WireRound(sizeof(h) + uint64_t{h.num_segs} * sizeof(WireSegment)) - sizeof(h);
  // Grown as its bytes arrive, never to a claimed size ahead of them.
  constexpr uint64_t kTableChunk = 64 << 10;
  std::vector<WireSegment> table;
  for (uint64_t got = 0; got < table_bytes;) {
    const uint64_t take = std::min(kTableChunk, table_bytes - got);
    table.resize((got + take) / sizeof(WireSegment));
    r = in.reader.ReadFull(reinterpret_cast<char*>(table.data()) + got, take, deadline);
    if (!r.ok) return false;
    got += take;
  }
  table.resize(h.num_segs);
  uint64_t sum = 0;
  for (const auto& s : table) {
    if (s.size > UINT64_MAX - sum) return false;
    sum += s.size;
  }
  if (sum != h.total_bytes) {
    MORI_LOG(Warning, "TCP data connection from '" << peer.key << "': segment sizes do not add up; closing");
    return false;
  }
  const auto op = static_cast<Op>(h.op);
  if (op == Op::Notice) {
    // From the peer this connection authenticated, about its own uid; a
    // notice meant for an earlier process of this engine is dropped.
    if (h.incarnation == ctx_.self->incarnation) {
      ctx_.notices->Arrive(peer.key, h.uid, h.parts_total, static_cast<uint32_t>(h.part_index), h.attempt);
    }
    return true;
  }

  // Only with the memory's token and this process's incarnation; then
  // bounds-check every range against our own registration before touching it.
  StatusCode code = StatusCode::SUCCESS;
  std::string msg;
  MemoryToken token;
  std::memcpy(token.data(), h.token, token.size());
  MemoryUse use(ctx_.memory->FindForPeer(h.mem_id, h.incarnation, token, &msg));
  if (!use) {
    code = StatusCode::ERR_NOT_FOUND;
    if (msg.empty()) msg = "memory " + std::to_string(h.mem_id) + " was deregistered";
  } else {
    for (size_t i = 0; i < table.size(); ++i) {
      std::string e = CheckRange(use->desc, table[i].offset, table[i].size, "remote");
      if (!e.empty()) {
        code = StatusCode::ERR_INVALID_ARGS;
        msg = "rejected by target: " + e;
        break;
      }
    }
  }
  const bool gpu_mem = code == StatusCode::SUCCESS && OnGpu(use->desc);
  if (gpu_mem && !*staging) {
    try {
      *staging = staging_->Take(use->desc.device_id);
    } catch (const Error& e) {
      code = StatusCode::ERR_GPU_OP;
      msg = std::string("rejected by target: no TCP staging buffers for its GPU memory: ") + e.what();
    }
  }
  std::vector<Segment> segs;
  if (code == StatusCode::SUCCESS) {
    segs.reserve(table.size());
    for (const auto& s : table) segs.push_back({0, s.offset, s.size});
  }
  const DeviceBytes device_bytes{gpu_mem ? use->desc.data : 0, gpu_mem ? use->desc.device_id : -1, &segs,
                                 /*local_side=*/false, /*fenced=*/true};
  std::vector<iovec> iov;
  if (op == Op::Write) {
    // A retry lands only after every earlier attempt of it stopped writing.
    std::optional<AttemptFenceScope> fenced;
    if (code == StatusCode::SUCCESS) {
      fenced.emplace(&attempts_, peer.key, h.uid, h.attempt, deadline.at);
      if (!fenced->entered()) {
        code = StatusCode::ERR_BAD_STATE;
        msg = "rejected by target: an earlier attempt of transfer " + std::to_string(h.uid) +
              " is still writing (op_timeout_ms=" + std::to_string(cfg_.op_timeout_ms) + ")";
      }
    }
    if (code == StatusCode::SUCCESS && gpu_mem) {
      std::string gpu_error;
      r = RecvStaged(in.reader, **staging, device_bytes, deadline, &gpu_error);
      if (r.ok) r = in.reader.Discard(WirePad(h.total_bytes), deadline);
      if (!gpu_error.empty()) {
        code = StatusCode::ERR_GPU_OP;
        msg = "target could not copy the payload into its GPU memory: " + gpu_error;
      }
    } else if (code == StatusCode::SUCCESS) {
      AppendIovecs(use->Base(), segs, false, &iov);
      char pad[kWireAlign];
      if (uint64_t n = WirePad(h.total_bytes)) iov.push_back({pad, n});
      r = in.reader.ReadVFullFenced(iov, deadline);
    } else {
      r = in.reader.Discard(WireRound(h.total_bytes), deadline);  // keep the stream in step
    }
    use.reset();
    if (!r.ok) return false;
  }
  ResponseHeader rh{kResponseMagic, static_cast<uint16_t>(code), static_cast<uint16_t>(msg.size()), h.req_id, 0};
  // Every byte of the response counts against the send buffer's room.
  auto write_counted = [&](std::vector<iovec>& v) {
    uint64_t n = 0;
    for (const iovec& e : v) n += e.iov_len;
    IoResult w = WriteVFull(fd, v, deadline);
    if (w.ok) in.room.Wrote(n);
    return w;
  };
  iov.clear();
  iov.push_back({&rh, sizeof(rh)});
  if (!msg.empty()) iov.push_back({&msg[0], msg.size()});
  AppendPadding(sizeof(rh) + msg.size(), &iov);
  if (op == Op::Read && code == StatusCode::SUCCESS) {
    rh.payload_bytes = h.total_bytes;
    if (gpu_mem) {
      r = write_counted(iov);
      iov.clear();
      if (r.ok) r = SendStaged(fd, **staging, device_bytes, deadline);
      in.room.Wrote(h.total_bytes);
      if (!r.ok) {
        MORI_LOG(Warning, "TCP read from GPU memory for '" << peer.key << "': " << r.error << "; closing");
        return false;
      }
    } else {
      AppendIovecs(use->Base(), segs, false, &iov);
    }
    AppendPadding(h.total_bytes, &iov);
  }
  r = write_counted(iov);
  use.reset();
  if (!r.ok) return false;
  if (op == Op::Write && code == StatusCode::SUCCESS && (h.flags & kFlagNotify)) {
    ctx_.notices->Arrive(peer.key, h.uid, h.parts_total, static_cast<uint32_t>(h.part_index), h.attempt);
  }
  return true;
}

}  // namespace tcp
}  // namespace mori_torch
