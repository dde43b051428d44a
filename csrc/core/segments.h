// Segment lists shared by every backend: a transfer is a list of
// (local offset, remote offset, size) between one local and one remote
// memory. Helpers merge contiguous runs and cut a list into byte-balanced
// stripes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mori_torch {

struct Segment {
  uint64_t local_off = 0;
  uint64_t remote_off = 0;
  uint64_t size = 0;
};

uint64_t TotalBytes(const std::vector<Segment>& segs);

// Drops empty segments and merges neighbours that are contiguous on both
// sides (order is kept: only adjacent entries merge).
std::vector<Segment> MergeContiguous(const std::vector<Segment>& segs);
// The same, in place and in one O(n) pass (no sorting, no allocation).
void MergeContiguousInPlace(std::vector<Segment>* segs);

// Cuts `segs` into at most `parts` lists of nearly equal byte counts,
// splitting segments where needed; never returns an empty list.
std::vector<std::vector<Segment>> SplitIntoStripes(const std::vector<Segment>& segs, size_t parts);

}  // namespace mori_torch
