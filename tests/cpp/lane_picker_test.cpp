// LanePicker: back-to-back transfers stay on one stream, concurrent ones
// spread over idle streams, and the counts balance under threads.
#include "backends/xgmi/lane_picker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "base/error.h"

namespace mori_torch {
namespace xgmi {
namespace {

TEST(LanePickerTest, BackToBackTransfersStayOnOneLane) {
  LanePicker p(8);
  const size_t first = p.Take();
  p.Release(first);
  for (int i = 0; i < 100; ++i) {
    const size_t lane = p.Take();
    EXPECT_EQ(lane, first) << "transfer " << i;
    p.Release(lane);
  }
}

TEST(LanePickerTest, TransfersInFlightTogetherGetDistinctIdleLanes) {
  LanePicker p(4);
  std::set<size_t> taken;
  for (int i = 0; i < 4; ++i) taken.insert(p.Take());
  EXPECT_EQ(taken.size(), 4u);
  for (size_t lane = 0; lane < 4; ++lane) EXPECT_EQ(p.InFlight(lane), 1) << "lane " << lane;
}

TEST(LanePickerTest, AllBusyStillGivesALane) {
  LanePicker p(2);
  std::vector<size_t> taken;
  for (int i = 0; i < 5; ++i) taken.push_back(p.Take());
  EXPECT_EQ(p.InFlight(0) + p.InFlight(1), 5);
  for (size_t lane : taken) p.Release(lane);
  EXPECT_EQ(p.InFlight(0) + p.InFlight(1), 0);
}

TEST(LanePickerTest, TheLatestLaneIsReusedOnceItIsIdle) {
  LanePicker p(4);
  const size_t a = p.Take();
  const size_t b = p.Take();  // a busy: another lane, now the latest
  ASSERT_NE(a, b);
  p.Release(b);
  EXPECT_EQ(p.Take(), b);  // the latest, idle again, although a is still busy
  p.Release(b);
  p.Release(a);
  EXPECT_EQ(p.Take(), b);
}

TEST(LanePickerTest, ABusyLatestLaneIsPassedOverForAnIdleOne) {
  LanePicker p(3);
  const size_t a = p.Take();
  const size_t b = p.Take();
  p.Release(a);  // a idle, b (the latest) busy
  const size_t c = p.Take();
  EXPECT_NE(c, b);
  EXPECT_EQ(p.InFlight(c), 1);
}

TEST(LanePickerTest, CountsBalanceUnderThreads) {
  LanePicker p(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&p] {
      for (int i = 0; i < 20000; ++i) {
        const size_t lane = p.Take();
        ASSERT_LT(lane, 4u);
        ASSERT_GE(p.InFlight(lane), 1);
        p.Release(lane);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t lane = 0; lane < 4; ++lane) EXPECT_EQ(p.InFlight(lane), 0) << "lane " << lane;
}

TEST(LanePickerTest, ThreadsTakingAtOnceNeverShareALaneWhileOneIsIdle) {
  constexpr int kThreads = 6;
  LanePicker p(8);
  std::atomic<int> arrived{0};
  std::vector<size_t> got(kThreads);
  for (int round = 0; round < 300; ++round) {
    arrived = 0;
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        got[t] = p.Take();
        arrived.fetch_add(1);
        while (arrived.load() < kThreads) std::this_thread::yield();  // all hold theirs at once
      });
    }
    for (auto& t : threads) t.join();
    const std::set<size_t> distinct(got.begin(), got.end());
    ASSERT_EQ(distinct.size(), static_cast<size_t>(kThreads)) << "round " << round;
    for (size_t lane : got) p.Release(lane);
  }
}

TEST(LanePickerTest, NoLanesIsRefused) { EXPECT_THROW(LanePicker(0), Error); }

}  // namespace
}  // namespace xgmi
}  // namespace mori_torch
