// Segment list helpers: merging contiguous runs and cutting a list into
// byte-balanced stripes, with exact and randomized property checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

#include "core/segments.h"
#include "test_util.h"

namespace mori_torch {

// In mori_torch (not the anonymous namespace) so that ADL finds them from
// std::vector's operator== and gtest's printers.
bool operator==(const Segment& a, const Segment& b) {
  return a.local_off == b.local_off && a.remote_off == b.remote_off && a.size == b.size;
}

std::ostream& operator<<(std::ostream& os, const Segment& s) {
  return os << "{" << s.local_off << "," << s.remote_off << "," << s.size << "}";
}

namespace {

// Expands a segment list into the byte-level map local byte -> remote byte,
// in order: two lists describe the same transfer iff their maps are equal.
std::vector<std::pair<uint64_t, uint64_t>> ByteMap(const std::vector<Segment>& segs) {
  std::vector<std::pair<uint64_t, uint64_t>> m;
  for (const auto& s : segs) {
    for (uint64_t i = 0; i < s.size; ++i) m.emplace_back(s.local_off + i, s.remote_off + i);
  }
  return m;
}

TEST(MergeContiguousTest, MergesOnlyWhenBothSidesContiguous) {
  const std::vector<Segment> in = {
      {0, 100, 10},   // a
      {10, 110, 5},   // contiguous on both sides with a -> merged
      {15, 200, 5},   // local contiguous, remote not
      {100, 205, 5},  // remote contiguous, local not
      {105, 210, 5},  // both contiguous with the previous -> merged
  };
  const std::vector<Segment> want = {{0, 100, 15}, {15, 200, 5}, {100, 205, 10}};
  EXPECT_EQ(MergeContiguous(in), want);
}

TEST(MergeContiguousTest, DropsZeroSizesAndKeepsOrder) {
  const std::vector<Segment> in = {
      {50, 50, 0}, {40, 0, 10}, {0, 0, 0}, {50, 10, 10}, {0, 20, 10}, {10, 30, 0}, {10, 30, 5},
  };
  // Zero-size entries vanish and do not block merging across them; a
  // non-adjacent pair ({50,10} then {0,20}) is never reordered to merge.
  const std::vector<Segment> want = {{40, 0, 20}, {0, 20, 15}};
  EXPECT_EQ(MergeContiguous(in), want);
  EXPECT_TRUE(MergeContiguous({}).empty());
  EXPECT_TRUE(MergeContiguous(std::vector<Segment>{{1, 2, 0}, {3, 4, 0}}).empty());
}

TEST(MergeContiguousTest, DoesNotMergeBackwardsOrOverlapping) {
  // Descending runs are contiguous in memory but not in transfer order.
  const std::vector<Segment> in = {{10, 10, 10}, {0, 0, 10}, {0, 0, 10}};
  EXPECT_EQ(MergeContiguous(in), in);
}

TEST(MergeContiguousTest, RandomizedPreservesTheByteMap) {
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 2000; ++iter) {
    std::vector<Segment> in;
    uint64_t lo = rng() % 50, ro = rng() % 50;
    // Now and then long enough to merge in chunks on the WorkCrew.
    const int n = iter % 100 == 0 ? 4096 + static_cast<int>(rng() % 30000) : static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) {
      const uint64_t sz = rng() % 4 == 0 ? 0 : 1 + rng() % 20;
      in.push_back({lo, ro, sz});
      // Mostly contiguous on both sides, sometimes on one side only.
      switch (rng() % 4) {
        case 0:
          lo += sz;
          ro += sz;
          break;
        case 1:
          lo += sz;
          ro += sz + 1 + rng() % 5;
          break;
        case 2:
          lo += sz + 1 + rng() % 5;
          ro += sz;
          break;
        default:
          lo = rng() % 1000;
          ro = rng() % 1000;
      }
    }
    const auto out = MergeContiguous(in);
    ASSERT_EQ(ByteMap(out), ByteMap(in));
    ASSERT_EQ(TotalBytes(out), TotalBytes(in));
    // Against a plain reference: the same list, in place too, and the
    // largest merged segment.
    const std::vector<Segment> want = testing_util::ReferenceMerge(in);
    ASSERT_EQ(out, want);
    std::vector<Segment> here = in;
    const uint64_t largest = MergeContiguousInPlace(&here);
    ASSERT_EQ(here, want);
    uint64_t want_largest = 0;
    for (const Segment& s : out) want_largest = std::max(want_largest, s.size);
    ASSERT_EQ(largest, want_largest);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_GT(out[i].size, 0u);
      if (i > 0) {
        // Maximal: no two neighbours left that could merge.
        const bool mergeable = out[i - 1].local_off + out[i - 1].size == out[i].local_off &&
                               out[i - 1].remote_off + out[i - 1].size == out[i].remote_off;
        ASSERT_FALSE(mergeable) << i;
      }
    }
  }
}

// Checks every documented property of SplitIntoStripes.
void CheckStripes(const std::vector<Segment>& in, size_t parts, const std::vector<std::vector<Segment>>& out) {
  const uint64_t total = TotalBytes(in);
  ASSERT_GE(out.size(), 1u);
  ASSERT_LE(out.size(), std::max<size_t>(parts, 1));
  // Same bytes in the same order once the stripes are concatenated.
  std::vector<Segment> flat;
  for (const auto& s : out) flat.insert(flat.end(), s.begin(), s.end());
  ASSERT_EQ(TotalBytes(flat), total);
  ASSERT_EQ(ByteMap(flat), ByteMap(in));
  if (total == 0) return;
  // Balanced: every stripe holds ceil(total / parts) bytes, except the last,
  // which holds the (non-zero) rest.
  const uint64_t per = (total + std::max<size_t>(parts, 1) - 1) / std::max<size_t>(parts, 1);
  for (size_t i = 0; i < out.size(); ++i) {
    ASSERT_FALSE(out[i].empty()) << "stripe " << i;
    const uint64_t b = TotalBytes(out[i]);
    ASSERT_GT(b, 0u) << "stripe " << i;
    if (parts > 1) {
      if (i + 1 < out.size()) {
        ASSERT_EQ(b, per) << "stripe " << i;
      } else {
        ASSERT_LE(b, per);
      }
    }
    // parts <= 1 passes the list through untouched; splitting drops empties.
    if (parts > 1) {
      for (const auto& s : out[i]) ASSERT_GT(s.size, 0u) << "stripe " << i;
    }
  }
  // As many stripes as the byte count allows: never fewer than needed.
  if (parts > 1) {
    ASSERT_EQ(out.size(), (total + per - 1) / per);
  }
}

// The XGMI kernel's list: several transfers' segments back to back, the
// copy split into ranges that cross list boundaries and skip empty lists.
TEST(CopyBackToBackTest, ConcatenatesAcrossRangesAndEmptyLists) {
  std::mt19937_64 rng(5);
  const std::vector<std::vector<size_t>> shapes = {
      {3000, 1500, 10}, {2048, 0, 3000},      {0, 0, 5000, 0}, {1}, {}, {0}, {4096}, {2047, 1, 2048, 2049, 0, 7000},
      {100, 100, 100},  {20000, 13, 0, 30000}};
  for (const std::vector<size_t>& shape : shapes) {
    std::vector<std::vector<Segment>> owned;
    std::vector<SegmentSpan> lists;
    std::vector<Segment> want;
    for (size_t n : shape) {
      owned.emplace_back();
      for (size_t i = 0; i < n; ++i) owned.back().push_back({rng(), rng(), rng()});
      want.insert(want.end(), owned.back().begin(), owned.back().end());
    }
    for (const auto& l : owned) lists.push_back(l);
    std::vector<Segment> got(want.size() + 1, Segment{7, 7, 7});  // one past the end: must stay untouched
    ASSERT_EQ(CopyBackToBack(lists, got.data()), want.size());
    ASSERT_EQ(got.back(), (Segment{7, 7, 7})) << "wrote past the end";
    got.pop_back();
    EXPECT_EQ(got, want) << "shape of " << shape.size() << " lists";
  }
}

TEST(SplitIntoStripesTest, ExactSplitOfOneSegment) {
  const std::vector<Segment> in = {{1000, 5000, 4096}};
  const auto out = SplitIntoStripes(in, TotalBytes(in), 4);
  ASSERT_EQ(out.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    ASSERT_EQ(out[i].size(), 1u);
    EXPECT_EQ(out[i][0].local_off, 1000 + i * 1024);
    EXPECT_EQ(out[i][0].remote_off, 5000 + i * 1024);
    EXPECT_EQ(out[i][0].size, 1024u);
  }
  CheckStripes(in, 4, out);
}

TEST(SplitIntoStripesTest, SplitsAcrossSegmentBoundariesWithCorrectOffsets) {
  // 3 segments of 10, 3 stripes of 10 bytes, but cut at 10/20 only if
  // aligned; use sizes that force mid-segment cuts.
  const std::vector<Segment> in = {{0, 100, 7}, {50, 200, 7}, {90, 300, 7}};  // 21 bytes
  const auto out = SplitIntoStripes(in, TotalBytes(in), 3);                   // 7 each
  ASSERT_EQ(out.size(), 3u);
  const std::vector<Segment> s0 = {{0, 100, 7}}, s1 = {{50, 200, 7}}, s2 = {{90, 300, 7}};
  EXPECT_EQ(out[0], s0);
  EXPECT_EQ(out[1], s1);
  EXPECT_EQ(out[2], s2);

  const auto out2 = SplitIntoStripes(in, TotalBytes(in), 2);  // 11 + 10
  ASSERT_EQ(out2.size(), 2u);
  const std::vector<Segment> a = {{0, 100, 7}, {50, 200, 4}};
  const std::vector<Segment> b = {{54, 204, 3}, {90, 300, 7}};
  EXPECT_EQ(out2[0], a);
  EXPECT_EQ(out2[1], b);
  CheckStripes(in, 2, out2);
}

TEST(SplitIntoStripesTest, FewerBytesThanParts) {
  const std::vector<Segment> in = {{0, 0, 3}};
  const auto out = SplitIntoStripes(in, TotalBytes(in), 8);
  EXPECT_EQ(out.size(), 3u);  // one byte each, no empty stripes
  CheckStripes(in, 8, out);
}

TEST(SplitIntoStripesTest, OnePartOrZeroPartsKeepsTheList) {
  const std::vector<Segment> in = {{0, 0, 3}, {10, 10, 5}};
  for (size_t parts : {0, 1}) {
    const auto out = SplitIntoStripes(in, TotalBytes(in), parts);
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(out[0], in);
  }
}

TEST(SplitIntoStripesTest, EmptyInputGivesOneStripe) {
  // A transfer with no bytes still yields exactly one (empty) request, so the
  // status ends through the normal path.
  const auto out = SplitIntoStripes({}, 0, 4);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(TotalBytes(out[0]), 0u);
}

TEST(SplitIntoStripesTest, ZeroSizeSegmentsDoNotCreateStripes) {
  const std::vector<Segment> in = {{0, 0, 0}, {0, 0, 8}, {100, 100, 0}, {8, 8, 8}, {200, 200, 0}};
  const auto out = SplitIntoStripes(in, TotalBytes(in), 2);
  ASSERT_EQ(out.size(), 2u);
  CheckStripes(in, 2, out);
}

TEST(SplitIntoStripesTest, LargeSizesDoNotOverflow) {
  const uint64_t big = 1ULL << 62;
  const std::vector<Segment> in = {{0, 0, big}, {big, big, big - 1}};
  const auto out = SplitIntoStripes(in, TotalBytes(in), 3);
  ASSERT_EQ(out.size(), 3u);
  uint64_t sum = 0;
  for (const auto& s : out) sum += TotalBytes(s);
  EXPECT_EQ(sum, 2 * big - 1);
  const uint64_t per = (2 * big - 1 + 2) / 3;
  EXPECT_EQ(TotalBytes(out[0]), per);
  EXPECT_EQ(TotalBytes(out[1]), per);
}

TEST(SplitIntoStripesTest, RandomizedProperties) {
  std::mt19937_64 rng(2024);
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<Segment> in;
    const int n = rng() % 40;
    uint64_t lo = 0;
    for (int i = 0; i < n; ++i) {
      const uint64_t sz = rng() % 6 == 0 ? 0 : 1 + rng() % 300;
      in.push_back({lo, rng() % 100000, sz});
      lo += sz + rng() % 3;
    }
    const size_t parts = rng() % 12;
    const auto out = SplitIntoStripes(in, TotalBytes(in), parts);
    CheckStripes(in, parts, out);
    if (HasFatalFailure()) {
      ADD_FAILURE() << "iteration " << iter << " parts " << parts << " segments " << n;
      return;
    }
  }
}

}  // namespace
}  // namespace mori_torch

namespace mori_torch {
namespace {

// A SegmentMemory on the heap that records what it is asked, with a device
// view a fixed distance from the host address (as a mapping would give).
class CountingMemory final : public SegmentMemory {
 public:
  static constexpr uint64_t kViewOffset = uint64_t{1} << 44;
  void* Allocate(size_t bytes, uint64_t* device_view) override {
    if (refuse) return nullptr;
    void* p = ::operator new(bytes, std::align_val_t{64});  // as aligned as a page-aligned block, for the check below
    *device_view = reinterpret_cast<uint64_t>(p) + kViewOffset;
    ++allocated;
    live_bytes += bytes;
    return p;
  }
  void Free(void* block, size_t bytes, uint64_t device_view) override {
    EXPECT_EQ(device_view, reinterpret_cast<uint64_t>(block) + kViewOffset) << "freed with another block's view";
    ++freed;
    live_bytes -= bytes;
    ::operator delete(block, std::align_val_t{64});
  }
  bool refuse = false;
  int allocated = 0;
  int freed = 0;
  int64_t live_bytes = 0;
};

class SegmentMemoryTest : public ::testing::Test {
 protected:
  void TearDown() override { UseSegmentMemory(nullptr); }
};

TEST_F(SegmentMemoryTest, ListsLiveInTheInstalledMemoryWithItsDeviceView) {
  CountingMemory mem;
  {
    SegmentVector heap(100);
    EXPECT_EQ(DeviceViewOf(heap), 0u) << "a heap list has no device view";
    UseSegmentMemory(&mem);
    SegmentVector v(1000);
    ASSERT_EQ(mem.allocated, 1);
    EXPECT_GE(mem.live_bytes, static_cast<int64_t>(1000 * sizeof(Segment)));
    EXPECT_EQ(DeviceViewOf(v), reinterpret_cast<uint64_t>(v.data()) + CountingMemory::kViewOffset);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % 64, 0u) << "entries start on a cache line";
    for (size_t i = 0; i < v.size(); ++i) v[i] = {i, 2 * i, 3 * i};  // the whole room is usable
    v.resize(5000);                                                  // grows: a new block, the old one given back
    EXPECT_EQ(mem.allocated, 2);
    EXPECT_EQ(mem.freed, 1);
    EXPECT_EQ(v[999].remote_off, 1998u);
    EXPECT_TRUE(InCurrentSegmentMemory(v));
    EXPECT_FALSE(InCurrentSegmentMemory(heap));
  }
  EXPECT_EQ(mem.freed, 2);
  EXPECT_EQ(mem.live_bytes, 0);
}

TEST_F(SegmentMemoryTest, ARefusalLeavesTheListOnTheHeap) {
  CountingMemory mem;
  mem.refuse = true;
  UseSegmentMemory(&mem);
  SegmentVector v(64);
  EXPECT_EQ(DeviceViewOf(v), 0u);
  EXPECT_EQ(mem.allocated, 0);
  v.clear();
  v.shrink_to_fit();
  EXPECT_EQ(mem.freed, 0) << "a heap block went to the memory that refused it";
}

TEST_F(SegmentMemoryTest, AListIsFreedWhereItCameFromAfterTheMemoryChanged) {
  CountingMemory first, second;
  UseSegmentMemory(&first);
  auto a = std::make_unique<SegmentVector>(10);
  UseSegmentMemory(&second);
  auto b = std::make_unique<SegmentVector>(10);
  EXPECT_FALSE(InCurrentSegmentMemory(*a));
  UseSegmentMemory(nullptr);
  auto c = std::make_unique<SegmentVector>(10);
  EXPECT_EQ(DeviceViewOf(*c), 0u);
  a.reset();
  b.reset();
  c.reset();
  EXPECT_EQ(first.freed, 1);
  EXPECT_EQ(second.freed, 1);
  EXPECT_EQ(first.live_bytes + second.live_bytes, 0);
}

TEST_F(SegmentMemoryTest, PooledBatchesMoveToTheInstalledMemory) {
  if (!SegmentBatchesPooled()) GTEST_SKIP() << "sanitizer builds pool no batches";
  {
    std::vector<std::shared_ptr<SegmentBatch>> before;
    for (int i = 0; i < 8; ++i) {
      before.push_back(NewSegmentBatch());
      before.back()->segs.resize(256);
    }
  }  // back in the pool, on the heap
  CountingMemory mem;
  UseSegmentMemory(&mem);
  std::vector<std::shared_ptr<SegmentBatch>> after;
  for (int i = 0; i < 8; ++i) {
    after.push_back(NewSegmentBatch());
    EXPECT_TRUE(InCurrentSegmentMemory(after.back()->segs)) << "batch " << i << " kept its heap list";
    after.back()->segs.resize(256);
    EXPECT_NE(DeviceViewOf(after.back()->segs), 0u);
  }
  EXPECT_EQ(mem.allocated, 8);
  UseSegmentMemory(nullptr);
  after.clear();  // pooled, still in `mem` (alive: they are freed there later)
  for (int i = 0; i < 8; ++i) after.push_back(NewSegmentBatch());
  after.clear();
  EXPECT_EQ(mem.freed, 8) << "re-homed to the heap on their next use";
}

}  // namespace
}  // namespace mori_torch

namespace mori_torch {
namespace {

TEST_F(SegmentMemoryTest, APooledListTheMemoryDeclinedIsKeptOnReuse) {
  if (!SegmentBatchesPooled()) GTEST_SKIP() << "sanitizer builds pool no batches";
  CountingMemory mem;
  mem.refuse = true;  // as the pinned memory does for short lists
  UseSegmentMemory(&mem);
  std::vector<const Segment*> before;
  {
    std::vector<std::shared_ptr<SegmentBatch>> taken;
    for (int i = 0; i < 8; ++i) {
      taken.push_back(NewSegmentBatch());
      taken.back()->segs.resize(256);
      before.push_back(taken.back()->segs.data());
    }
  }
  std::vector<std::shared_ptr<SegmentBatch>> again;
  for (int i = 0; i < 8; ++i) {
    again.push_back(NewSegmentBatch());
    EXPECT_GE(again.back()->segs.capacity(), 256u) << "a heap list allocated under this memory was let go";
    EXPECT_NE(std::find(before.begin(), before.end(), again.back()->segs.data()), before.end());
  }
}

}  // namespace
}  // namespace mori_torch
