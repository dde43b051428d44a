// XGMI's memory-ownership protocol. A one-sided backend writes straight into
// a peer's memory, so the owner must be able to take that memory back:
//   importer: before it first maps a memory it sends MemWatch to the owner
//     (answered like MemLookup, after which the importer is a watcher);
//   owner: when the memory is deregistered, or the engine shuts down, it sends
//     MemRevoke to every watcher, in parallel, and waits for each MemRevokeAck
//     (each bounded by connect_timeout_ms); a watcher acknowledges only once
//     nothing it started can touch the memory any more.
// The frames' payloads and their handling live here, not in the engine: the
// engine hands MemWatch/MemRevoke to this service (EngineService), and the
// memory registry's removal hook starts the revocations, the way the RDMA
// backend drops its NIC registrations. One per engine, whether or not it has
// an XGMI backend, so that an engine without GPUs still answers watches.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "core/backend.h"

namespace mori_torch {
namespace xgmi {

class MemoryOwnership : public EngineService {
 public:
  explicit MemoryOwnership(const BackendContext& ctx);
  ~MemoryOwnership() override;

  bool Handles(FrameType type) const override;
  void HandleControl(const EngineDesc& peer, const std::string& peer_ip, const Frame& request, Frame* reply) override;
  void Shutdown() override;

  // Importer side: makes this engine a watcher of `remote` at its owner (or
  // here, for a transfer within this engine) and checks that it is still
  // registered as described; throws Error (ERR_NOT_FOUND) when it is not.
  void Watch(const MemoryDesc& remote);

  // Called when owner `owner_key` revokes memories `ids` this engine may have
  // watched; when it returns, nothing it started may touch them. The XGMI
  // backend sets it while it exists (nullptr clears it, waiting for a call
  // in progress).
  using Revoker = std::function<void(const std::string& owner_key, const std::vector<MemoryId>& ids)>;
  void SetRevoker(Revoker revoker);

  // Watch requests refused (wrong source address, too many watchers).
  uint64_t RefusedWatchers() const { return refused_watchers_.load(); }

 private:
  void HandleWatch(const EngineDesc& peer, const std::string& peer_ip, const Frame& request, Frame* reply);
  void HandleRevoke(const EngineDesc& peer, const std::string& peer_ip, const Frame& request, Frame* reply);
  // Owner `owner_key` revoked `ids`: the revoker stops using them.
  void RevokeHere(const std::string& owner_key, const std::vector<MemoryId>& ids);
  // Tells every engine that watched one of `mems` (retired) that it is gone
  // and waits for each to acknowledge.
  void RevokeFromWatchers(const std::vector<std::shared_ptr<LocalMemory>>& mems);
  // True if a request from `peer` that arrived from `peer_ip` may be taken
  // to come from that engine: its descriptor names that address. (Only a
  // shared secret proves it; this stops a third host from steering us.)
  static bool FromAddressOf(const EngineDesc& peer, const std::string& peer_ip);

  const BackendContext ctx_;
  uint64_t hook_ = 0;
  std::atomic<bool> hooked_{false};
  std::shared_mutex revoker_mu_;
  Revoker revoker_;  // guarded by revoker_mu_
  std::atomic<uint64_t> refused_watchers_{0};
};

}  // namespace xgmi
}  // namespace mori_torch
