// TransferStatus state machine, waiting, progress hooks, and TransferTracker
// (one status completed from several parts).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "core/transfer_status.h"
#include "core/transfer_tracker.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::MsSince;
using Clock = std::chrono::steady_clock;

TEST(TransferStatusTest, StartsAtInit) {
  TransferStatus s;
  EXPECT_EQ(s.Code(), StatusCode::INIT);
  EXPECT_TRUE(s.Init());
  EXPECT_FALSE(s.InProgress());
  EXPECT_FALSE(s.Succeeded());
  EXPECT_FALSE(s.Failed());
  EXPECT_EQ(s.Message(), "");
}

TEST(TransferStatusTest, EnumValuesMatchMoriIo) {
  EXPECT_EQ(static_cast<int>(StatusCode::SUCCESS), 0);
  EXPECT_EQ(static_cast<int>(StatusCode::INIT), 1);
  EXPECT_EQ(static_cast<int>(StatusCode::IN_PROGRESS), 2);
  EXPECT_EQ(static_cast<int>(StatusCode::ERR_INVALID_ARGS), 11);
  EXPECT_EQ(static_cast<int>(StatusCode::ERR_NOT_FOUND), 12);
  EXPECT_EQ(static_cast<int>(StatusCode::ERR_RDMA_OP), 13);
  EXPECT_EQ(static_cast<int>(StatusCode::ERR_BAD_STATE), 14);
  EXPECT_EQ(static_cast<int>(StatusCode::ERR_GPU_OP), 15);
  EXPECT_FALSE(IsError(StatusCode::IN_PROGRESS));
  EXPECT_TRUE(IsError(StatusCode::ERR_INVALID_ARGS));
  EXPECT_TRUE(IsTerminal(StatusCode::SUCCESS));
  EXPECT_FALSE(IsTerminal(StatusCode::INIT));
}

TEST(TransferStatusTest, UpdateMovesForward) {
  TransferStatus s;
  s.Update(StatusCode::IN_PROGRESS, "queued");
  EXPECT_TRUE(s.InProgress());
  EXPECT_EQ(s.Message(), "queued");
  s.Update(StatusCode::SUCCESS, "done");
  EXPECT_TRUE(s.Succeeded());
  EXPECT_EQ(s.Message(), "done");
  // SUCCESS is final against non-errors.
  s.Update(StatusCode::IN_PROGRESS, "late");
  EXPECT_TRUE(s.Succeeded());
  EXPECT_EQ(s.Message(), "done");
}

TEST(TransferStatusTest, FirstErrorSticks) {
  TransferStatus s;
  s.Update(StatusCode::IN_PROGRESS);
  s.Update(StatusCode::ERR_NOT_FOUND, "first: memory 3 gone");
  EXPECT_TRUE(s.Failed());
  s.Update(StatusCode::SUCCESS, "late success");
  EXPECT_EQ(s.Code(), StatusCode::ERR_NOT_FOUND);
  s.Update(StatusCode::ERR_BAD_STATE, "second error");
  EXPECT_EQ(s.Code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_EQ(s.Message(), "first: memory 3 gone");
  s.Update(StatusCode::IN_PROGRESS, "x");
  EXPECT_EQ(s.Code(), StatusCode::ERR_NOT_FOUND);
}

TEST(TransferStatusTest, SetCodeAndSetMessageAreRaw) {
  TransferStatus s;
  s.Update(StatusCode::ERR_INVALID_ARGS, "bad");
  s.SetCode(StatusCode::SUCCESS);  // user-owned status: raw setter overrides
  EXPECT_EQ(s.Code(), StatusCode::SUCCESS);
  s.SetCode(StatusCode::IN_PROGRESS);
  EXPECT_EQ(s.Code(), StatusCode::IN_PROGRESS);
  s.SetMessage("hello");
  EXPECT_EQ(s.Message(), "hello");
  EXPECT_EQ(s.Code(), StatusCode::IN_PROGRESS);
}

TEST(TransferStatusTest, MakeStatusSetsCodeAndMessage) {
  auto s = MakeStatus();
  EXPECT_EQ(s->Code(), StatusCode::IN_PROGRESS);
  auto e = MakeStatus(StatusCode::ERR_BAD_STATE, "why");
  EXPECT_EQ(e->Code(), StatusCode::ERR_BAD_STATE);
  EXPECT_EQ(e->Message(), "why");
}

TEST(TransferStatusTest, WaitForZeroPollsOnce) {
  TransferStatus s;
  s.Update(StatusCode::IN_PROGRESS);
  int calls = 0;
  s.SetProgressHook([&] { ++calls; });
  const auto t0 = Clock::now();
  EXPECT_EQ(s.WaitFor(0), StatusCode::IN_PROGRESS);
  EXPECT_LT(MsSince(t0), 20);
  EXPECT_EQ(calls, 1);
}

TEST(TransferStatusTest, WaitForTimesOutNearTheDeadline) {
  TransferStatus s;
  s.Update(StatusCode::IN_PROGRESS);
  const auto t0 = Clock::now();
  EXPECT_EQ(s.WaitFor(50), StatusCode::IN_PROGRESS);
  const auto ms = MsSince(t0);
  EXPECT_GE(ms, 45);
  EXPECT_LT(ms, 1000);
}

TEST(TransferStatusTest, WaitForOnTerminalReturnsAtOnce) {
  TransferStatus s;
  s.Update(StatusCode::ERR_BAD_STATE, "x");
  const auto t0 = Clock::now();
  EXPECT_EQ(s.WaitFor(5000), StatusCode::ERR_BAD_STATE);
  EXPECT_EQ(s.WaitFor(-1), StatusCode::ERR_BAD_STATE);
  s.Wait();
  EXPECT_LT(MsSince(t0), 100);
}

TEST(TransferStatusTest, WaitReturnsWhenAnotherThreadCompletes) {
  auto s = MakeStatus();
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    s->Wait();
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(returned.load());
  s->Update(StatusCode::SUCCESS);
  ASSERT_TRUE(testing_util::PollUntil([&] { return returned.load(); }, 2000));
  waiter.join();
  EXPECT_TRUE(s->Succeeded());
}

TEST(TransferStatusTest, WaitForBoundedReturnsEarlyOnCompletion) {
  auto s = MakeStatus();
  std::thread completer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    s->Update(StatusCode::ERR_NOT_FOUND, "gone");
  });
  const auto t0 = Clock::now();
  EXPECT_EQ(s->WaitFor(5000), StatusCode::ERR_NOT_FOUND);
  EXPECT_LT(MsSince(t0), 2000);
  completer.join();
}

TEST(TransferStatusTest, ManyWaitersAllWake) {
  auto s = MakeStatus();
  std::atomic<int> woke{0};
  std::vector<std::thread> ts;
  for (int i = 0; i < 8; ++i) {
    ts.emplace_back([&, i] {
      StatusCode c = (i % 2) ? s->WaitFor(5000) : (s->Wait(), s->Code());
      if (c == StatusCode::SUCCESS) ++woke;
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  s->Update(StatusCode::SUCCESS);
  for (auto& t : ts) t.join();
  EXPECT_EQ(woke.load(), 8);
}

TEST(TransferStatusTest, ProgressHookDrivesCompletionByPolling) {
  auto s = MakeStatus();
  std::atomic<int> polls{0};
  TransferStatus* raw = s.get();
  s->SetProgressHook([&polls, raw] {
    if (++polls == 5) raw->Update(StatusCode::SUCCESS, "done by poll");
  });
  int loops = 0;
  while (!s->Succeeded()) {
    ASSERT_LT(++loops, 100);
  }
  EXPECT_EQ(polls.load(), 5);
  EXPECT_EQ(s->Message(), "done by poll");
  // Once terminal, the hook is no longer run.
  s->Code();
  s->Code();
  EXPECT_EQ(polls.load(), 5);
}

TEST(TransferStatusTest, WaitDrivesAPolledStatus) {
  auto s = MakeStatus();
  std::atomic<int> polls{0};
  TransferStatus* raw = s.get();
  s->SetProgressHook([&polls, raw] {
    if (++polls == 50) raw->Update(StatusCode::SUCCESS);
  });
  const auto t0 = Clock::now();
  EXPECT_EQ(s->WaitFor(5000), StatusCode::SUCCESS);  // nobody else polls: WaitFor must
  EXPECT_LT(MsSince(t0), 2000);
  EXPECT_GE(polls.load(), 50);

  auto s2 = MakeStatus();
  std::atomic<int> polls2{0};
  TransferStatus* raw2 = s2.get();
  s2->SetProgressHook([&polls2, raw2] {
    if (++polls2 == 20) raw2->Update(StatusCode::ERR_GPU_OP, "event failed");
  });
  s2->Wait();
  EXPECT_EQ(s2->Code(), StatusCode::ERR_GPU_OP);
}

TEST(TransferStatusTest, HookNotInstalledOnTerminalStatus) {
  TransferStatus s;
  s.Update(StatusCode::SUCCESS);
  bool ran = false;
  s.SetProgressHook([&] { ran = true; });
  s.Code();
  EXPECT_FALSE(ran);
}

TEST(TransferStatusTest, ConcurrentUpdatesKeepOneError) {
  for (int round = 0; round < 50; ++round) {
    auto s = MakeStatus();
    std::vector<std::thread> ts;
    for (int i = 0; i < 4; ++i) {
      ts.emplace_back([&, i] {
        s->Update(i == 0 ? StatusCode::SUCCESS : StatusCode::ERR_BAD_STATE, "t" + std::to_string(i));
        s->Code();
      });
    }
    for (auto& t : ts) t.join();
    EXPECT_EQ(s->Code(), StatusCode::ERR_BAD_STATE);
    const std::string m = s->Message();
    EXPECT_TRUE(m == "t1" || m == "t2" || m == "t3") << m;
  }
}

// --- TransferTracker ----------------------------------------------------------

TEST(TransferTrackerTest, SuccessOnlyAfterLastPart) {
  auto s = MakeStatus();
  TransferTracker t(s, 4);
  for (int i = 0; i < 3; ++i) {
    t.PartDone(StatusCode::SUCCESS);
    EXPECT_EQ(s->Code(), StatusCode::IN_PROGRESS) << "after part " << i;
  }
  t.PartDone(StatusCode::SUCCESS);
  EXPECT_EQ(s->Code(), StatusCode::SUCCESS);
}

TEST(TransferTrackerTest, FirstErrorWinsAndIsReportedAfterAllParts) {
  auto s = MakeStatus();
  TransferTracker t(s, 4);
  t.PartDone(StatusCode::SUCCESS);
  t.PartDone(StatusCode::ERR_NOT_FOUND, "part 1 failed first");
  EXPECT_EQ(s->Code(), StatusCode::IN_PROGRESS);  // parts 2 and 3 may still touch memory
  t.PartDone(StatusCode::ERR_BAD_STATE, "part 2 failed later");
  EXPECT_EQ(s->Code(), StatusCode::IN_PROGRESS);
  t.PartDone(StatusCode::SUCCESS);
  EXPECT_EQ(s->Code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_EQ(s->Message(), "part 1 failed first");
}

TEST(TransferTrackerTest, SinglePart) {
  auto s = MakeStatus();
  TransferTracker t(s, 1);
  t.PartDone(StatusCode::ERR_INVALID_ARGS, "rejected by target");
  EXPECT_EQ(s->Code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_EQ(s->Message(), "rejected by target");
}

TEST(TransferTrackerTest, ConcurrentParts) {
  for (int round = 0; round < 20; ++round) {
    auto s = MakeStatus();
    constexpr int kThreads = 8, kPerThread = 500;
    auto t = std::make_shared<TransferTracker>(s, kThreads * kPerThread);
    std::atomic<bool> seen_terminal_early{false};
    std::atomic<int> done{0};
    std::vector<std::thread> ts;
    for (int i = 0; i < kThreads; ++i) {
      ts.emplace_back([&, i] {
        for (int k = 0; k < kPerThread; ++k) {
          // Before our own part is reported, the status must not be terminal.
          if (IsTerminal(s->PeekCode())) seen_terminal_early = true;
          const bool fail = (round % 2 == 1) && i == 3 && k == 100;
          t->PartDone(fail ? StatusCode::ERR_BAD_STATE : StatusCode::SUCCESS, fail ? "boom" : "");
          ++done;
        }
      });
    }
    for (auto& th : ts) th.join();
    EXPECT_FALSE(seen_terminal_early.load());
    EXPECT_EQ(done.load(), kThreads * kPerThread);
    if (round % 2 == 1) {
      EXPECT_EQ(s->Code(), StatusCode::ERR_BAD_STATE);
      EXPECT_EQ(s->Message(), "boom");
    } else {
      EXPECT_EQ(s->Code(), StatusCode::SUCCESS);
    }
  }
}

}  // namespace
}  // namespace mori_torch
