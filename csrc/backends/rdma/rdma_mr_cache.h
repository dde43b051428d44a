// NIC registrations of local memory: one per (rail, memory), made on first
// use and kept until the memory is deregistered (Drop) or the backend goes.
// Each covers exactly the registered range, so the NIC itself rejects remote
// access outside it. GPU memory goes through dma-buf, with plain
// ibv_reg_mr (peer-memory drivers) as the fallback.
#pragma once

#include <memory>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "backends/rdma/rdma_device.h"
#include "core/descriptors.h"

namespace mori_torch {
namespace rdma {

class MrCache {
 public:
  explicit MrCache(std::vector<std::shared_ptr<RdmaDevice>> rails) : rails_(std::move(rails)) {}
  ~MrCache() { Clear(); }
  // The registration of `m` on `rail`, made now if needed. Throws Error
  // (ERR_RDMA_OP) naming the memory and the verbs error.
  ibv_mr* Get(size_t rail, const MemoryDesc& m);
  // Registers `m` on every rail now (outside any graph capture: dma-buf
  // export is a GPU call). Throws like Get.
  void RegisterOnAllRails(const MemoryDesc& m);
  // True when `id` is registered on every rail through dma-buf: the NIC then
  // reaches the GPU bytes itself and the host posts with no GPU call.
  bool DmaBufOnAllRails(MemoryId id);
  // Deregisters `id` on every rail.
  void Drop(MemoryId id);
  void Clear();

 private:
  ibv_mr* Register(RdmaDevice& dev, const MemoryDesc& m, bool* via_dmabuf);
  void Deregister(std::vector<ibv_mr*>& mrs);  // one per rail, nullptr where none

  std::vector<std::shared_ptr<RdmaDevice>> rails_;
  std::shared_mutex mu_;
  std::unordered_map<MemoryId, std::vector<ibv_mr*>> map_;  // indexed by rail
  std::unordered_map<MemoryId, size_t> dmabuf_rails_;       // rails registered through dma-buf
};

}  // namespace rdma
}  // namespace mori_torch
