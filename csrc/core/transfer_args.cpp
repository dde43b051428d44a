#include "core/transfer_args.h"

#include "core/memory_registry.h"

namespace mori_torch {
namespace {

// The message for the first bad segment (the fast pass found one).
std::string DescribeFirstBadSegment(Int64Span lo_s, Int64Span ro_s, Int64Span sz_s, const MemoryDesc& local,
                                    const MemoryDesc& remote) {
  const size_t n = sz_s.size;
  for (size_t i = 0; i < n; ++i) {
    const int64_t lo = lo_s.data[i], ro = ro_s.data[i], sz = sz_s.data[i];
    if (lo < 0 || ro < 0 || sz < 0) {
      return "negative value in segment " + std::to_string(i) + ": local_offset=" + std::to_string(lo) +
             ", remote_offset=" + std::to_string(ro) + ", size=" + std::to_string(sz);
    }
    std::string e = CheckRange(local, static_cast<uint64_t>(lo), static_cast<uint64_t>(sz), "local");
    if (e.empty()) e = CheckRange(remote, static_cast<uint64_t>(ro), static_cast<uint64_t>(sz), "remote");
    if (!e.empty()) return (n > 1 ? "segment " + std::to_string(i) + ": " : std::string()) + e;
  }
  return "";
}

}  // namespace

StatusCode BuildSegments(Int64Span local_offsets, Int64Span remote_offsets, Int64Span sizes, const MemoryDesc& local,
                         const MemoryDesc& remote, SegmentBatch* out, std::string* msg) {
  const size_t n = sizes.size;
  out->total_bytes = out->max_bytes = 0;
  out->mergeable = false;
  if (local_offsets.size != n || remote_offsets.size != n) {
    out->segs.clear();
    *msg = "mismatched list lengths: local_offsets has " + std::to_string(local_offsets.size) +
           ", remote_offsets has " + std::to_string(remote_offsets.size) + ", sizes has " + std::to_string(n);
    return StatusCode::ERR_INVALID_ARGS;
  }
  out->segs.resize(n);
  Segment* o = out->segs.data();
  const int64_t* lo = local_offsets.data;
  const int64_t* ro = remote_offsets.data;
  const int64_t* sz = sizes.data;
  const uint64_t lsize = local.size, rsize = remote.size;
  // A reused list (NewSegmentBatch) keeps its size: shrinking or keeping it
  // initializes nothing, and every entry is written below.
  // Branch-free: a negative value sets the top bit of `neg`; with all three
  // non-negative (< 2^63) the sums cannot wrap, so `over` is exact. `joins`
  // notes an empty segment or one that continues its predecessor (the
  // predecessor's ends start out unequal to any first segment's offsets).
  uint64_t neg = 0, total = 0, largest = 0;
  bool over = false, joins = false;
  uint64_t prev_lend = ~uint64_t{0}, prev_rend = ~uint64_t{0};
  for (size_t i = 0; i < n; ++i) {
    const uint64_t l = static_cast<uint64_t>(lo[i]), r = static_cast<uint64_t>(ro[i]), s = static_cast<uint64_t>(sz[i]);
    neg |= l | r | s;
    over |= (l + s > lsize) | (r + s > rsize);
    joins |= (s == 0) | ((l == prev_lend) & (r == prev_rend));
    prev_lend = l + s;
    prev_rend = r + s;
    total += s;
    largest = s > largest ? s : largest;
    o[i] = {l, r, s};
  }
  if ((neg >> 63) != 0 || over) {
    out->segs.clear();
    *msg = DescribeFirstBadSegment(local_offsets, remote_offsets, sizes, local, remote);
    return StatusCode::ERR_INVALID_ARGS;
  }
  out->total_bytes = total;
  out->max_bytes = largest;
  out->mergeable = joins;
  return StatusCode::SUCCESS;
}

}  // namespace mori_torch
