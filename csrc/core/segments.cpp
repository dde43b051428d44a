#include "core/segments.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <new>

#include "base/sanitizers.h"
#include "core/work_crew.h"

namespace mori_torch {

namespace {

std::atomic<SegmentMemory*> g_segment_memory{nullptr};
std::atomic<uint64_t> g_segment_memory_generation{0};  // bumped by every UseSegmentMemory

// Every list block starts with this header (a cache line, so entries stay
// 64-byte aligned): where the block came from and how to free it.
struct alignas(64) BlockHeader {
  SegmentMemory* owner;  // null: the heap
  uint64_t device_view;  // of the block, 0 on the heap
  size_t bytes;          // of the block, header included
  uint64_t generation;   // of the SegmentMemory in place when it was allocated
};

BlockHeader* HeaderOf(const void* p) {
  return reinterpret_cast<BlockHeader*>(const_cast<char*>(static_cast<const char*>(p)) - sizeof(BlockHeader));
}

}  // namespace

void UseSegmentMemory(SegmentMemory* memory) {
  g_segment_memory.store(memory);
  g_segment_memory_generation.fetch_add(1);
}

namespace segment_alloc {

void* Allocate(size_t bytes) {
  if (bytes > SIZE_MAX - sizeof(BlockHeader)) throw std::bad_alloc();
  const size_t total = bytes + sizeof(BlockHeader);
  const uint64_t generation = g_segment_memory_generation.load();
  SegmentMemory* owner = g_segment_memory.load();
  uint64_t view = 0;
  void* block = owner ? owner->Allocate(total, &view) : nullptr;
  if (!block) {
    owner = nullptr;
    view = 0;
    block = ::operator new(total, std::align_val_t{alignof(BlockHeader)});
  }
  auto* h = new (block) BlockHeader{owner, view, total, generation};
  return h + 1;
}

void Free(void* p) {
  if (!p) return;
  BlockHeader* h = HeaderOf(p);
  SegmentMemory* owner = h->owner;
  const size_t bytes = h->bytes;
  const uint64_t view = h->device_view;
  h->~BlockHeader();
  if (owner) {
    owner->Free(h, bytes, view);
  } else {
    ::operator delete(static_cast<void*>(h), std::align_val_t{alignof(BlockHeader)});
  }
}

uint64_t DeviceView(const void* p) {
  const BlockHeader* h = HeaderOf(p);
  return h->device_view == 0 ? 0 : h->device_view + sizeof(BlockHeader);
}

}  // namespace segment_alloc

bool InCurrentSegmentMemory(const SegmentVector& segs) {
  return segs.capacity() == 0 || HeaderOf(segs.data())->generation == g_segment_memory_generation.load();
}

uint64_t TotalBytes(SegmentSpan segs) {
  uint64_t t = 0;
  for (const auto& s : segs) t += s.size;
  return t;
}

namespace {

bool Continues(const Segment& b, const Segment& s) {
  return b.local_off + b.size == s.local_off && b.remote_off + b.size == s.remote_off;
}

// Merges v[0, n) in place; returns how many segments it kept (at the front)
// and their largest size in *largest.
size_t MergeRange(Segment* v, size_t n, uint64_t* largest) {
  // Read-only scan up to the first entry that is empty or continues its
  // predecessor: a batch of scattered pages is left untouched, no stores.
  uint64_t big = 0;
  size_t i = 0;
  if (n > 0 && v[0].size != 0) {
    big = v[0].size;
    for (i = 1; i < n; ++i) {
      if (v[i].size == 0 || Continues(v[i - 1], v[i])) break;
      big = std::max(big, v[i].size);
    }
  }
  size_t kept = i;  // v[0, kept) is the merged prefix
  for (; i < n; ++i) {
    const Segment s = v[i];
    if (s.size == 0) continue;
    if (kept > 0 && Continues(v[kept - 1], s)) {
      v[kept - 1].size += s.size;
      big = std::max(big, v[kept - 1].size);
      continue;
    }
    v[kept++] = s;
    big = std::max(big, s.size);
  }
  *largest = big;
  return kept;
}

}  // namespace

size_t MergeContiguousInPlace(Segment* v, size_t n, uint64_t* largest_out) {
  // A long list merges in ranges on the WorkCrew (one thread: about 2.5 ns
  // per entry once the first merge is found, 40 us for 16,384 entries on an
  // H200 host), then each range's kept run is joined to the one before:
  // merging is associative, so the result is the one-pass one.
  std::array<size_t, WorkCrew::kMaxRanges> kept, first;
  std::array<uint64_t, WorkCrew::kMaxRanges> big;
  const size_t ranges = WorkCrew::ForRanges(n, [&](size_t r, size_t begin, size_t end) {
    first[r] = begin;
    kept[r] = MergeRange(v + begin, end - begin, &big[r]);
  });
  uint64_t largest = 0;
  size_t end = 0;
  for (size_t r = 0; r < ranges; ++r) {
    const Segment* from = v + first[r];
    size_t k = kept[r];
    if (k > 0 && end > 0 && Continues(v[end - 1], from[0])) {
      v[end - 1].size += from[0].size;
      largest = std::max(largest, v[end - 1].size);
      ++from;
      --k;
    }
    if (from != v + end) std::memmove(static_cast<void*>(v + end), from, k * sizeof(Segment));
    end += k;
    largest = std::max(largest, big[r]);
  }
  *largest_out = largest;
  return end;
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
    // A list from before a SegmentMemory was installed (or changed) lets
    // its memory go: the next build allocates where the backends want it.
    if (!InCurrentSegmentMemory(b->segs)) SegmentVector().swap(b->segs);
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

size_t CopyBackToBack(const std::vector<SegmentSpan>& lists, void* out) {
  std::vector<size_t> starts;  // list k's first entry in `out`
  starts.reserve(lists.size());
  size_t total = 0;
  for (const SegmentSpan& l : lists) {
    starts.push_back(total);
    total += l.size();
  }
  auto* const to = static_cast<Segment*>(out);
  WorkCrew::ForRanges(total, [&](size_t, size_t begin, size_t end) {
    // The last list starting at or before `begin` (empty ones are skipped).
    size_t k = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
    for (; begin < end; ++k) {
      const size_t from = begin - starts[k];
      const size_t n = std::min(end - begin, lists[k].size() - from);
      if (n > 0) std::memcpy(static_cast<void*>(to + begin), lists[k].data() + from, n * sizeof(Segment));
      begin += n;
    }
  });
  return total;
}

std::vector<Segment> MergeContiguous(SegmentSpan segs) {
  std::vector<Segment> out(segs.begin(), segs.end());
  MergeContiguousInPlace(&out);
  return out;
}

std::vector<std::vector<Segment>> SplitIntoStripes(SegmentSpan segs, uint64_t total, size_t parts) {
  parts = std::max<size_t>(1, parts);
  if (parts == 1 || total == 0) return {std::vector<Segment>(segs.begin(), segs.end())};
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
