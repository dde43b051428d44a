#include "backends/xgmi/pinned_segment_lists.h"

#include <mutex>
#include <vector>

#include "base/error.h"
#include "core/logging.h"
#include "core/segments.h"
#include "gpu/gpu_runtime.h"
#include "gpu/stream_ops.h"

namespace mori_torch {
namespace xgmi {
namespace {

class PinnedSegmentMemory final : public SegmentMemory {
 public:
  void* Allocate(size_t bytes, uint64_t* device_view) override {
    if (bytes > kLargestPinnedList) return nullptr;
    const size_t cls = ClassOf(bytes);
    const uint64_t block_bytes = kSmallestPinnedList << cls;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!idle_[cls].empty()) {
        const Block b = idle_[cls].back();
        idle_[cls].pop_back();
        *device_view = b.device_view;
        return b.host;
      }
      // Reserved before pinning, which takes long enough to do unlocked.
      if (held_ + block_bytes > kMaxPinnedListBytes) return nullptr;
      held_ += block_bytes;
    }
    void* host = nullptr;
    try {
      // Called where a batch is built: maybe on a thread that captures a
      // graph, or while another one does; registration must not break it.
      gpu::RelaxedCaptureScope relaxed;
      host = gpu::PinnedAlloc(block_bytes, -1, gpu::PinnedUse::kSegmentLists);
      *device_view = gpu::DevicePointerOfPinned(host);
      return host;
    } catch (const Error& e) {
      gpu::PinnedFree(host, block_bytes, gpu::PinnedUse::kSegmentLists);  // no-op when pinning failed
      {
        std::lock_guard<std::mutex> lk(mu_);
        held_ -= block_bytes;
      }
      MORI_LOG(Warning, "a segment list stays on the heap (copied for the GPU): pinning " << block_bytes
                                                                                          << " bytes: " << e.what());
      return nullptr;
    }
  }

  void Free(void* block, size_t bytes, uint64_t device_view) override {
    // Kept for the next list of its class: unpinning can wait for the GPU,
    // and what the cache holds is bounded by kMaxPinnedListBytes.
    std::lock_guard<std::mutex> lk(mu_);
    idle_[ClassOf(bytes)].push_back({block, device_view});
  }

 private:
  struct Block {
    void* host;
    uint64_t device_view;
  };
  static constexpr size_t kClasses = 11;  // 4 KiB, 8 KiB, ... 4 MiB
  static_assert((kSmallestPinnedList << (kClasses - 1)) == kLargestPinnedList, "the classes span the sizes");

  static size_t ClassOf(size_t bytes) {
    size_t cls = 0;
    while ((kSmallestPinnedList << cls) < bytes) ++cls;
    return cls;
  }

  std::mutex mu_;
  std::vector<Block> idle_[kClasses];
  uint64_t held_ = 0;  // pinned by this cache, idle or in use (kMaxPinnedListBytes at most)
};

// Never destroyed: lists may be freed during static destruction.
PinnedSegmentMemory* Memory() {
  static PinnedSegmentMemory* const memory = new PinnedSegmentMemory();
  return memory;
}

}  // namespace

void UsePinnedSegmentLists() {
  if (!gpu::Compiled()) return;
  UseSegmentMemory(Memory());
}

}  // namespace xgmi
}  // namespace mori_torch
