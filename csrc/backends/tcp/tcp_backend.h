// BackendType.TCP: host memory over plain TCP, zero-copy from and into the
// registered buffers; GPU memory through pinned staging buffers, with the
// device copies pipelined against the socket I/O (tcp_staged_io.h). Each peer gets num_data_conns connections (opened
// on first use, reopened after a failure); transfers of at least striping_threshold_bytes are striped across them.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backends/tcp/tcp_config.h"
#include "backends/tcp/tcp_data_conn.h"
#include "core/attempt_fence.h"
#include "core/backend.h"
#include "core/peer_cache.h"

namespace mori_torch {
namespace tcp {

class TcpPeer : public BackendPeer {
 public:
  TcpPeer(const EngineDesc& self, std::string secret, EngineDesc remote, const TcpConfig& cfg,
          std::shared_ptr<gpu::StagingPool> staging, DataConnWorkers workers);
  ~TcpPeer() override;
  void Submit(TransferOp op) override;
  bool Alive() const override { return !closed_.load(); }
  // Refuses stream ordering of GPU memory that an engine of this very
  // process serves (see the definition).
  void CheckStreamWait(const MemoryDesc& remote) const override;
  // Ends everything in flight with `reason`; later submits fail at once.
  void Close(const std::string& reason);

 private:
  // The i-th connection, (re)opened if needed; nullptr with *err on failure.
  std::shared_ptr<DataConn> Conn(size_t i, std::string* err);
  // Where the courier's notices go: an open connection if there is one
  // (the first from the round-robin position), else one still connecting,
  // else one opened now; null once closed.
  std::shared_ptr<DataConn> ConnForNotices();
  // Close: the notices the courier still held go out on `carrier`, and every
  // connection gets a bounded moment to write the notices queued on it.
  void SendBeforeClosing(std::vector<PartPtr> notices, const std::shared_ptr<DataConn>& carrier,
                         const std::vector<std::shared_ptr<DataConn>>& conns);

  const EngineDesc self_;
  const std::string secret_;
  const EngineDesc remote_;
  const TcpConfig cfg_;
  const std::shared_ptr<gpu::StagingPool> staging_;
  const DataConnWorkers workers_;
  std::mutex close_mu_;  // one Close at a time (see Close)
  std::atomic<bool> closed_{false};
  std::string close_reason_;
  std::mutex mu_;
  std::vector<std::shared_ptr<DataConn>> conns_;
  std::atomic<uint64_t> next_conn_{0};
  // Read notices waiting for the next request (tcp_notices.h); null with
  // notice_delay_us 0 or notifications off.
  std::shared_ptr<NoticeCourier> courier_;
};

class TcpBackend : public Backend {
 public:
  TcpBackend(const TcpConfig& cfg, const BackendContext& ctx);
  ~TcpBackend() override { Shutdown(); }
  BackendType Type() const override { return BackendType::TCP; }
  bool CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc& remote_engine) const override;
  std::shared_ptr<BackendPeer> Peer(const EngineDesc& remote) override;
  void RemovePeer(const std::string& key, const std::string& reason) override;
  bool AcceptsDataConnections() const override { return true; }
  bool AdoptData(const EngineDesc& peer, InboundConnection& conn) override;
  void Shutdown() override;
  int64_t OpTimeoutMs() const override { return cfg_.op_timeout_ms; }

 private:
  // The target side of one inbound data connection. The event loop watches
  // it while idle; a worker serves requests while they keep coming, then
  // hands it back to the loop.
  struct Inbound {
    EngineDesc peer;
    InboundConnection conn;
    std::unique_ptr<gpu::StagingSet> staging;  // for GPU memory, taken on first use
    SendRoom room;                             // for inline responses (tcp_inline.h)
    SocketReader reader{kReadAheadBytes};      // every read of the connection goes through it
  };
  using InboundPtr = std::shared_ptr<Inbound>;
  void OnInboundEvent(const InboundPtr& in, uint32_t events);
  // True if the next request can be served on the loop thread without
  // waiting (tcp_inline.h): small, of host memory, a first attempt, all its
  // bytes here, and its response fits the send buffer now.
  bool ReadyInline(Inbound& in) const;
  void ServeReady(const InboundPtr& in);
  void DropInbound(const InboundPtr& in);
  // Target side of one request; false ends the connection.
  bool ServeRequest(Inbound& in);

  const TcpConfig cfg_;
  const BackendContext ctx_;
  // Pinned bounce buffers for GPU memory, shared by all connections.
  const std::shared_ptr<gpu::StagingPool> staging_;
  std::atomic<bool> shut_{false};
  PeerCache<TcpPeer> peers_;
  // Fixed sets of threads for all connections, whatever their number:
  // initiator sends and receives (workers_), target requests (serve_pool_).
  DataConnWorkers workers_;
  std::unique_ptr<WorkerPool> serve_pool_;
  std::mutex inbound_mu_;
  std::unordered_map<int, InboundPtr> inbound_;
  // Retried writes wait here for earlier attempts (attempt_fence.h).
  AttemptFence attempts_;
};

}  // namespace tcp
}  // namespace mori_torch
