// WorkCrew: helpers that join a caller's pass over chunks. Every chunk runs
// once, passes from several callers never mix, helpers wake again after
// they slept, a chunk's exception reaches its caller, and the crew stops
// cleanly whatever its helpers were doing.
#include "core/work_crew.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

namespace mori_torch {
namespace {

// Runs `chunks` chunks that each count themselves (and busy-wait `work_us`)
// and checks that every one ran exactly once.
void RunAndCount(WorkCrew& crew, size_t chunks, int work_us = 0) {
  std::unique_ptr<std::atomic<int>[]> runs(new std::atomic<int>[chunks]);
  for (size_t c = 0; c < chunks; ++c) runs[c].store(0);
  crew.Run(chunks, [&](size_t c) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(work_us);
    while (std::chrono::steady_clock::now() < until) {
    }
    runs[c].fetch_add(1);
  });
  for (size_t c = 0; c < chunks; ++c) ASSERT_EQ(runs[c].load(), 1) << "chunk " << c << " of " << chunks;
}

TEST(WorkCrewTest, EveryChunkRunsOnceAndHelpersTakeSome) {
  WorkCrew crew(3, 1000000);
  ASSERT_EQ(crew.helpers(), 3);
  for (int pass = 0; pass < 300; ++pass) RunAndCount(crew, static_cast<size_t>(pass % 40), pass % 3 == 0 ? 20 : 0);
  // Chunks of 20 us on a crew that polls for a second: helpers join.
  EXPECT_GT(crew.ChunksByHelpers(), 0u);
}

TEST(WorkCrewTest, WithoutHelpersTheCallerRunsEverything) {
  WorkCrew crew(0, 0);
  const auto caller = std::this_thread::get_id();
  bool elsewhere = false;
  crew.Run(50, [&](size_t) { elsewhere = elsewhere || std::this_thread::get_id() != caller; });
  EXPECT_FALSE(elsewhere);
  EXPECT_EQ(crew.ChunksByHelpers(), 0u);
}

TEST(WorkCrewTest, SleepingHelpersWakeForTheNextPass) {
  WorkCrew crew(2, 0);  // sleep right after every pass
  for (int pass = 0; pass < 50; ++pass) {
    RunAndCount(crew, 16, 10);
    std::this_thread::sleep_for(std::chrono::microseconds(pass % 5 == 0 ? 2000 : 50));
  }
  EXPECT_GT(crew.ChunksByHelpers(), 0u);
}

TEST(WorkCrewTest, CallersOnSeveralThreadsGetTheirOwnChunksRun) {
  WorkCrew crew(2, 500);
  std::vector<std::thread> callers;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int pass = 0; pass < 200; ++pass) {
        const size_t chunks = 1 + static_cast<size_t>((pass + t) % 24);
        std::vector<std::atomic<int>> runs(chunks);
        crew.Run(chunks, [&](size_t c) { runs[c].fetch_add(1); });
        for (auto& r : runs) failures.fetch_add(r.load() == 1 ? 0 : 1);
      }
    });
  }
  for (auto& c : callers) c.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(WorkCrewTest, AChunksExceptionReachesTheCallerAfterTheOthersRan) {
  WorkCrew crew(3, 1000);
  std::vector<std::atomic<int>> runs(32);
  try {
    crew.Run(runs.size(), [&](size_t c) {
      runs[c].fetch_add(1);
      if (c == 7 || c == 20) throw std::runtime_error("chunk " + std::to_string(c) + " failed");
    });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what == "chunk 7 failed" || what == "chunk 20 failed") << what;
  }
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  RunAndCount(crew, 10);  // and the crew still works
}

TEST(WorkCrewTest, StopsCleanlyWhetherItsHelpersPollOrSleep) {
  for (int i = 0; i < 20; ++i) {
    WorkCrew crew(2, i % 2 == 0 ? 0 : 100000);
    if (i % 4 < 2) RunAndCount(crew, 8);
    if (i % 3 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Helpers that sleep between passes (no polling) wake for every pass: the
// caller's own chunk waits until another thread ran one (a lost wake-up
// would leave it waiting out the 5 s).
TEST(WorkCrewTest, EveryPassWakesASleepingHelper) {
  WorkCrew crew(2, 0);
  for (int pass = 0; pass < 20; ++pass) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the helpers are asleep by now
    const auto caller = std::this_thread::get_id();
    std::atomic<bool> helper_ran{false};
    crew.Run(4, [&](size_t) {
      if (std::this_thread::get_id() != caller) {
        helper_ran.store(true);
        return;
      }
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!helper_ran.load() && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    });
    ASSERT_TRUE(helper_ran.load()) << "pass " << pass;
  }
}

// A helper woken for a pass keeps polling afterwards, also when its caller
// finished the pass alone before the helper ran (waking a sleeping core can
// take longer than a pass): the same call's next pass then finds it awake
// instead of waking it again too late. Two empty chunks make the late case
// the usual one; before the fix such a helper went back to sleep at once.
TEST(WorkCrewTest, AWokenHelperKeepsPolling) {
  for (int attempt = 0; attempt < 5; ++attempt) {
    WorkCrew crew(1, 10000000);  // polls 10 s after a pass
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (crew.Sleepers() != 1 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    ASSERT_EQ(crew.Sleepers(), 1) << "the helper never slept";
    RunAndCount(crew, 2);
    while (crew.Sleepers() != 0 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    ASSERT_EQ(crew.Sleepers(), 0) << "the helper never woke (took a chunk: " << crew.ChunksByHelpers() << ")";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(crew.Sleepers(), 0) << "the helper went back to sleep (took a chunk: " << crew.ChunksByHelpers() << ")";
  }
}

// The polling window after an idle gap between calls: 1.5 gaps within
// [spin, 1 ms]; the configured window after a gap of over 1 ms; never
// polling stays so; a shorter gap (a pass late within a call) lowers it by
// a quarter at most.
TEST(WorkCrewTest, ThePollingWindowFollowsTheGapBetweenCalls) {
  EXPECT_EQ(WorkCrew::NextPollUs(200, 240, 200), 360);
  EXPECT_EQ(WorkCrew::NextPollUs(200, 60, 200), 200);      // never below spin_us
  EXPECT_EQ(WorkCrew::NextPollUs(200, 900, 200), 1000);    // at most 1 ms
  EXPECT_EQ(WorkCrew::NextPollUs(1000, 1500, 200), 200);   // calls far apart
  EXPECT_EQ(WorkCrew::NextPollUs(360, 60, 200), 270);      // a late pass within a call
  EXPECT_EQ(WorkCrew::NextPollUs(0, 240, 0), 0);           // configured never to poll
  EXPECT_EQ(WorkCrew::NextPollUs(5000, 240, 5000), 5000);  // a window above 1 ms stays
  // Steady calls 240 us apart, with a late pass inside each: the window
  // stays above the gap.
  int64_t poll = 200;
  for (int call = 0; call < 20; ++call) {
    poll = WorkCrew::NextPollUs(poll, 240, 200);
    poll = WorkCrew::NextPollUs(poll, 60, 200);
    EXPECT_GT(poll, 240) << "call " << call;
  }
}

// The crew applies it: calls with idle gaps of 150 us between them
// lengthen its window past the configured 10 us (unless every sleep ran
// past 1 ms); a crew that never polls keeps 0.
TEST(WorkCrewTest, HelpersPollThroughTheGapBetweenSteadyCalls) {
  WorkCrew crew(1, 10);
  WorkCrew never(1, 0);
  int64_t longest = 0;
  for (int call = 0; call < 10; ++call) {
    std::this_thread::sleep_for(std::chrono::microseconds(150));  // a loaded machine may sleep far longer
    RunAndCount(crew, 4);
    RunAndCount(crew, 4);  // the same call's next pass
    RunAndCount(never, 4);
    longest = std::max(longest, crew.PollUs());
    EXPECT_LE(crew.PollUs(), 1000);
    EXPECT_EQ(never.PollUs(), 0);
  }
  EXPECT_GT(longest, 10) << "no call's gap lengthened the window";
}

// Without helpers, or in a pass started inside a chunk (which runs alone),
// a throwing chunk does not stop the others either.
TEST(WorkCrewTest, PassesThatRunAloneKeepTheSameContracts) {
  WorkCrew alone(0, 0);
  std::vector<std::atomic<int>> runs(6);
  EXPECT_THROW(alone.Run(runs.size(),
                         [&](size_t c) {
                           runs[c].fetch_add(1);
                           if (c == 1) throw std::runtime_error("chunk 1");
                         }),
               std::runtime_error);
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);

  WorkCrew crew(2, 1000);
  std::vector<std::atomic<int>> inner(8 * 5);
  crew.Run(8, [&](size_t outer) {
    crew.Run(5, [&](size_t c) { inner[outer * 5 + c].fetch_add(1); });  // nested: alone, no deadlock
  });
  for (auto& r : inner) EXPECT_EQ(r.load(), 1);
}

}  // namespace
}  // namespace mori_torch
