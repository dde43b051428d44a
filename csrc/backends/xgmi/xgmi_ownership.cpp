#include "backends/xgmi/xgmi_ownership.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <cerrno>
#include <thread>
#include <unordered_map>

#include "core/byte_io.h"
#include "core/logging.h"
#include "core/thread_name.h"

namespace mori_torch {
namespace xgmi {

MemoryOwnership::MemoryOwnership(const BackendContext& ctx) : ctx_(ctx) {
  hook_ = ctx_.memory->AddRemovalHook(
      [this](const std::vector<std::shared_ptr<LocalMemory>>& retired) { RevokeFromWatchers(retired); });
  hooked_ = true;
}

MemoryOwnership::~MemoryOwnership() { Shutdown(); }

void MemoryOwnership::Shutdown() {
  if (hooked_.exchange(false)) ctx_.memory->RemoveRemovalHook(hook_);
}

bool MemoryOwnership::Handles(FrameType type) const {
  return type == FrameType::MemWatch || type == FrameType::MemRevoke;
}

void MemoryOwnership::HandleControl(const EngineDesc& peer, const std::string& peer_ip, const Frame& request,
                                    Frame* reply) {
  if (request.type == FrameType::MemWatch) return HandleWatch(peer, peer_ip, request, reply);
  return HandleRevoke(peer, peer_ip, request, reply);
}

void MemoryOwnership::HandleWatch(const EngineDesc& peer, const std::string& peer_ip, const Frame& request,
                                  Frame* reply) {
  auto m = ctx_.memory->FindByRef(request.payload, "MemWatch frame");
  // The owner later connects to the watcher's address to revoke: it must be
  // the address the watch came from, not one named by anybody.
  if (!FromAddressOf(peer, peer_ip)) {
    refused_watchers_.fetch_add(1);
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "MemWatch: engine '" + peer.key + "' names host '" + peer.host + "' but connected from " + peer_ip);
  }
  switch (m->AddWatcher(peer)) {
    case LocalMemory::WatchResult::kAdded:
      break;
    case LocalMemory::WatchResult::kRetired:
      throw Error(StatusCode::ERR_NOT_FOUND,
                  "memory " + std::to_string(m->desc.id) + " of engine '" + ctx_.self->key + "' is being deregistered");
    case LocalMemory::WatchResult::kFull:
      refused_watchers_.fetch_add(1);
      throw Error(StatusCode::ERR_BAD_STATE, "MemWatch: memory " + std::to_string(m->desc.id) + " already has " +
                                                 std::to_string(LocalMemory::kMaxWatchers) + " watchers");
  }
  reply->type = FrameType::MemLookupReply;  // the same answer as a lookup
  reply->payload = m->desc.Pack();
}

void MemoryOwnership::HandleRevoke(const EngineDesc& peer, const std::string& peer_ip, const Frame& request,
                                   Frame* reply) {
  // Only the owner may take its memory back: a registered remote engine,
  // described exactly as registered, from its own address.
  if (!ctx_.knows_engine(peer) || !FromAddressOf(peer, peer_ip)) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "MemRevoke: engine '" + peer.key + "' (from " + peer_ip +
                                                  ") is not a registered remote engine at that address");
  }
  ByteReader r(request.payload.data(), request.payload.size(), "MemRevoke frame");
  const uint32_t n = r.Get<uint32_t>("count");
  if (uint64_t{n} * 8 != request.payload.size() - 4) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "MemRevoke frame: count " + std::to_string(n) + " does not match " +
                                                  std::to_string(request.payload.size()) + " payload bytes");
  }
  std::vector<MemoryId> ids(n);
  for (auto& id : ids) id = r.Get<uint64_t>("memory id");
  RevokeHere(peer.key, ids);
  reply->type = FrameType::MemRevokeAck;
}

void MemoryOwnership::Watch(const MemoryDesc& remote) {
  if (remote.engine_key != ctx_.self->key) return ctx_.ask_owner(remote, FrameType::MemWatch);
  auto m = ctx_.memory->Find(remote.id, remote.token);  // a transfer within this engine
  if (!m || m->desc.data != remote.data || m->desc.size != remote.size ||
      m->AddWatcher(*ctx_.self) != LocalMemory::WatchResult::kAdded) {
    throw Error(StatusCode::ERR_NOT_FOUND, "memory " + std::to_string(remote.id) + " is not registered with engine '" +
                                               ctx_.self->key + "' (deregistered?)");
  }
}

void MemoryOwnership::SetRevoker(Revoker revoker) {
  std::unique_lock<std::shared_mutex> lk(revoker_mu_);  // waits for a revocation in progress
  revoker_ = std::move(revoker);
}

void MemoryOwnership::RevokeHere(const std::string& owner_key, const std::vector<MemoryId>& ids) {
  std::shared_lock<std::shared_mutex> lk(revoker_mu_);
  if (revoker_) revoker_(owner_key, ids);  // none: no XGMI backend, nothing mapped
}

void MemoryOwnership::RevokeFromWatchers(const std::vector<std::shared_ptr<LocalMemory>>& mems) {
  struct Notice {
    EngineDesc to;
    std::vector<MemoryId> ids;
  };
  std::unordered_map<std::string, Notice> by_engine;
  for (const auto& m : mems) {
    for (const EngineDesc& w : m->Watchers()) {
      Notice& n = by_engine[w.key];
      n.to = w;
      n.ids.push_back(m->desc.id);
    }
  }
  if (by_engine.empty()) return;
  const EngineDesc& self = *ctx_.self;
  auto revoke = [&](const Notice& n) {
    if (n.to.key == self.key) return RevokeHere(self.key, n.ids);
    ByteWriter w;
    w.Put<uint32_t>(static_cast<uint32_t>(n.ids.size()));
    for (MemoryId id : n.ids) w.Put<uint64_t>(id);
    try {
      // A connection of its own: the watcher need not be a registered remote.
      ControlClient client(self, n.to, ctx_.connect_timeout_ms, ctx_.secret);
      client.Call(FrameType::MemRevoke, w.bytes());
      client.Close();
    } catch (const Error& e) {
      // Refused: the watcher's engine is gone, and its mappings with it (an
      // engine closes them when it shuts down). Anything else (a hung peer)
      // deserves a warning: it may still hold a mapping.
      const bool gone = e.sys_errno() == ECONNREFUSED || e.cause() == ErrorCause::kPeerRestarted;
      if (gone) {
        MORI_LOG(Info, "engine '" << self.key << "': engine '" << n.to.key << "' that mapped " << n.ids.size()
                                  << " deregistered memory region(s) is gone: " << e.what());
      } else {
        MORI_LOG(Warning, "engine '" << self.key << "': could not revoke " << n.ids.size()
                                     << " deregistered memory region(s) from engine '" << n.to.key
                                     << "': " << e.what());
      }
    }
  };
  // In parallel, so a hung watcher costs one timeout, not one per watcher.
  std::vector<std::thread> threads;
  for (auto& kv : by_engine) {
    threads.emplace_back([&revoke, &n = kv.second] {
      SetThreadName("mori-revoke");
      revoke(n);
    });
  }
  for (auto& t : threads) t.join();
}

bool MemoryOwnership::FromAddressOf(const EngineDesc& peer, const std::string& peer_ip) {
  if (peer.host == peer_ip) return true;
  // A name: the address it resolves to now must be the one the request came from.
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(peer.host.c_str(), nullptr, &hints, &res) != 0) return false;
  bool match = false;
  for (addrinfo* a = res; a && !match; a = a->ai_next) {
    char ip[INET_ADDRSTRLEN] = "";
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof ip);
    match = peer_ip == ip;
  }
  freeaddrinfo(res);
  return match;
}

}  // namespace xgmi
}  // namespace mori_torch
