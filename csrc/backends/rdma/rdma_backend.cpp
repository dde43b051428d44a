#include "backends/rdma/rdma_backend.h"

#include <sys/socket.h>

#include "backends/rdma/rdma_target.h"
#include "core/logging.h"

namespace mori_torch {
namespace rdma {

RdmaShared::RdmaShared(const RdmaConfig& c, const BackendContext& x, std::vector<std::shared_ptr<RdmaDevice>> r)
    : cfg(c), ctx(x), rails(std::move(r)), mrs(rails) {
  for (int i = 0; i < cfg.CompletionThreads(); ++i) {
    workers.push_back(std::make_unique<CompletionWorker>(cfg.poll_cq_mode, rails));
  }
  for (auto& d : rails) max_msg_bytes = std::min(max_msg_bytes, d->max_msg_bytes);
  if (cfg.num_nics_per_transfer > static_cast<int64_t>(rails.size())) {
    MORI_LOG(Warning, "RDMA: num_nics_per_transfer=" << cfg.num_nics_per_transfer << " but only " << rails.size()
                                                     << " usable device(s): connections use " << rails.size());
  }
}

namespace {

std::vector<std::shared_ptr<RdmaDevice>> OpenRails(const RdmaConfig& cfg) {
  std::string why;
  const VerbsApi* api = LoadVerbs(&why);
  if (!api) throw Error(StatusCode::ERR_BAD_STATE, "no active RDMA device/port found: " + why);
  return OpenActiveDevices(api, cfg.gid_index);
}

}  // namespace

RdmaBackend::RdmaBackend(const RdmaConfig& cfg, const BackendContext& ctx)
    : shared_(std::make_shared<RdmaShared>(cfg, ctx, OpenRails(cfg))) {
  // NIC registrations go with the memory: dropped once it is retired (no
  // local transfer uses it any more), after which remote access fails.
  RdmaShared* s = shared_.get();
  hook_ = ctx.memory->AddRemovalHook([s](const std::vector<std::shared_ptr<LocalMemory>>& retired) {
    for (const auto& m : retired) s->mrs.Drop(m->desc.id);
  });
}

bool RdmaBackend::CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc&) const {
  auto ok = [](MemoryLocationType l) { return l == MemoryLocationType::CPU || l == MemoryLocationType::GPU; };
  return ok(local.loc) && ok(remote.loc);
}

std::shared_ptr<BackendPeer> RdmaBackend::Peer(const EngineDesc& remote) {
  return peers_.GetOrCreate(remote.key, [&] {
    auto p = std::make_shared<RdmaPeer>(shared_, remote);
    if (shut_.load()) p->Close("RDMA backend was removed");
    return p;
  });
}

void RdmaBackend::RemovePeer(const std::string& key, const std::string& reason) {
  if (auto p = peers_.Take(key)) p->Close(reason);
}

void RdmaBackend::ServeData(const EngineDesc& peer, Socket& sock) {
  const int fd = sock.fd();
  {
    std::lock_guard<std::mutex> lk(inbound_mu_);
    if (shut_.load()) return;
    inbound_fds_.insert(fd);
  }
  ServeRdmaConnection(shared_, peer, fd);
  std::lock_guard<std::mutex> lk(inbound_mu_);
  inbound_fds_.erase(fd);
}

void RdmaBackend::Shutdown() {
  if (shut_.exchange(true)) return;
  shared_->ctx.memory->RemoveRemovalHook(hook_);
  for (auto& p : peers_.TakeAll()) p->Close("RDMA backend was removed or its engine shut down");
  std::lock_guard<std::mutex> lk(inbound_mu_);
  for (int fd : inbound_fds_) ::shutdown(fd, SHUT_RDWR);  // their threads tear their QPs down
}

}  // namespace rdma
}  // namespace mori_torch
