#include "backends/tcp/tcp_backend.h"

#include <sys/socket.h>

#include <cstring>

#include "backends/tcp/tcp_staged_io.h"
#include "core/logging.h"

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
    auto p = std::make_shared<TcpPeer>(*ctx_.self, ctx_.secret, remote, cfg_, staging_);
    if (shut_.load()) p->Close("TCP backend was removed");
    return p;
  });
}

void TcpBackend::RemovePeer(const std::string& key, const std::string& reason) {
  if (auto p = peers_.Take(key)) p->Close(reason);
}

void TcpBackend::Shutdown() {
  if (shut_.exchange(true)) return;
  for (auto& p : peers_.TakeAll()) p->Close("TCP backend was removed or its engine shut down");
  {
    std::lock_guard<std::mutex> lk(inbound_mu_);
    for (int fd : inbound_fds_) ::shutdown(fd, SHUT_RDWR);
  }
  staging_->Close();
}

void TcpBackend::ServeData(const EngineDesc& peer, Socket& sock) {
  const int fd = sock.fd();
  {
    std::lock_guard<std::mutex> lk(inbound_mu_);
    if (shut_.load()) return;
    inbound_fds_.insert(fd);
  }
  SetNoDelay(fd, true);
  SetBufferSizes(fd, static_cast<int>(cfg_.sock_sndbuf_bytes), static_cast<int>(cfg_.sock_rcvbuf_bytes));
  SetKeepalive(fd, cfg_.enable_keepalive, static_cast<int>(cfg_.keepalive_idle_sec),
               static_cast<int>(cfg_.keepalive_intvl_sec), static_cast<int>(cfg_.keepalive_cnt));
  std::unique_ptr<gpu::StagingSet> staging;  // for GPU memory, taken on first use
  while (!shut_.load() && ServeRequest(peer, fd, &staging)) {
  }
  staging_->Give(std::move(staging));
  std::lock_guard<std::mutex> lk(inbound_mu_);
  inbound_fds_.erase(fd);
}

bool TcpBackend::ServeRequest(const EngineDesc& peer, int fd, std::unique_ptr<gpu::StagingSet>* staging) {
  if (!WaitReadable(fd, -1)) return false;
  const Deadline deadline = DeadlineAfterMs(cfg_.op_timeout_ms);
  RequestHeader h;
  IoResult r = ReadFull(fd, &h, sizeof(h), deadline);
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
  std::vector<WireSegment> table(table_bytes / sizeof(WireSegment));
  r = ReadFull(fd, table.data(), table_bytes, deadline);
  if (!r.ok) return false;
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
    if (h.incarnation == ctx_.self->incarnation) ctx_.notices->Arrive(peer.key, h.uid, h.parts_total);
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
    if (code == StatusCode::SUCCESS && gpu_mem) {
      std::string gpu_error;
      r = RecvStaged(fd, **staging, device_bytes, deadline, &gpu_error);
      if (r.ok) r = Discard(fd, WirePad(h.total_bytes), deadline);
      if (!gpu_error.empty()) {
        code = StatusCode::ERR_GPU_OP;
        msg = "target could not copy the payload into its GPU memory: " + gpu_error;
      }
    } else if (code == StatusCode::SUCCESS) {
      AppendIovecs(use->Base(), segs, false, &iov);
      char pad[kWireAlign];
      if (uint64_t n = WirePad(h.total_bytes)) iov.push_back({pad, n});
      r = ReadVFullFenced(fd, iov, deadline);
    } else {
      r = Discard(fd, WireRound(h.total_bytes), deadline);  // keep the stream in step
    }
    use.reset();
    if (!r.ok) return false;
  }
  ResponseHeader rh{kResponseMagic, static_cast<uint16_t>(code), static_cast<uint16_t>(msg.size()), h.req_id, 0};
  iov.clear();
  iov.push_back({&rh, sizeof(rh)});
  if (!msg.empty()) iov.push_back({&msg[0], msg.size()});
  AppendPadding(sizeof(rh) + msg.size(), &iov);
  if (op == Op::Read && code == StatusCode::SUCCESS) {
    rh.payload_bytes = h.total_bytes;
    if (gpu_mem) {
      r = WriteVFull(fd, iov, deadline);
      iov.clear();
      if (r.ok) r = SendStaged(fd, **staging, device_bytes, deadline);
      if (!r.ok) {
        MORI_LOG(Warning, "TCP read from GPU memory for '" << peer.key << "': " << r.error << "; closing");
        return false;
      }
    } else {
      AppendIovecs(use->Base(), segs, false, &iov);
    }
    AppendPadding(h.total_bytes, &iov);
  }
  r = WriteVFull(fd, iov, deadline);
  use.reset();
  if (!r.ok) return false;
  if (op == Op::Write && code == StatusCode::SUCCESS && (h.flags & kFlagNotify)) {
    ctx_.notices->Arrive(peer.key, h.uid, h.parts_total);
  }
  return true;
}

}  // namespace tcp
}  // namespace mori_torch
