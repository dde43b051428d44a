// The transfer engine: owns the control-plane listener, the local memory
// registry, the inbound notice table and its backends. Transfer calls
// validate their arguments here, once for every backend, and return a
// status at once; errors are statuses, never exceptions.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "core/control_plane.h"
#include "core/local_engines.h"
#include "core/retry_driver.h"
#include "core/session.h"

namespace mori_torch {

struct EngineConfig {
  std::string host;  // "" listens on 127.0.0.1 only
  int port = 0;      // 0 binds a free port
  ControlPlaneOptions control;
  int connect_timeout_ms = 5000;
  // Shared secret every peer must prove (peer_auth.h); "" takes
  // MORI_TORCH_SECRET, and without either the engine serves anyone.
  std::string secret;
  // Event-loop threads that wait on every socket the engine serves.
  int loop_threads = 1;
  // Transfers whose path breaks are retried (core/retry_driver.h), and a
  // failed backend hands a peer's transfers to the next capable one
  // (core/failover.h). retry.enabled = failover.enabled = false: a broken
  // path fails its transfers, as without either.
  RetryPolicy retry;
  FailoverPolicy failover;
};

// What retry and failover did so far (Engine::FailoverCounters).
struct FailoverCounters {
  RetryStats retry;
  FailoverStats failover;
};

class Engine : public ControlPlaneDelegate {
 public:
  Engine(const std::string& key, const EngineConfig& cfg);
  ~Engine() override;
  // Ends in-flight transfers with an error, stops threads. Idempotent.
  void Shutdown();

  const EngineDesc& Desc() const { return desc_; }

  // Duplicate creation logs a warning and keeps the existing backend.
  void CreateBackend(BackendType type, const BackendConfig& config);
  void RemoveBackend(BackendType type);
  bool HasBackend(BackendType type) const;

  void RegisterRemoteEngine(const EngineDesc& desc);
  // Ends the remote engine's in-flight transfers with ERR_BAD_STATE; their
  // message names `reason` when given (e.g. "peer left: ..." from a
  // rendezvous directory that saw the peer's entry vanish).
  void DeregisterRemoteEngine(const EngineDesc& desc, const std::string& reason = {});

  MemoryDesc RegisterMemory(uint64_t ptr, int64_t size, int device_id, MemoryLocationType loc);
  void DeregisterMemory(const MemoryDesc& desc);
  // Asks the owning engine (over the control plane) whether `desc` is
  // still registered there and matches; throws Error otherwise.
  void ValidateRemoteMemory(const MemoryDesc& desc);

  TransferUid AllocateTransferUid() { return next_uid_->fetch_add(1, std::memory_order_relaxed); }

  StatusPtr Read(const MemoryDesc& local, int64_t local_offset, const MemoryDesc& remote, int64_t remote_offset,
                 int64_t size, TransferUid uid);
  StatusPtr Write(const MemoryDesc& local, int64_t local_offset, const MemoryDesc& remote, int64_t remote_offset,
                  int64_t size, TransferUid uid);
  // N memory pairs -> N statuses, every one of which ends. The spans are
  // read during the call only (the caller's tensors, uncopied).
  std::vector<StatusPtr> BatchTransfer(bool is_read, const std::vector<MemoryDesc>& locals,
                                       const std::vector<Int64Span>& local_offsets,
                                       const std::vector<MemoryDesc>& remotes,
                                       const std::vector<Int64Span>& remote_offsets,
                                       const std::vector<Int64Span>& sizes, const std::vector<int64_t>& uids);
  // The same with the descriptors by address (the caller's objects, read
  // during the call only): bindings that hold them need not copy each one.
  std::vector<StatusPtr> BatchTransfer(bool is_read, const std::vector<const MemoryDesc*>& locals,
                                       const std::vector<Int64Span>& local_offsets,
                                       const std::vector<const MemoryDesc*>& remotes,
                                       const std::vector<Int64Span>& remote_offsets,
                                       const std::vector<Int64Span>& sizes, const std::vector<int64_t>& uids);

  // nullptr when no backend can serve the pair; throws Error for bad
  // descriptors.
  std::shared_ptr<Session> CreateSession(const MemoryDesc& local, const MemoryDesc& remote);

  bool PopInboundTransferStatus(const std::string& initiator_key, TransferUid uid);
  // Peers' memories mapped into this process by this engine's backends.
  size_t MappedRemoteMemories() const;
  // Inbound connections open now, and those refused by a cap or for want of
  // file descriptors since the engine started.
  int InboundConnections() const { return server_->OpenConnections(); }
  uint64_t RefusedConnections() const { return server_->RefusedConnections(); }
  // Completion notices dropped because their table was full.
  uint64_t DroppedNotices() const { return notices_.Dropped(); }
  // This engine's transfer counters as JSON (TransferStats::ToJson).
  std::string StatsJson() const { return stats_.ToJson(desc_.key); }
  // nullptr entries are skipped. See docs/MORI_IO_API.md for the timeout rules.
  static StatusCode WaitAll(const std::vector<StatusPtr>& statuses, int64_t timeout_ms);
  FailoverCounters Failover() const { return {driver_->Stats(), driver_->health().Stats()}; }

  // ControlPlaneDelegate
  const EngineDesc& SelfDesc() const override { return desc_; }
  bool HandleControl(const EngineDesc& peer, const std::string& peer_ip, const Frame& request, Frame* reply) override;
  std::string CanServeData(uint8_t backend) override;
  bool AdoptData(uint8_t backend, const EngineDesc& peer, InboundConnection& conn) override;
  void ServeData(uint8_t backend, const EngineDesc& peer, Socket& sock) override;

 private:
  struct Route {
    std::shared_ptr<LocalMemory> local;
    TransferPath path;
  };
  // A registered remote engine and its counters (kept here so that a
  // transfer finds them in the lookup it does anyway).
  struct Remote {
    EngineDesc desc;
    std::shared_ptr<TransferStats::PeerCounters> counters;
  };
  // Resolves local memory, remote engine and backend; SUCCESS or an error
  // code with *msg.
  StatusCode Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, std::string* msg);
  // The backend for the pair: the first capable one in preference order
  // whose path to the remote engine is healthy (failover.h), else the first
  // capable one. The retry driver's router.
  StatusCode PickPath(const MemoryDesc& local, const MemoryDesc& remote, TransferPath* path, std::string* msg);
  StatusPtr Submit(bool is_read, const MemoryDesc& local, const MemoryDesc& remote, Int64Span local_offsets,
                   Int64Span remote_offsets, Int64Span sizes, TransferUid uid);
  // Checks and routes one transfer: its status, ended already when the
  // arguments or the route are bad (then *op is left empty); else *op and
  // *path are ready for the retry driver.
  StatusPtr Prepare(bool is_read, const MemoryDesc& local, const MemoryDesc& remote, Int64Span local_offsets,
                    Int64Span remote_offsets, Int64Span sizes, TransferUid uid, TransferOp* op, TransferPath* path);
  std::shared_ptr<Backend> BackendOf(BackendType type) const;
  // Calls fn for each backend that exists, fastest first (no lock held).
  void ForEachBackend(const std::function<void(Backend&)>& fn) const;
  std::shared_ptr<ControlClient> ClientFor(const std::string& engine_key);
  // `type` (MemLookup, or a service's request answered the same way) about
  // `desc` to its owner; throws unless the owner still has it registered as
  // described (BackendContext::ask_owner).
  void LookupRemoteMemory(const MemoryDesc& desc, FrameType type);
  // BackendContext::knows_engine.
  bool KnowsEngine(const EngineDesc& peer) const;

  // Throws ERR_BAD_STATE naming `what` once the engine is shut down.
  void CheckAlive(const char* what) const;

  EngineDesc desc_;
  // Set once desc_ has its incarnation: other engines of this process can
  // tell this one is here (core/local_engines.h).
  std::unique_ptr<LocalEngineMark> local_mark_;
  EngineConfig cfg_;
  // First, so that it outlives everything that watches sockets on it.
  std::unique_ptr<EventLoop> loop_;
  TransferStats stats_;
  std::shared_ptr<TransferStats::PeerCounters> self_counters_;  // transfers within this engine
  MemoryRegistry memory_;
  NotificationTable notices_;
  BackendContext ctx_;
  // After memory_ and ctx_, which they use; before server_, which feeds them.
  std::vector<std::shared_ptr<EngineService>> services_;
  std::shared_ptr<std::atomic<uint64_t>> next_uid_;

  mutable std::shared_mutex backends_mu_;
  std::array<std::shared_ptr<Backend>, 4> backends_;  // indexed by BackendType

  mutable std::shared_mutex remotes_mu_;
  std::unordered_map<std::string, Remote> remotes_;
  std::unordered_map<std::string, std::shared_ptr<ControlClient>> control_clients_;

  std::unique_ptr<ControlPlaneServer> server_;
  std::shared_ptr<RetryDriver> driver_;
  std::atomic<bool> shut_down_{false};
};

}  // namespace mori_torch
