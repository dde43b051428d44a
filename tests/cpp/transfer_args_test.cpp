// BuildSegments: the one-pass validation of offsets and sizes (from vectors,
// scalars or raw arrays) and the message it gives for the first bad segment.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/transfer_args.h"
#include "test_util.h"

namespace mori_torch {
namespace {

MemoryDesc Mem(uint64_t size, MemoryId id) {
  MemoryDesc d;
  d.engine_key = "eng";
  d.id = id;
  d.size = size;
  return d;
}

struct Args {
  std::vector<int64_t> lo, ro, sz;
};

StatusCode Build(const Args& a, uint64_t lsize, uint64_t rsize, SegmentBatch* out, std::string* msg) {
  return BuildSegments(a.lo, a.ro, a.sz, Mem(lsize, 1), Mem(rsize, 2), out, msg);
}

using testing_util::ReferenceMerge;

TEST(BuildSegmentsTest, CopiesValidSegmentsInOrderUpToTheLastByte) {
  Args a{{0, 96, 50}, {4, 0, 90}, {4, 4, 10}};
  SegmentBatch out;
  std::string msg;
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::SUCCESS) << msg;
  ASSERT_EQ(out.segs.size(), 3u);
  EXPECT_EQ(out.segs[1].local_off, 96u);   // ends exactly at the local end
  EXPECT_EQ(out.segs[2].remote_off, 90u);  // ends exactly at the remote end
  EXPECT_EQ(out.segs[2].size, 10u);
}

TEST(BuildSegmentsTest, ReportsTheTotalAndTheLargestSegment) {
  Args a{{0, 10, 40}, {0, 20, 60}, {10, 30, 5}};
  SegmentBatch out;
  std::string msg;
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::SUCCESS) << msg;
  EXPECT_EQ(out.total_bytes, 45u);
  EXPECT_EQ(out.max_bytes, 30u);
}

// A pooled batch comes back reset, and a list built into one that held more
// entries before has exactly the new entries (nothing left of the old ones).
TEST(BuildSegmentsTest, APooledBatchIsReusedAndRebuiltExactly) {
  std::string msg;
  const SegmentBatch* first = nullptr;
  {
    std::shared_ptr<SegmentBatch> b = NewSegmentBatch();
    Args big{{0, 8, 16, 24}, {24, 16, 8, 0}, {8, 8, 8, 8}};
    ASSERT_EQ(Build(big, 32, 32, b.get(), &msg), StatusCode::SUCCESS) << msg;
    first = b.get();
  }
  std::shared_ptr<SegmentBatch> again = NewSegmentBatch();
  if (SegmentBatchesPooled()) EXPECT_EQ(again.get(), first);  // the list let go last is taken first
  EXPECT_EQ(again->total_bytes, 0u);
  EXPECT_EQ(again->max_bytes, 0u);
  Args small{{4, 20}, {0, 8}, {2, 4}};
  ASSERT_EQ(Build(small, 32, 32, again.get(), &msg), StatusCode::SUCCESS) << msg;
  ASSERT_EQ(again->segs.size(), 2u);
  EXPECT_EQ(again->segs[0].local_off, 4u);
  EXPECT_EQ(again->segs[1].remote_off, 8u);
  EXPECT_EQ(again->segs[1].size, 4u);
  EXPECT_EQ(again->total_bytes, 6u);
  EXPECT_EQ(again->max_bytes, 4u);
  // Two batches held at once are two lists.
  std::shared_ptr<SegmentBatch> other = NewSegmentBatch();
  EXPECT_NE(other.get(), again.get());
}

TEST(BuildSegmentsTest, AHugeBatchIsNotKeptInThePool) {
  NewSegmentBatch()->segs.resize(size_t{1} << 18);  // above the pool's bound, then let go
  std::vector<std::shared_ptr<SegmentBatch>> taken;
  for (int i = 0; i < 16; ++i) taken.push_back(NewSegmentBatch());
  for (const auto& b : taken) EXPECT_LE(b->segs.capacity(), size_t{1} << 17);
}

TEST(BuildSegmentsTest, ScalarAndRawArraySpans) {
  const int64_t lo = 8, ro = 16, sz = 32;
  SegmentBatch out;
  std::string msg;
  ASSERT_EQ(BuildSegments({&lo, 1}, {&ro, 1}, {&sz, 1}, Mem(64, 1), Mem(64, 2), &out, &msg), StatusCode::SUCCESS);
  ASSERT_EQ(out.segs.size(), 1u);
  EXPECT_EQ(out.segs[0].remote_off, 16u);
  const int64_t arr[] = {0, 1, 2};
  EXPECT_EQ(BuildSegments({arr, 3}, {arr, 3}, {arr, 2}, Mem(64, 1), Mem(64, 2), &out, &msg),
            StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg, "mismatched list lengths: local_offsets has 3, remote_offsets has 3, sizes has 2");
}

TEST(BuildSegmentsTest, NamesTheFirstBadSegment) {
  SegmentBatch out;
  std::string msg;
  // Segment 2 is out of bounds remotely, segment 3 negative: 2 is reported.
  Args a{{0, 0, 0, -1}, {0, 0, 95, 0}, {1, 1, 6, 1}};
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg.rfind("segment 2: remote range out of bounds: offset 95 + size 6", 0), 0u) << msg;
  EXPECT_TRUE(out.segs.empty());
  a = Args{{0, 0}, {0, -7}, {1, 1}};
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg, "negative value in segment 1: local_offset=0, remote_offset=-7, size=1");
  // A single transfer's message carries no segment index.
  a = Args{{101}, {0}, {0}};
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg.rfind("local range out of bounds: offset 101", 0), 0u) << msg;
}

TEST(BuildSegmentsTest, HugeValuesDoNotWrapPastTheBoundsCheck) {
  SegmentBatch out;
  std::string msg;
  const int64_t big = std::numeric_limits<int64_t>::max();
  Args a{{big}, {0}, {big}};
  EXPECT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  a = Args{{0}, {1}, {big}};
  EXPECT_EQ(Build(a, UINT64_MAX, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_NE(msg.find("remote"), std::string::npos) << msg;
  a = Args{{std::numeric_limits<int64_t>::min()}, {0}, {1}};
  EXPECT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
}

// The fast pass must agree with a per-segment reference on random inputs.
TEST(BuildSegmentsTest, RandomizedAgreesWithPerSegmentChecks) {
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 3000; ++iter) {
    const uint64_t lsize = 1 + rng() % 200, rsize = 1 + rng() % 200;
    Args a;
    const int n = rng() % 12;
    int64_t first_bad = -1;
    for (int i = 0; i < n; ++i) {
      const int64_t lo = static_cast<int64_t>(rng() % 220) - (rng() % 50 == 0 ? 300 : 0);
      const int64_t ro = static_cast<int64_t>(rng() % 220);
      const int64_t sz = static_cast<int64_t>(rng() % 40);
      a.lo.push_back(lo);
      a.ro.push_back(ro);
      a.sz.push_back(sz);
      const bool ok = lo >= 0 && static_cast<uint64_t>(lo + sz) <= lsize && static_cast<uint64_t>(ro + sz) <= rsize;
      if (!ok && first_bad < 0) first_bad = i;
    }
    SegmentBatch out;
    std::string msg;
    const StatusCode c = Build(a, lsize, rsize, &out, &msg);
    if (first_bad < 0) {
      ASSERT_EQ(c, StatusCode::SUCCESS) << msg;
      std::vector<Segment> given;
      for (int i = 0; i < n; ++i) {
        given.push_back(
            {static_cast<uint64_t>(a.lo[i]), static_cast<uint64_t>(a.ro[i]), static_cast<uint64_t>(a.sz[i])});
      }
      ASSERT_EQ(out.segs.size(), ReferenceMerge(given).size());  // merged, empty segments dropped
    } else {
      ASSERT_EQ(c, StatusCode::ERR_INVALID_ARGS);
      if (n > 1) ASSERT_NE(msg.find("segment " + std::to_string(first_bad)), std::string::npos) << msg;
    }
  }
}

// One bad value anywhere in a long list (every lane and the tail of the
// vectorized pass) is found and named; huge valid offsets do not wrap.
TEST(BuildSegmentsTest, LongListsFindTheirOneBadSegmentAnywhere) {
  const int n = 1000;
  const uint64_t big = uint64_t{1} << 62;
  for (int pos : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 500, 501, 502, 503, 995, 996, 997, 998, 999}) {
    for (int kind = 0; kind < 4; ++kind) {
      Args a;
      for (int i = 0; i < n; ++i) {
        a.lo.push_back(static_cast<int64_t>(big) + 4096 * static_cast<int64_t>(i));
        a.ro.push_back(4096 * static_cast<int64_t>(n - 1 - i));
        a.sz.push_back(4096);
      }
      if (kind == 0) a.lo[pos] = -4096;
      if (kind == 1) a.sz[pos] = -1;
      if (kind == 2) a.ro[pos] = 4096 * n - 4095;                      // one byte past the remote end
      if (kind == 3) a.lo[pos] = std::numeric_limits<int64_t>::max();  // would wrap if added unchecked
      SegmentBatch out;
      std::string msg;
      ASSERT_EQ(Build(a, big + 4096 * n, 4096 * n, &out, &msg), StatusCode::ERR_INVALID_ARGS)
          << "position " << pos << ", kind " << kind;
      EXPECT_NE(msg.find("segment " + std::to_string(pos)), std::string::npos) << msg;
      EXPECT_TRUE(out.segs.empty());
    }
  }
  Args ok;
  for (int i = 0; i < n; ++i) {
    ok.lo.push_back(static_cast<int64_t>(big) + 4096 * static_cast<int64_t>(i));
    ok.ro.push_back(4096 * static_cast<int64_t>(i));
    ok.sz.push_back(4096);
  }
  SegmentBatch out;
  std::string msg;
  ASSERT_EQ(Build(ok, big + 4096 * n, 4096 * n, &out, &msg), StatusCode::SUCCESS) << msg;
  EXPECT_EQ(out.total_bytes, 4096u * n);
  // Every page continues the previous one on both sides: one segment.
  ASSERT_EQ(out.segs.size(), 1u);
  EXPECT_EQ(out.segs[0].local_off, big);
  EXPECT_EQ(out.segs[0].remote_off, 0u);
  EXPECT_EQ(out.max_bytes, 4096u * n);
}

bool SameSegments(SegmentSpan a, SegmentSpan b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].local_off != b[i].local_off || a[i].remote_off != b[i].remote_off || a[i].size != b[i].size) return false;
  }
  return true;
}

// The list comes back merged: neighbours contiguous on both sides join,
// empty segments go, order stays; the facts are the merged list's.
TEST(BuildSegmentsTest, MergesContiguousNeighboursAndKnowsTheFacts) {
  SegmentBatch out;
  std::string msg;
  ASSERT_EQ(Build(Args{{0, 64, 32}, {96, 0, 64}, {16, 16, 16}}, 128, 128, &out, &msg), StatusCode::SUCCESS) << msg;
  EXPECT_EQ(out.total_bytes, 48u);
  EXPECT_EQ(out.segs.size(), 3u);  // scattered pages
  ASSERT_EQ(Build(Args{{0, 16}, {32, 48}, {16, 16}}, 128, 128, &out, &msg), StatusCode::SUCCESS) << msg;
  ASSERT_EQ(out.segs.size(), 1u);  // the second continues the first on both sides
  EXPECT_EQ(out.segs[0].size, 32u);
  EXPECT_EQ(out.max_bytes, 32u);
  EXPECT_EQ(out.total_bytes, 32u);
  ASSERT_EQ(Build(Args{{0, 16}, {32, 0}, {16, 16}}, 128, 128, &out, &msg), StatusCode::SUCCESS) << msg;
  EXPECT_EQ(out.segs.size(), 2u);  // contiguous locally only
  EXPECT_EQ(out.max_bytes, 16u);
  ASSERT_EQ(Build(Args{{0, 5}, {32, 9}, {16, 0}}, 128, 128, &out, &msg), StatusCode::SUCCESS) << msg;
  ASSERT_EQ(out.segs.size(), 1u);  // an empty segment is dropped
  EXPECT_EQ(out.segs[0].local_off, 0u);
  ASSERT_EQ(Build(Args{{0, 5}, {0, 9}, {0, 0}}, 128, 128, &out, &msg), StatusCode::SUCCESS) << msg;
  EXPECT_TRUE(out.segs.empty());  // nothing but empty segments
  EXPECT_EQ(out.total_bytes, 0u);
  EXPECT_EQ(out.max_bytes, 0u);
  ASSERT_EQ(Build(Args{{}, {}, {}}, 128, 128, &out, &msg), StatusCode::SUCCESS) << msg;
  EXPECT_EQ(out.total_bytes, 0u);
  // A rejected batch leaves no facts behind.
  ASSERT_EQ(Build(Args{{0, 16}, {32, 48}, {16, 200}}, 128, 128, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(out.total_bytes, 0u);
  EXPECT_TRUE(out.segs.empty());
}

TEST(BuildSegmentsTest, RandomizedFactsAgreeWithMergeContiguous) {
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 3000; ++iter) {
    Args a;
    // Short lists, and lists long enough for the vectorized pass's body.
    const int n = iter % 4 == 0 ? static_cast<int>(rng() % 300) : static_cast<int>(rng() % 10);
    // Lists with and without empty segments, with many or few joins.
    const bool with_empties = iter % 3 != 0;
    const uint64_t join_one_in = 2 + iter % 3 * 8;
    for (int i = 0; i < n; ++i) {
      const int64_t sz = with_empties && rng() % 5 == 0 ? 0 : 1 + static_cast<int64_t>(rng() % 16);
      if (i > 0 && rng() % join_one_in == 0) {  // continue the previous segment on one or both sides
        a.lo.push_back(a.lo.back() + a.sz.back());
        a.ro.push_back(rng() % 2 ? a.ro.back() + a.sz.back() : static_cast<int64_t>(rng() % 200));
      } else {
        a.lo.push_back(static_cast<int64_t>(rng() % 200));
        a.ro.push_back(static_cast<int64_t>(rng() % 200));
      }
      a.sz.push_back(sz);
    }
    SegmentBatch out;
    std::string msg;
    ASSERT_EQ(Build(a, 1024, 1024, &out, &msg), StatusCode::SUCCESS) << msg;
    std::vector<Segment> given;
    for (int i = 0; i < n; ++i) {
      given.push_back({static_cast<uint64_t>(a.lo[i]), static_cast<uint64_t>(a.ro[i]), static_cast<uint64_t>(a.sz[i])});
    }
    // Merged when one segment in 8 continues its predecessor or one is
    // empty; else as given.
    int empties = 0, continues = 0;
    for (int i = 0; i < n; ++i) {
      empties += given[i].size == 0;
      continues += i > 0 && given[i - 1].local_off + given[i - 1].size == given[i].local_off &&
                   given[i - 1].remote_off + given[i - 1].size == given[i].remote_off;
    }
    const std::vector<Segment> merged = empties > 0 || continues * 8 >= n ? ReferenceMerge(given) : given;
    EXPECT_TRUE(SameSegments(out.segs, merged)) << "iteration " << iter;
    EXPECT_EQ(out.total_bytes, TotalBytes(given));
    uint64_t largest = 0;
    for (const Segment& m : merged) largest = std::max(largest, m.size);
    EXPECT_EQ(out.max_bytes, largest);
  }
}

// Lists long enough to be checked in chunks on the WorkCrew (4,096 entries
// or more, chunks of 2,048): a join, an empty segment or one bad value right
// at a chunk's edge is seen as in one pass, and the facts add up across
// chunks. A lone join with nothing empty is not worth a merge.
TEST(BuildSegmentsTest, LongListsCheckedInChunksAgreeWithOnePass) {
  std::mt19937_64 rng(23);
  for (int n : {4096, 4097, 6143, 6144, 20000, 70001}) {
    for (int edge : {2047, 2048, 2049, 4095, 4096, n - 1}) {
      Args a;
      for (int i = 0; i < n; ++i) {  // scattered 16-byte pages
        a.lo.push_back(32 * static_cast<int64_t>(rng() % (4 * static_cast<uint64_t>(n))));
        a.ro.push_back(32 * static_cast<int64_t>(i));
        a.sz.push_back(16);
      }
      if (edge >= n) continue;
      a.lo[edge] = a.lo[edge - 1] + 16;  // continues its predecessor on both sides...
      a.ro[edge] = a.ro[edge - 1] + 16;
      if (edge + 1 < n) a.sz[edge + 1] = 0;  // ...and is followed by an empty one
      const uint64_t lsize = 32 * 4 * static_cast<uint64_t>(n) + 64, rsize = 32 * static_cast<uint64_t>(n);
      SegmentBatch out;
      std::string msg;
      ASSERT_EQ(Build(a, lsize, rsize, &out, &msg), StatusCode::SUCCESS) << msg;
      std::vector<Segment> given;
      for (int i = 0; i < n; ++i) {
        given.push_back(
            {static_cast<uint64_t>(a.lo[i]), static_cast<uint64_t>(a.ro[i]), static_cast<uint64_t>(a.sz[i])});
      }
      const bool with_empty = edge + 1 < n;  // else a lone join, not worth a merge
      const std::vector<Segment> merged = with_empty ? ReferenceMerge(given) : given;
      ASSERT_TRUE(SameSegments(out.segs, merged)) << n << " entries, join at " << edge;
      EXPECT_EQ(out.total_bytes, TotalBytes(given));
      EXPECT_EQ(out.max_bytes, with_empty ? 32u : 16u);  // the joined pair
      if (edge + 1 < n) {                                // without the empty segment the one join is left as it is
        Args one = a;
        one.sz[edge + 1] = 16;
        ASSERT_EQ(Build(one, lsize, rsize, &out, &msg), StatusCode::SUCCESS) << msg;
        ASSERT_EQ(out.segs.size(), static_cast<size_t>(n));
        EXPECT_EQ(out.segs[edge].local_off, static_cast<uint64_t>(one.lo[edge]));
        EXPECT_EQ(out.max_bytes, 16u);
        EXPECT_EQ(out.total_bytes, 16u * n);
      }
      for (int kind = 0; kind < 3; ++kind) {
        Args bad = a;
        if (kind == 0) bad.lo[edge] = -1;
        if (kind == 1) bad.sz[edge] = static_cast<int64_t>(rsize);  // past both ends
        if (kind == 2) bad.ro[edge] = static_cast<int64_t>(rsize) - 15;
        ASSERT_EQ(Build(bad, lsize, rsize, &out, &msg), StatusCode::ERR_INVALID_ARGS) << n << " " << edge;
        EXPECT_NE(msg.find("segment " + std::to_string(edge) + ":"), std::string::npos) << msg;
        EXPECT_TRUE(out.segs.empty());
        EXPECT_EQ(out.total_bytes, 0u);
      }
    }
  }
}

// Pages in runs (one in 8 or more continue their predecessor): merged, in
// chunks on the WorkCrew for long lists, runs crossing chunk edges joined.
TEST(BuildSegmentsTest, LongListsOfRunsMergeAcrossChunkEdges) {
  std::mt19937_64 rng(29);
  for (int n : {4096, 6000, 20000, 70001}) {
    Args a;
    int64_t lo = 0, ro = 0;
    for (int i = 0; i < n; ++i) {
      if (rng() % 5 == 0) {  // a new run starts somewhere else: runs of 5 on average
        lo += 4096 * (1 + static_cast<int64_t>(rng() % 3));
        ro = 4096 * static_cast<int64_t>(rng() % static_cast<uint64_t>(n));
      }
      a.lo.push_back(lo);
      a.ro.push_back(ro);
      a.sz.push_back(4096);
      lo += 4096;
      ro += 4096;
    }
    for (int edge : {2047, 2048, 4095, 4096}) {  // a run across a chunk edge
      if (edge + 2 >= n) continue;
      a.lo[edge] = a.lo[edge - 1] + 4096;
      a.ro[edge] = a.ro[edge - 1] + 4096;
    }
    std::vector<Segment> given;
    for (int i = 0; i < n; ++i) {
      given.push_back({static_cast<uint64_t>(a.lo[i]), static_cast<uint64_t>(a.ro[i]), static_cast<uint64_t>(a.sz[i])});
    }
    SegmentBatch out;
    std::string msg;
    ASSERT_EQ(Build(a, uint64_t{1} << 40, uint64_t{1} << 40, &out, &msg), StatusCode::SUCCESS) << msg;
    const std::vector<Segment> merged = ReferenceMerge(given);
    ASSERT_LT(merged.size(), given.size() * 7 / 8);
    EXPECT_TRUE(SameSegments(out.segs, merged)) << n;
    uint64_t largest = 0;
    for (const Segment& m : merged) largest = std::max(largest, m.size);
    EXPECT_EQ(out.max_bytes, largest);
    EXPECT_EQ(out.total_bytes, 4096u * n);
  }
}

}  // namespace
}  // namespace mori_torch
