// Segment lists shared by every backend: a transfer is a list of
// (local offset, remote offset, size) between one local and one remote
// memory. Helpers merge contiguous runs and cut a list into byte-balanced
// stripes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace mori_torch {

struct Segment {
  uint64_t local_off = 0;
  uint64_t remote_off = 0;
  uint64_t size = 0;
};

// Where batches' segment lists live. By default the heap; a GPU backend
// installs page-locked, device-mapped memory (gpu/pinned_segment_memory.h)
// so that its copy kernel reads a validated list where BuildSegments wrote
// it, instead of a copy of it (8-10 us of a 16,384-page batch on one H200).
class SegmentMemory {
 public:
  virtual ~SegmentMemory() = default;
  // `bytes` of room, or nullptr to leave the list on the heap; on success
  // *device_view is the address a GPU kernel reads the block at.
  virtual void* Allocate(size_t bytes, uint64_t* device_view) = 0;
  // A block from Allocate, with the same `bytes` and the view it gave.
  virtual void Free(void* block, size_t bytes, uint64_t device_view) = 0;
};
// Process-wide; null goes back to the heap. `memory` must outlive every
// list it allocated (in practice: it is never destroyed). Lists allocated
// before keep their memory and are freed where they came from.
void UseSegmentMemory(SegmentMemory* memory);

namespace segment_alloc {
void* Allocate(size_t bytes);
void Free(void* p);
uint64_t DeviceView(const void* p);
}  // namespace segment_alloc

// The allocator of batch lists: each block remembers where it came from
// (heap or the SegmentMemory installed when it was allocated).
template <class T>
struct SegmentAllocator {
  using value_type = T;
  SegmentAllocator() = default;
  template <class U>
  SegmentAllocator(const SegmentAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(segment_alloc::Allocate(n * sizeof(T))); }
  void deallocate(T* p, size_t) { segment_alloc::Free(p); }
  template <class U>
  bool operator==(const SegmentAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const SegmentAllocator<U>&) const {
    return false;
  }
};
using SegmentVector = std::vector<Segment, SegmentAllocator<Segment>>;

// The device address of `segs`' entries when they live in device-mapped
// memory (see SegmentMemory), else 0.
inline uint64_t DeviceViewOf(const SegmentVector& segs) {
  return segs.capacity() == 0 ? 0 : segment_alloc::DeviceView(segs.data());
}
// True when `segs` was allocated while the SegmentMemory installed now was
// (by it, or on the heap where it declined).
bool InCurrentSegmentMemory(const SegmentVector& segs);

// A read-only view of consecutive segments: a batch's list or any vector.
struct SegmentSpan {
  const Segment* ptr = nullptr;
  size_t n = 0;
  SegmentSpan() = default;
  SegmentSpan(const Segment* p, size_t count) : ptr(p), n(count) {}
  template <class A>
  SegmentSpan(const std::vector<Segment, A>& v) : ptr(v.data()), n(v.size()) {}  // NOLINT: implicit by design
  const Segment* begin() const { return ptr; }
  const Segment* end() const { return ptr + n; }
  const Segment* data() const { return ptr; }
  size_t size() const { return n; }
  bool empty() const { return n == 0; }
  const Segment& operator[](size_t i) const { return ptr[i]; }
};

// A transfer's validated segments (contiguous neighbours merged when many
// are, BuildSegments; never an empty one), with the
// facts every backend asks for, found while building it (BuildSegments) and
// then shared read-only: the retry driver's template and the attempt in flight hold the
// same list, so a 16,384-page batch is neither copied per submit nor walked
// again for its byte count.
struct SegmentBatch {
  SegmentVector segs;
  uint64_t total_bytes = 0;
  uint64_t max_bytes = 0;  // the largest segment's size
};
using SharedSegments = std::shared_ptr<const SegmentBatch>;

// An empty batch to fill, from a small process-wide pool: a list that was
// built before is reused (its memory mapped and warm, and BuildSegments'
// resize initializes nothing when it does not grow) once its last holder
// lets go. Pooled lists are bounded in number and in size.
std::shared_ptr<SegmentBatch> NewSegmentBatch();
// False in sanitizer builds, which pool nothing (a recycled list would hide
// a use after free).
bool SegmentBatchesPooled();

uint64_t TotalBytes(SegmentSpan segs);

// Copies the lists' entries back to back to `out` (room for all of them,
// any memory: a GPU kernel's pinned list), in ranges on the submit helpers
// when there are many; returns how many it wrote.
size_t CopyBackToBack(const std::vector<SegmentSpan>& lists, void* out);

// Drops empty segments and merges neighbours that are contiguous on both
// sides (order is kept: only adjacent entries merge).
std::vector<Segment> MergeContiguous(SegmentSpan segs);
// The same in place, in one O(n) pass without allocating (long lists in
// chunks on the WorkCrew): v[0, n) becomes the merged list, whose length is
// returned; *largest gets its largest segment's size.
size_t MergeContiguousInPlace(Segment* v, size_t n, uint64_t* largest);
// The same on a vector, cut to the merged length; returns the largest size.
template <class A>
uint64_t MergeContiguousInPlace(std::vector<Segment, A>* segs) {
  uint64_t largest = 0;
  segs->resize(MergeContiguousInPlace(segs->data(), segs->size(), &largest));
  return largest;
}

// Cuts `segs` (`total` bytes: the batch's count, not walked again) into at
// most `parts` lists of nearly equal byte counts, splitting segments where
// needed; never returns an empty list.
std::vector<std::vector<Segment>> SplitIntoStripes(SegmentSpan segs, uint64_t total, size_t parts);

}  // namespace mori_torch
