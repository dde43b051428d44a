#include "backends/xgmi/pinned_segment_lists.h"

#include <atomic>
#include <mutex>
#include <new>
#include <string>

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
    if (bytes < kMinPinnedList || bytes > kLargestPinnedList || off_.load()) return nullptr;
    const size_t cls = ClassOf(bytes);
    uint64_t block_bytes = kMinPinnedList << cls;
    Idle* evicted = nullptr;  // idle blocks unpinned below, to make room
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (Idle* b = idle_[cls]) {
        idle_[cls] = b->next;
        *device_view = b->device_view;
        return b;
      }
      // Reserved before pinning, which takes long enough to do unlocked.
      for (size_t c = kClasses; c-- > 0 && held_ + block_bytes > kMaxPinnedListBytes;) {
        while (idle_[c] && held_ + block_bytes > kMaxPinnedListBytes) {
          Idle* b = idle_[c];
          idle_[c] = b->next;
          b->next = evicted;
          evicted = b;
          held_ -= b->bytes;
        }
      }
      if (held_ + block_bytes <= kMaxPinnedListBytes)
        held_ += block_bytes;
      else
        block_bytes = 0;  // full of lists in use: this one goes on the heap
    }
    while (evicted) {
      Idle* b = evicted;
      evicted = b->next;
      gpu::PinnedFree(b, b->bytes, gpu::PinnedUse::kSegmentLists);
    }
    if (block_bytes == 0) return nullptr;
    void* host = nullptr;
    std::string why;
    try {
      // Called where a batch is built: maybe on a thread that captures a
      // graph, or while another one does; registration must not break it.
      gpu::RelaxedCaptureScope relaxed;
      host = gpu::PinnedAlloc(block_bytes, -1, gpu::PinnedUse::kSegmentLists);
      *device_view = gpu::DevicePointerOfPinned(host);
      // Read in place only where every device sees the list at its host
      // address (unified addressing): the view was taken on one device.
      if (*device_view == reinterpret_cast<uint64_t>(host)) return host;
      why = "the GPU sees pinned memory at another address than the host";
    } catch (const std::exception& e) {
      why = e.what();
    } catch (...) {
      why = "an unknown error";
    }
    gpu::PinnedFree(host, block_bytes, gpu::PinnedUse::kSegmentLists);  // no-op when pinning failed
    {
      std::lock_guard<std::mutex> lk(mu_);
      held_ -= block_bytes;
    }
    if (!off_.exchange(true)) {
      MORI_LOG(Warning, "XGMI: segment lists stay on the heap and are copied for the copy kernel: " << why);
    }
    return nullptr;
  }

  void Free(void* block, size_t bytes, uint64_t device_view) override {
    // Kept for the next list of its class (unpinning can wait for the GPU),
    // linked through the block itself: freeing never allocates or throws.
    const size_t cls = ClassOf(bytes);
    std::lock_guard<std::mutex> lk(mu_);
    idle_[cls] = new (block) Idle{idle_[cls], device_view, kMinPinnedList << cls};
  }

 private:
  struct Idle {  // written into an idle block
    Idle* next;
    uint64_t device_view;
    uint64_t bytes;
  };
  static constexpr size_t kClasses = 8;  // 32 KiB, 64 KiB, ... 4 MiB
  static_assert((kMinPinnedList << (kClasses - 1)) == kLargestPinnedList, "the classes span the sizes");

  static size_t ClassOf(size_t bytes) {
    size_t cls = 0;
    while ((kMinPinnedList << cls) < bytes) ++cls;
    return cls;
  }

  std::mutex mu_;
  Idle* idle_[kClasses] = {};
  uint64_t held_ = 0;             // pinned by this cache, idle or in use (kMaxPinnedListBytes at most)
  std::atomic<bool> off_{false};  // pinning failed or is of no use here: the heap serves
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
