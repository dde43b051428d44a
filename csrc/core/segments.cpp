#include "core/segments.h"

#include <algorithm>
#include <mutex>

#include "base/sanitizers.h"

namespace mori_torch {

uint64_t TotalBytes(const std::vector<Segment>& segs) {
  uint64_t t = 0;
  for (const auto& s : segs) t += s.size;
  return t;
}

uint64_t MergeContiguousInPlace(std::vector<Segment>* segs) {
  Segment* v = segs->data();
  const size_t n = segs->size();
  // Read-only scan up to the first entry that is empty or continues its
  // predecessor: a batch of scattered pages is left untouched, no stores.
  uint64_t largest = 0;
  size_t i = 0;
  if (n > 0 && v[0].size != 0) {
    largest = v[0].size;
    for (i = 1; i < n; ++i) {
      const Segment& b = v[i - 1];
      const Segment& s = v[i];
      if (s.size == 0 || (b.local_off + b.size == s.local_off && b.remote_off + b.size == s.remote_off)) break;
      largest = std::max(largest, s.size);
    }
  }
  size_t kept = i;  // v[0, kept) is the merged prefix
  for (; i < n; ++i) {
    const Segment s = v[i];
    if (s.size == 0) continue;
    if (kept > 0) {
      Segment& b = v[kept - 1];
      if (b.local_off + b.size == s.local_off && b.remote_off + b.size == s.remote_off) {
        b.size += s.size;
        largest = std::max(largest, b.size);
        continue;
      }
    }
    v[kept++] = s;
    largest = std::max(largest, s.size);
  }
  segs->resize(kept);
  return largest;
}

namespace {

// Sanitizer builds pool nothing (SegmentBatchesPooled).
constexpr bool kPoolBatches = !MORI_SANITIZED;

class BatchPool {
 public:
  // Room for every list kept: giving one back (in a deleter) never allocates.
  BatchPool() { free_.reserve(kMaxPooled); }

  std::unique_ptr<SegmentBatch> Take() {
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.empty()) return std::make_unique<SegmentBatch>();
    std::unique_ptr<SegmentBatch> b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void Give(SegmentBatch* b) {
    std::unique_ptr<SegmentBatch> owned(b);
    // Larger lists are rare and would pin their memory: they are freed.
    if (!kPoolBatches || b->segs.capacity() > kMaxPooledEntries) return;
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.size() < kMaxPooled) free_.push_back(std::move(owned));
  }

 private:
  static constexpr size_t kMaxPooled = 8;
  static constexpr size_t kMaxPooledEntries = size_t{1} << 17;  // 3 MiB of segments
  std::mutex mu_;
  std::vector<std::unique_ptr<SegmentBatch>> free_;
};

}  // namespace

bool SegmentBatchesPooled() { return kPoolBatches; }

std::shared_ptr<SegmentBatch> NewSegmentBatch() {
  // Never destroyed: batches may be let go during static destruction.
  static BatchPool* const pool = new BatchPool();
  std::unique_ptr<SegmentBatch> b = pool->Take();
  b->total_bytes = b->max_bytes = 0;
  return std::shared_ptr<SegmentBatch>(b.release(), [](SegmentBatch* p) { pool->Give(p); });
}

std::vector<Segment> MergeContiguous(const std::vector<Segment>& segs) {
  std::vector<Segment> out = segs;
  MergeContiguousInPlace(&out);
  return out;
}

std::vector<std::vector<Segment>> SplitIntoStripes(const std::vector<Segment>& segs, uint64_t total, size_t parts) {
  parts = std::max<size_t>(1, parts);
  if (parts == 1 || total == 0) return {segs};
  const uint64_t per = (total + parts - 1) / parts;
  std::vector<std::vector<Segment>> out(1);
  uint64_t room = per;
  for (Segment s : segs) {
    while (s.size > 0) {
      if (room == 0) {
        out.emplace_back();
        room = per;
      }
      uint64_t take = std::min(room, s.size);
      out.back().push_back({s.local_off, s.remote_off, take});
      s.local_off += take;
      s.remote_off += take;
      s.size -= take;
      room -= take;
    }
  }
  return out;
}

}  // namespace mori_torch
