// Batches' segment lists in page-locked, device-mapped host memory, so that
// the XGMI copy kernel reads a validated list where it was built (the
// SegmentMemory of core/segments.h). Blocks are cached by power-of-two size
// and kept for the process: pinning is slow and batches come and go.
//
// Vendor-free: built on gpu_runtime.h only.
#pragma once

#include <cstdint>

namespace mori_torch {
namespace xgmi {

// Installs the pinned segment memory for the process (idempotent). Lists
// allocated afterwards of kMinPinnedList to kLargestPinnedList bytes, up to
// kMaxPinnedListBytes in all, are pinned; others stay on the heap and are
// copied for the kernel as before (a short list's copy costs about a
// microsecond). After a failed pinning, or where the GPU would see the
// memory at another address than the host (no unified addressing), every
// list stays on the heap. What the cache holds:
// gpu::PinnedBytes(gpu::PinnedUse::kSegmentLists).
void UsePinnedSegmentLists();

constexpr uint64_t kMinPinnedList = uint64_t{32} << 10;     // 1,365 entries
constexpr uint64_t kLargestPinnedList = uint64_t{4} << 20;  // a pooled batch's most: 131,072 entries
constexpr uint64_t kMaxPinnedListBytes = uint64_t{64} << 20;

}  // namespace xgmi
}  // namespace mori_torch
