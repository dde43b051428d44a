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
  std::vector<Segment> segs;  // validated against both registrations
  TransferUid uid = 0;
  StatusPtr status;
  // 0 for the first attempt; the retry driver numbers later ones so that
  // targets can fence earlier attempts and count notices once.
  uint16_t attempt = 0;
};

// What a backend may use of its engine. Outlives every backend.
struct BackendContext {
  const EngineDesc* self = nullptr;
  // What this engine proves on the connections it opens ("" for none).
  std::string secret;
  MemoryRegistry* memory = nullptr;
  NotificationTable* notices = nullptr;
  // For backends that map a peer's memory and write it directly (XGMI):
  // asks the owner to tell this engine when `remote` is deregistered (see
  // Backend::RevokeRemoteMemory) and checks that it is still registered as
  // described; throws Error (ERR_NOT_FOUND) when it is not.
  std::function<void(const MemoryDesc& remote)> watch_remote_memory;
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

  // Stream-ordered transfers (DESIGN §5). GPU-peer backends run them as work
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
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual BackendType Type() const = 0;
  virtual bool CanServe(const MemoryDesc& local, const MemoryDesc& remote,
                        const EngineDesc& remote_engine) const = 0;
  // Returns the cached peer for `remote`, creating it on first use.
  virtual std::shared_ptr<BackendPeer> Peer(const EngineDesc& remote) = 0;
  // Drops the peer: its in-flight transfers end with an error whose
  // message carries `reason` (why the engine dropped it).
  virtual void RemovePeer(const std::string& key, const std::string& reason) = 0;
  // Engine `owner_key` deregistered memories `ids` that this backend may
  // have watched (BackendContext::watch_remote_memory): later transfers to
  // them must fail, and by the time this returns nothing this backend
  // started may still touch them. Default: nothing mapped, nothing to do.
  virtual void RevokeRemoteMemory(const std::string& /*owner_key*/, const std::vector<MemoryId>& /*ids*/) {}
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

// Builds a backend of `type`; throws Error naming bad config keys/values or
// an unavailable backend. Defined with the backends (csrc/backends).
std::shared_ptr<Backend> MakeBackend(BackendType type, const BackendConfig& config, const BackendContext& ctx);

// Reads `name` from `config` (default when absent) and checks the range;
// throws Error(ERR_INVALID_ARGS) naming the backend, key and value.
int64_t ConfigValue(const BackendConfig& config, const char* backend, const std::string& name, int64_t def,
                    int64_t min, int64_t max);
// Throws if `config` holds a key not in `known`.
void CheckConfigKeys(const BackendConfig& config, const char* backend, const std::vector<std::string>& known);

}  // namespace mori_torch
