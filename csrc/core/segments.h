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

// A transfer's validated segments (contiguous neighbours merged when many
// are, BuildSegments; never an empty one), with the
// facts every backend asks for, found while building it (BuildSegments) and
// then shared read-only: the retry driver's template and the attempt in flight hold the
// same list, so a 16,384-page batch is neither copied per submit nor walked
// again for its byte count.
struct SegmentBatch {
  std::vector<Segment> segs;
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

uint64_t TotalBytes(const std::vector<Segment>& segs);

// Copies the lists' entries back to back to `out` (room for all of them,
// any memory: a GPU kernel's pinned list), in ranges on the submit helpers
// when there are many; returns how many it wrote.
size_t CopyBackToBack(const std::vector<const std::vector<Segment>*>& lists, void* out);

// Drops empty segments and merges neighbours that are contiguous on both
// sides (order is kept: only adjacent entries merge).
std::vector<Segment> MergeContiguous(const std::vector<Segment>& segs);
// The same in place, in one O(n) pass without allocating (long lists in
// chunks on the WorkCrew); returns the largest merged segment's size.
uint64_t MergeContiguousInPlace(std::vector<Segment>* segs);

// Cuts `segs` (`total` bytes: the batch's count, not walked again) into at
// most `parts` lists of nearly equal byte counts, splitting segments where
// needed; never returns an empty list.
std::vector<std::vector<Segment>> SplitIntoStripes(const std::vector<Segment>& segs, uint64_t total, size_t parts);

}  // namespace mori_torch
