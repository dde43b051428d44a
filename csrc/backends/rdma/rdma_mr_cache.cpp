#include "backends/rdma/rdma_mr_cache.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

#include "core/logging.h"
#include "gpu/gpu_runtime.h"

namespace mori_torch {
namespace rdma {
namespace {
constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
}

ibv_mr* MrCache::Register(RdmaDevice& dev, const MemoryDesc& m, bool* via_dmabuf) {
  *via_dmabuf = false;
  const VerbsApi* api = dev.api;
  std::string dmabuf_why;
  if (m.loc == MemoryLocationType::GPU) {
    if (api->reg_dmabuf_mr) {
      try {
        uint64_t offset = 0;
        int fd = gpu::DmaBufFdOf(m.data, m.size, &offset);
        ibv_mr* mr = api->reg_dmabuf_mr(dev.pd, offset, m.size, m.data, fd, kAccess);
        const int e = errno;
        ::close(fd);  // the registration holds its own reference
        if (mr) {
          *via_dmabuf = true;
          return mr;
        }
        dmabuf_why = std::string("ibv_reg_dmabuf_mr: ") + std::strerror(e);
      } catch (const Error& e) {
        dmabuf_why = e.what();
      }
    } else {
      dmabuf_why = "this libibverbs has no ibv_reg_dmabuf_mr";
    }
    MORI_LOG(Debug, "RDMA: dma-buf registration of GPU memory " << m.id << " failed (" << dmabuf_why
                                                                << "); trying ibv_reg_mr");
  }
  ibv_mr* mr = api->reg_mr(dev.pd, reinterpret_cast<void*>(m.data), m.size, kAccess);
  if (mr) return mr;
  const int e = errno;
  throw Error(StatusCode::ERR_RDMA_OP,
              "RDMA: cannot register " + std::string(MemoryLocationName(m.loc)) + " memory " + std::to_string(m.id) +
                  " [" + std::to_string(m.data) + ", +" + std::to_string(m.size) + ") on " + dev.name +
                  ": ibv_reg_mr: " + std::strerror(e) +
                  (dmabuf_why.empty() ? std::string() : "; dma-buf: " + dmabuf_why) +
                  (e == ENOMEM || e == EPERM ? " (raise the locked-memory limit, ulimit -l)" : ""));
}

ibv_mr* MrCache::Get(size_t rail, const MemoryDesc& m) {
  {
    std::shared_lock<std::shared_mutex> lk(mu_);
    auto it = map_.find(m.id);
    if (it != map_.end() && it->second[rail]) return it->second[rail];
  }
  std::unique_lock<std::shared_mutex> lk(mu_);
  auto& v = map_[m.id];
  if (v.empty()) v.resize(rails_.size(), nullptr);
  if (!v[rail]) {
    bool via_dmabuf = false;
    v[rail] = Register(*rails_[rail], m, &via_dmabuf);
    if (via_dmabuf) ++dmabuf_rails_[m.id];
  }
  return v[rail];
}

void MrCache::RegisterOnAllRails(const MemoryDesc& m) {
  for (size_t r = 0; r < rails_.size(); ++r) Get(r, m);
}

bool MrCache::DmaBufOnAllRails(MemoryId id) {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = dmabuf_rails_.find(id);
  return it != dmabuf_rails_.end() && it->second == rails_.size();
}

void MrCache::Deregister(std::vector<ibv_mr*>& mrs) {
  for (size_t r = 0; r < mrs.size(); ++r) {
    if (mrs[r]) rails_[r]->api->dereg_mr(mrs[r]);
  }
}

void MrCache::Drop(MemoryId id) {
  std::vector<ibv_mr*> mrs;
  {
    std::unique_lock<std::shared_mutex> lk(mu_);
    auto it = map_.find(id);
    if (it == map_.end()) return;
    mrs.swap(it->second);
    map_.erase(it);
    dmabuf_rails_.erase(id);
  }
  Deregister(mrs);
}

void MrCache::Clear() {
  std::unordered_map<MemoryId, std::vector<ibv_mr*>> all;
  {
    std::unique_lock<std::shared_mutex> lk(mu_);
    all.swap(map_);
    dmabuf_rails_.clear();
  }
  for (auto& kv : all) Deregister(kv.second);
}

}  // namespace rdma
}  // namespace mori_torch
