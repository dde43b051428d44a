// The interface every transport implements. The engine validates arguments,
// picks a backend per (local, remote) memory pair by capability and hands it
// ready-checked TransferOps; a backend only moves bytes and ends statuses.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/control_plane.h"
#include "core/descriptors.h"
#include "core/event_loop.h"
#include "core/memory_registry.h"
#include "core/net.h"
#include "core/notification_table.h"
#include "core/segments.h"
#include "core/transfer_status.h"
#include "gpu/stream_ops.h"

namespace mori_torch {

// Backend settings as name -> integer (booleans as 0/1), so that every layer
// passes them through unchanged; each backend validates its own names.
using BackendConfig = std::map<std::string, int64_t>;

struct TransferOp {
  bool is_read = false;
  std::shared_ptr<LocalMemory> local;  // acquired only while bytes move
  MemoryDesc remote;
  SharedSegments segs;  // validated against both registrations; read-only, shared with later attempts
  TransferUid uid = 0;
  StatusPtr status;
  // 0 for the first attempt; the retry driver numbers later ones so that
  // targets can fence earlier attempts and count notices once.
  uint16_t attempt = 0;
};

// The engine-wide part of a backend family, alive as long as its engine
// whether or not the backend exists (MakeEngineServices): it owns the
// control frames it Handles (the engine hands it each one) and may hook the
// memory registry. XGMI's memory-ownership protocol is one.
class EngineService {
 public:
  virtual ~EngineService() = default;
  virtual bool Handles(FrameType type) const = 0;
  // Answers `request` from `peer` (connected from `peer_ip`) in *reply;
  // throws Error to answer with an error frame.
  virtual void HandleControl(const EngineDesc& peer, const std::string& peer_ip, const Frame& request,
                             Frame* reply) = 0;
  // The engine is shutting down, after its memory was cleared: let go of it.
  virtual void Shutdown() = 0;
};

// What a backend may use of its engine. Outlives every backend.
struct BackendContext {
  const EngineDesc* self = nullptr;
  // What this engine proves on the connections it opens ("" for none).
  std::string secret;
  MemoryRegistry* memory = nullptr;
  NotificationTable* notices = nullptr;
  // Sends `type` (MemLookup, or a service's request answered the same way)
  // about `remote` to its owner and checks that the owner still has it
  // registered as described; throws Error (ERR_NOT_FOUND) when it does not.
  std::function<void(const MemoryDesc& remote, FrameType type)> ask_owner;
  // True if `peer` is this engine or a registered remote engine, described
  // exactly as registered.
  std::function<bool(const EngineDesc& peer)> knows_engine;
  int connect_timeout_ms = 5000;  // the engine's, for connections a service opens itself
  // The engine's services (MakeEngineServices); see FindService.
  const std::vector<std::shared_ptr<EngineService>>* services = nullptr;
  // The engine's event loop, for backends that serve their inbound data
  // connections on it (outlives every backend; stopped after them).
  EventLoop* loop = nullptr;
};

// A backend's link to one remote engine, cached by the backend and pinned by
// sessions so repeated transfers skip lookups.
class BackendPeer {
 public:
  virtual ~BackendPeer() = default;
  // Takes ownership of the op and ends op.status exactly once, even if the
  // backend or peer is shut down meanwhile.
  virtual void Submit(TransferOp op) = 0;
  virtual bool Alive() const = 0;

  // Stream-ordered transfers (docs/ARCHITECTURE.md, "Stream-ordered ops").
  // GPU-peer backends run them as work
  // on the caller's stream; host-driven ones return false and are driven by
  // a doorbell (core/stream_doorbell.h) through Submit.
  virtual bool RunsOnStream() const { return false; }
  // Readies LaunchOnStream for this memory pair (maps remote memory, loads
  // kernels); called outside any graph capture.
  virtual void PrepareStream(const LocalMemory& /*local*/, const MemoryDesc& /*remote*/) {}
  // Enqueues the transfer described by `args` (local and segment fields
  // set; the remote ones filled in here) on `stream`; throws Error when it
  // cannot.
  virtual void LaunchOnStream(const LocalMemory& local, const MemoryDesc& remote, gpu::StreamCopyArgs args,
                              gpu::Stream stream);
  // True when the host thread can move `local`'s GPU bytes itself with no
  // GPU call (RDMA on a dma-buf registration): stream-ordered transfers then
  // skip the pinned staging slot. Asked after PrepareStream.
  virtual bool PostsFromDeviceMemory(const LocalMemory& /*local*/) const { return false; }
  // Throws Error when a doorbell-driven transfer with `remote` cannot be
  // ordered on a stream safely (asked by every enqueue, so keep it cheap).
  virtual void CheckStreamWait(const MemoryDesc& /*remote*/) const {}
};

// One transfer of a group handed to its backend at once, with the peer that
// serves it.
struct PeerOp {
  std::shared_ptr<BackendPeer> peer;
  TransferOp op;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendType Type() const = 0;
  virtual bool CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc& remote_engine) const = 0;
  // Returns the cached peer for `remote`, creating it on first use.
  virtual std::shared_ptr<BackendPeer> Peer(const EngineDesc& remote) = 0;
  // Several transfers from one call (the engine-level multi-pair batch), each
  // on a peer of this backend. A backend may coalesce them (XGMI: one segment
  // list and one kernel for the pairs on one GPU); by default each goes to
  // its peer's Submit, in order. Every op's status ends, as with Submit.
  virtual void SubmitGroup(std::vector<PeerOp> ops);
  // Drops the peer: its in-flight transfers end with an error whose
  // message carries `reason` (why the engine dropped it).
  virtual void RemovePeer(const std::string& key, const std::string& reason) = 0;
  // Peers' memories this backend holds mapped now (tests, leak checks).
  virtual size_t MappedRemoteMemories() { return 0; }
  // Serves an inbound data connection until it ends; default refuses.
  virtual bool AcceptsDataConnections() const { return false; }
  // Takes an inbound data connection to serve on the event loop (and its
  // own bounded workers); false: serve it with the blocking ServeData on a
  // thread of the connection's own.
  virtual bool AdoptData(const EngineDesc& /*peer*/, InboundConnection& /*conn*/) { return false; }
  virtual void ServeData(const EngineDesc& /*peer*/, Socket& /*sock*/) {}
  // The longest one attempt of a transfer may take here (its op timeout);
  // retries of a transfer never go beyond it. -1: no bound of its own.
  virtual int64_t OpTimeoutMs() const { return -1; }
  // Ends everything in flight with an error and releases all resources.
  // After it, Submit on any of its peers fails at once. Idempotent.
  virtual void Shutdown() = 0;
};

// Before `op` is submitted: counts it on `counters` (null: not counted) until
// its status ends (retries included), inside a profiler range named after
// its direction.
void AttachRecord(TransferOp& op, const std::shared_ptr<TransferCounters>& counters);

// Builds a backend of `type`; throws Error naming bad config keys/values or
// an unavailable backend. Defined with the backends (csrc/backends).
std::shared_ptr<Backend> MakeBackend(BackendType type, const BackendConfig& config, const BackendContext& ctx);
// The engine services of every backend family, for a new engine (ctx as the
// backends get it). Defined with the backends.
std::vector<std::shared_ptr<EngineService>> MakeEngineServices(const BackendContext& ctx);

// The engine's service of type T, or nullptr.
template <typename T>
std::shared_ptr<T> FindService(const BackendContext& ctx) {
  if (ctx.services == nullptr) return nullptr;
  for (const auto& s : *ctx.services) {
    if (auto t = std::dynamic_pointer_cast<T>(s)) return t;
  }
  return nullptr;
}

}  // namespace mori_torch
