// BackendType.RDMA over rdma-core verbs (loaded at run time). Each initiator
// engine opens one data connection per target engine (through the engine's
// control plane) to exchange QPs and remote keys and to watch liveness; the
// bytes then move one-sided (RDMA WRITE / READ) on qp_per_transfer RC QPs
// per rail, with completion notices as small SENDs behind the data.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backends/rdma/rdma_completion.h"
#include "backends/rdma/rdma_config.h"
#include "backends/rdma/rdma_device.h"
#include "backends/rdma/rdma_mr_cache.h"
#include "backends/rdma/rdma_send_qp.h"
#include "core/backend.h"
#include "core/peer_cache.h"

namespace mori_torch {
namespace rdma {

// What the backend, its peers and its inbound connections share; it lives
// until the last of them is gone, so no QP outlives its device or worker.
struct RdmaShared {
  RdmaShared(const RdmaConfig& cfg, const BackendContext& ctx, std::vector<std::shared_ptr<RdmaDevice>> rails);
  CompletionWorker* NextWorker() { return workers[next_worker++ % workers.size()].get(); }

  const RdmaConfig cfg;
  const BackendContext ctx;
  std::vector<std::shared_ptr<RdmaDevice>> rails;  // declared first: destroyed last
  std::vector<std::unique_ptr<CompletionWorker>> workers;
  MrCache mrs;
  std::atomic<uint64_t> next_worker{0};
  uint64_t max_msg_bytes = 1u << 30;  // smallest of the rails'
};

// The initiator's link to one target engine.
class RdmaPeer : public BackendPeer {
 public:
  RdmaPeer(std::shared_ptr<RdmaShared> shared, EngineDesc remote);
  ~RdmaPeer() override;
  void Submit(TransferOp op) override;
  bool Alive() const override { return !closed_.load(); }
  // GPU memory registered through dma-buf is posted directly by stream-
  // ordered transfers; anything else goes through the doorbell's staging.
  void PrepareStream(const LocalMemory& local, const MemoryDesc& remote) override;
  bool PostsFromDeviceMemory(const LocalMemory& local) const override;
  // Ends everything in flight with `reason`; later submits fail at once.
  void Close(const std::string& reason);
  // Of the live connection (0 when there is none): how many rails (NICs) its
  // QPs are spread over, and their send-queue depth. For tests and tools.
  size_t ConnectedRails();
  uint32_t ConnectedSqDepth();

 private:
  struct RemoteKeys {
    uint64_t addr = 0;
    uint64_t size = 0;
    std::vector<uint32_t> rkeys;  // by the target's rail
    MemoryToken token{};          // the one the keys were handed out for
  };
  // One connection: socket, QPs, remote keys, liveness watcher.
  struct Conn {
    ~Conn();
    // `path_failed`: the path broke (false: closed on purpose, see SendQp::Break).
    void Break(const std::string& reason, bool path_failed = true);
    std::shared_ptr<RdmaShared> shared;
    Socket sock;
    std::mutex sock_mu;
    std::vector<std::unique_ptr<SendQp>> qps;
    std::vector<uint8_t> remote_rail;  // of each QP's partner
    size_t rails = 0;                  // QP i is on rail i % rails
    std::atomic<bool> broken{false};
    int stop_fd = -1;
    std::thread watcher;
    std::mutex keys_mu;
    std::unordered_map<MemoryId, RemoteKeys> keys;
    std::atomic<uint64_t> next_qp{0};
  };

  // The live connection, made (or remade after a failure) on demand.
  std::shared_ptr<Conn> Connection();
  std::shared_ptr<Conn> Connect();
  RemoteKeys KeysOf(Conn& c, const MemoryDesc& remote);
  void Post(Conn& c, TransferOp& op);

  std::shared_ptr<RdmaShared> shared_;
  const EngineDesc remote_;
  std::atomic<bool> closed_{false};
  std::mutex mu_;  // guards conn_ and close_reason_, serializes connecting
  std::shared_ptr<Conn> conn_;
  std::string close_reason_;
};

class RdmaBackend : public Backend {
 public:
  RdmaBackend(const RdmaConfig& cfg, const BackendContext& ctx);
  ~RdmaBackend() override { Shutdown(); }
  BackendType Type() const override { return BackendType::RDMA; }
  bool CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc& remote_engine) const override;
  std::shared_ptr<BackendPeer> Peer(const EngineDesc& remote) override;
  void RemovePeer(const std::string& key, const std::string& reason) override;
  bool AcceptsDataConnections() const override { return true; }
  void ServeData(const EngineDesc& peer, Socket& sock) override;
  void Shutdown() override;

 private:
  std::shared_ptr<RdmaShared> shared_;
  uint64_t hook_ = 0;
  std::atomic<bool> shut_{false};
  PeerCache<RdmaPeer> peers_;
  std::mutex inbound_mu_;
  std::set<int> inbound_fds_;
};

}  // namespace rdma
}  // namespace mori_torch
