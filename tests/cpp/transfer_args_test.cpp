// BuildSegments: the one-pass validation of offsets and sizes (from vectors,
// scalars or raw arrays) and the message it gives for the first bad segment.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/transfer_args.h"

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

StatusCode Build(const Args& a, uint64_t lsize, uint64_t rsize, std::vector<Segment>* out, std::string* msg) {
  return BuildSegments(a.lo, a.ro, a.sz, Mem(lsize, 1), Mem(rsize, 2), out, msg);
}

TEST(BuildSegmentsTest, CopiesValidSegmentsInOrderUpToTheLastByte) {
  Args a{{0, 96, 50}, {4, 0, 90}, {4, 4, 10}};
  std::vector<Segment> out;
  std::string msg;
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::SUCCESS) << msg;
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[1].local_off, 96u);   // ends exactly at the local end
  EXPECT_EQ(out[2].remote_off, 90u);  // ends exactly at the remote end
  EXPECT_EQ(out[2].size, 10u);
}

TEST(BuildSegmentsTest, ScalarAndRawArraySpans) {
  const int64_t lo = 8, ro = 16, sz = 32;
  std::vector<Segment> out;
  std::string msg;
  ASSERT_EQ(BuildSegments({&lo, 1}, {&ro, 1}, {&sz, 1}, Mem(64, 1), Mem(64, 2), &out, &msg), StatusCode::SUCCESS);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].remote_off, 16u);
  const int64_t arr[] = {0, 1, 2};
  EXPECT_EQ(BuildSegments({arr, 3}, {arr, 3}, {arr, 2}, Mem(64, 1), Mem(64, 2), &out, &msg),
            StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg, "mismatched list lengths: local_offsets has 3, remote_offsets has 3, sizes has 2");
}

TEST(BuildSegmentsTest, NamesTheFirstBadSegment) {
  std::vector<Segment> out;
  std::string msg;
  // Segment 2 is out of bounds remotely, segment 3 negative: 2 is reported.
  Args a{{0, 0, 0, -1}, {0, 0, 95, 0}, {1, 1, 6, 1}};
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg.rfind("segment 2: remote range out of bounds: offset 95 + size 6", 0), 0u) << msg;
  EXPECT_TRUE(out.empty());
  a = Args{{0, 0}, {0, -7}, {1, 1}};
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg, "negative value in segment 1: local_offset=0, remote_offset=-7, size=1");
  // A single transfer's message carries no segment index.
  a = Args{{101}, {0}, {0}};
  ASSERT_EQ(Build(a, 100, 100, &out, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(msg.rfind("local range out of bounds: offset 101", 0), 0u) << msg;
}

TEST(BuildSegmentsTest, HugeValuesDoNotWrapPastTheBoundsCheck) {
  std::vector<Segment> out;
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
    std::vector<Segment> out;
    std::string msg;
    const StatusCode c = Build(a, lsize, rsize, &out, &msg);
    if (first_bad < 0) {
      ASSERT_EQ(c, StatusCode::SUCCESS) << msg;
      ASSERT_EQ(out.size(), static_cast<size_t>(n));
    } else {
      ASSERT_EQ(c, StatusCode::ERR_INVALID_ARGS);
      if (n > 1) ASSERT_NE(msg.find("segment " + std::to_string(first_bad)), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace mori_torch
