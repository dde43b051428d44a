// Inbound completion notices: a transfer's notice appears once all its parts
// arrived, is handed out exactly once, and the table stays bounded.
#include <gtest/gtest.h>

#include <thread>

#include "core/logging.h"
#include "core/notification_table.h"

namespace mori_torch {
namespace {

TEST(NotificationTableTest, PopOnlyAfterLastPartAndOnce) {
  NotificationTable t;
  EXPECT_FALSE(t.Pop("A", 7));
  t.Arrive("A", 7, 3);
  EXPECT_FALSE(t.Pop("A", 7));
  t.Arrive("A", 7, 3);
  EXPECT_FALSE(t.Pop("A", 7));
  EXPECT_EQ(t.CompletedCount(), 0u);
  t.Arrive("A", 7, 3);
  EXPECT_EQ(t.CompletedCount(), 1u);
  EXPECT_TRUE(t.Pop("A", 7));
  EXPECT_FALSE(t.Pop("A", 7));  // pop consumes
  EXPECT_EQ(t.CompletedCount(), 0u);
}

TEST(NotificationTableTest, SinglePartAndZeroTotal) {
  NotificationTable t;
  t.Arrive("A", 1, 1);
  EXPECT_TRUE(t.Pop("A", 1));
  t.Arrive("A", 2, 0);  // treated as one part
  EXPECT_TRUE(t.Pop("A", 2));
  EXPECT_FALSE(t.Pop("A", 2));
}

TEST(NotificationTableTest, InitiatorsAndUidsDoNotMix) {
  NotificationTable t;
  t.Arrive("A", 1, 2);
  t.Arrive("B", 1, 2);
  t.Arrive("A", 2, 2);
  // One part each so far: nothing complete, and parts of different keys
  // never add up.
  EXPECT_FALSE(t.Pop("A", 1));
  EXPECT_FALSE(t.Pop("B", 1));
  EXPECT_FALSE(t.Pop("A", 2));
  t.Arrive("B", 1, 2);
  EXPECT_FALSE(t.Pop("A", 1));
  EXPECT_FALSE(t.Pop("B", 2));
  EXPECT_FALSE(t.Pop("AB", 1));
  EXPECT_TRUE(t.Pop("B", 1));
  EXPECT_FALSE(t.Pop("B", 1));
  t.Arrive("A", 1, 2);
  EXPECT_TRUE(t.Pop("A", 1));
  EXPECT_FALSE(t.Pop("A", 2));
  t.Arrive("A", 2, 2);
  EXPECT_TRUE(t.Pop("A", 2));
  EXPECT_EQ(t.CompletedCount(), 0u);
}

TEST(NotificationTableTest, DuplicatePartsBeyondTotalAreIgnored) {
  NotificationTable t;
  for (int i = 0; i < 10; ++i) t.Arrive("A", 5, 2);
  EXPECT_EQ(t.CompletedCount(), 1u);
  EXPECT_TRUE(t.Pop("A", 5));
  EXPECT_FALSE(t.Pop("A", 5));
  EXPECT_EQ(t.CompletedCount(), 0u);
}

TEST(NotificationTableTest, BoundEvictsOldestUnclaimed) {
  SetLogLevel("error");  // evictions log a warning each
  NotificationTable t(4);
  for (TransferUid u = 0; u < 10; ++u) t.Arrive("A", u, 1);
  EXPECT_EQ(t.CompletedCount(), 4u);
  for (TransferUid u = 0; u < 6; ++u) EXPECT_FALSE(t.Pop("A", u)) << u;
  for (TransferUid u = 6; u < 10; ++u) EXPECT_TRUE(t.Pop("A", u)) << u;
  EXPECT_EQ(t.CompletedCount(), 0u);
  SetLogLevel("warning");
}

TEST(NotificationTableTest, EvictionSkipsAlreadyPoppedNotices) {
  SetLogLevel("error");
  NotificationTable t(4);
  for (TransferUid u = 0; u < 4; ++u) t.Arrive("A", u, 1);
  EXPECT_TRUE(t.Pop("A", 1));  // out of order
  t.Arrive("A", 4, 1);         // 4 live again: no eviction
  EXPECT_EQ(t.CompletedCount(), 4u);
  t.Arrive("B", 5, 1);  // 5 live: evicts the oldest live one, uid 0
  EXPECT_EQ(t.CompletedCount(), 4u);
  EXPECT_FALSE(t.Pop("A", 0));
  EXPECT_TRUE(t.Pop("A", 2));
  EXPECT_TRUE(t.Pop("A", 3));
  EXPECT_TRUE(t.Pop("A", 4));
  EXPECT_TRUE(t.Pop("B", 5));
  EXPECT_EQ(t.CompletedCount(), 0u);
  SetLogLevel("warning");
}

TEST(NotificationTableTest, IncompleteTransfersAreNotEvictedByCompletedOnes) {
  SetLogLevel("error");
  NotificationTable t(2);
  t.Arrive("A", 100, 2);  // half done
  for (TransferUid u = 0; u < 10; ++u) t.Arrive("A", u, 1);
  t.Arrive("A", 100, 2);  // now complete: the newest notice
  EXPECT_TRUE(t.Pop("A", 100));
  SetLogLevel("warning");
}

TEST(NotificationTableTest, StaysBoundedWithInOrderPops) {
  NotificationTable t(1 << 20);
  constexpr TransferUid kN = 100000;
  constexpr TransferUid kLag = 16;
  size_t max_count = 0;
  for (TransferUid u = 0; u < kN; ++u) {
    t.Arrive("A", u, 2);
    t.Arrive("A", u, 2);
    if (u >= kLag) {
      ASSERT_TRUE(t.Pop("A", u - kLag)) << u;
    }
    max_count = std::max(max_count, t.CompletedCount());
  }
  EXPECT_LE(max_count, kLag + 1);
  for (TransferUid u = kN - kLag; u < kN; ++u) EXPECT_TRUE(t.Pop("A", u));
  EXPECT_EQ(t.CompletedCount(), 0u);
}

TEST(NotificationTableTest, StaysBoundedWhenNobodyPops) {
  SetLogLevel("off");
  NotificationTable t(64);
  for (TransferUid u = 0; u < 100000; ++u) t.Arrive("A", u, 1);
  EXPECT_EQ(t.CompletedCount(), 64u);
  EXPECT_TRUE(t.Pop("A", 100000 - 1));
  EXPECT_FALSE(t.Pop("A", 0));
  SetLogLevel("warning");
}

TEST(NotificationTableTest, ConcurrentArrivalsAndPops) {
  NotificationTable t;
  constexpr int kThreads = 4;
  constexpr TransferUid kUids = 5000;
  std::vector<std::thread> ts;
  // Every thread delivers one part of every transfer (parts_total = kThreads),
  // for two initiators.
  for (int i = 0; i < kThreads; ++i) {
    ts.emplace_back([&] {
      for (TransferUid u = 0; u < kUids; ++u) {
        t.Arrive("A", u, kThreads);
        t.Arrive("B", u, kThreads);
      }
    });
  }
  // A popper runs at the same time; each notice must be handed out once.
  std::vector<int> popped_a(kUids, 0);
  std::thread popper([&] {
    for (int pass = 0; pass < 50; ++pass) {
      for (TransferUid u = 0; u < kUids; ++u) {
        if (t.Pop("A", u)) ++popped_a[u];
      }
    }
  });
  for (auto& th : ts) th.join();
  popper.join();
  for (TransferUid u = 0; u < kUids; ++u) {
    if (popped_a[u] == 0) {
      EXPECT_TRUE(t.Pop("A", u)) << u;
    } else {
      EXPECT_EQ(popped_a[u], 1) << u;
    }
    EXPECT_TRUE(t.Pop("B", u)) << u;
    EXPECT_FALSE(t.Pop("A", u));
    EXPECT_FALSE(t.Pop("B", u));
  }
  EXPECT_EQ(t.CompletedCount(), 0u);
}

}  // namespace
}  // namespace mori_torch

namespace mori_torch {
namespace {

// A peer can claim any number of parts for any number of uids: unfinished
// transfers are bounded too, oldest evicted and counted.
TEST(NotificationTableTest, UnfinishedTransfersAreBoundedAndDropsCounted) {
  NotificationTable t(/*max_completed=*/8, /*max_partial=*/4);
  for (TransferUid uid = 0; uid < 1000; ++uid) t.Arrive("attacker", uid, 0xffffffffu);
  EXPECT_EQ(t.PartialCount(), 4u);
  EXPECT_EQ(t.Dropped(), 996u);
  // A legitimate two-part transfer still completes and pops.
  t.Arrive("peer", 7, 2);
  EXPECT_EQ(t.Dropped(), 997u);  // room made by evicting the oldest unfinished one
  t.Arrive("peer", 7, 2);
  EXPECT_TRUE(t.Pop("peer", 7));
  EXPECT_EQ(t.PartialCount(), 3u);
  // Completed notices nobody pops are bounded as before, and counted.
  for (TransferUid uid = 100; uid < 120; ++uid) t.Arrive("peer", uid, 1);
  EXPECT_EQ(t.CompletedCount(), 8u);
  EXPECT_EQ(t.Dropped(), 997u + 12u);
}

}  // namespace
}  // namespace mori_torch
