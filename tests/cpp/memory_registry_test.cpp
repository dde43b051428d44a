// Local memory registrations: ids, lookup, bounds checks (overflow included)
// and retirement that waits for running I/O.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <thread>

#include "core/memory_registry.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::Contains;

MemoryDesc Desc(uint64_t data, uint64_t size) {
  MemoryDesc d;
  d.engine_key = "eng";
  d.data = data;
  d.size = size;
  d.loc = MemoryLocationType::CPU;
  return d;
}

TEST(MemoryRegistryTest, IdsCountFromZeroAndAreNotReused) {
  MemoryRegistry r;
  auto a = r.Add(Desc(0x1000, 10));
  auto b = r.Add(Desc(0x2000, 20));
  auto c = r.Add(Desc(0x3000, 30));
  EXPECT_EQ(a->desc.id, 0u);
  EXPECT_EQ(b->desc.id, 1u);
  EXPECT_EQ(c->desc.id, 2u);
  EXPECT_TRUE(r.Remove(1));
  auto d = r.Add(Desc(0x4000, 40));
  EXPECT_EQ(d->desc.id, 3u);  // a removed id is never handed out again
  EXPECT_EQ(d->desc.size, 40u);
  EXPECT_EQ(d->Base(), reinterpret_cast<char*>(0x4000));
}

TEST(MemoryRegistryTest, FindAndRemove) {
  MemoryRegistry r;
  auto a = r.Add(Desc(0x1000, 10));
  auto b = r.Add(Desc(0x2000, 20));
  EXPECT_EQ(r.Find(0), a);
  EXPECT_EQ(r.Find(1), b);
  EXPECT_EQ(r.Find(2), nullptr);
  EXPECT_EQ(r.Find(std::numeric_limits<MemoryId>::max()), nullptr);
  EXPECT_TRUE(r.Remove(0));
  EXPECT_EQ(r.Find(0), nullptr);
  EXPECT_TRUE(a->retired());
  EXPECT_FALSE(b->retired());
  EXPECT_FALSE(r.Remove(0));  // twice
  EXPECT_FALSE(r.Remove(99));
  EXPECT_EQ(r.Find(1), b);
  r.Clear();
  EXPECT_EQ(r.Find(1), nullptr);
  EXPECT_TRUE(b->retired());
}

TEST(CheckRangeTest, InsideAndAtTheEdges) {
  const MemoryDesc d = Desc(0x1000, 100);
  EXPECT_EQ(CheckRange(d, 0, 100, "local"), "");
  EXPECT_EQ(CheckRange(d, 0, 0, "local"), "");
  EXPECT_EQ(CheckRange(d, 99, 1, "local"), "");
  EXPECT_EQ(CheckRange(d, 100, 0, "local"), "");  // empty range at the end
  EXPECT_NE(CheckRange(d, 100, 1, "local"), "");
  EXPECT_NE(CheckRange(d, 101, 0, "local"), "");
  EXPECT_NE(CheckRange(d, 0, 101, "local"), "");
  EXPECT_NE(CheckRange(d, 50, 51, "local"), "");
}

TEST(CheckRangeTest, OverflowCases) {
  const uint64_t kMax = std::numeric_limits<uint64_t>::max();
  const MemoryDesc d = Desc(0x1000, 100);
  // offset + size wraps around to a small number: must still be rejected.
  EXPECT_NE(CheckRange(d, kMax, 2, "remote"), "");
  EXPECT_NE(CheckRange(d, kMax - 50, 60, "remote"), "");
  EXPECT_NE(CheckRange(d, 1, kMax, "remote"), "");
  EXPECT_NE(CheckRange(d, 50, kMax - 49, "remote"), "");
  EXPECT_NE(CheckRange(d, kMax, kMax, "remote"), "");
  EXPECT_NE(CheckRange(d, kMax, 0, "remote"), "");
  // A registration that reaches the top of the address space.
  const MemoryDesc top = Desc(0, kMax);
  EXPECT_EQ(CheckRange(top, kMax - 1, 1, "remote"), "");
  EXPECT_EQ(CheckRange(top, 0, kMax, "remote"), "");
  EXPECT_NE(CheckRange(top, kMax, 1, "remote"), "");
  EXPECT_NE(CheckRange(top, 1, kMax, "remote"), "");
}

TEST(CheckRangeTest, MessageNamesSideValuesAndRegistration) {
  MemoryDesc d = Desc(0x1000, 4096);
  d.id = 17;
  const std::string m = CheckRange(d, 4000, 200, "remote");
  EXPECT_TRUE(Contains(m, "remote")) << m;
  EXPECT_TRUE(Contains(m, "offset 4000")) << m;
  EXPECT_TRUE(Contains(m, "size 200")) << m;
  EXPECT_TRUE(Contains(m, "memory 17")) << m;
  EXPECT_TRUE(Contains(m, "'eng'")) << m;
  EXPECT_TRUE(Contains(m, "4096")) << m;
  const std::string l = CheckRange(d, 18446744073709551615ULL, 1, "local");
  EXPECT_TRUE(Contains(l, "local")) << l;
  EXPECT_TRUE(Contains(l, "18446744073709551615")) << l;
}

TEST(MemoryUseTest, AcquireReleaseAndMove) {
  auto m = std::make_shared<LocalMemory>(Desc(0x1000, 8));
  {
    MemoryUse u(m);
    ASSERT_TRUE(u);
    EXPECT_EQ(u->desc.size, 8u);
    MemoryUse v(std::move(u));
    EXPECT_FALSE(u);  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_TRUE(v);
    MemoryUse w;
    EXPECT_FALSE(w);
    w = std::move(v);
    EXPECT_TRUE(w);
  }
  // All uses released: Retire returns at once.
  const auto t0 = std::chrono::steady_clock::now();
  m->Retire();
  EXPECT_LT(testing_util::MsSince(t0), 100);
  EXPECT_FALSE(MemoryUse(m));
  EXPECT_FALSE(MemoryUse(nullptr));
}

TEST(MemoryUseTest, RetireWaitsForAnInFlightUseOnAnotherThread) {
  MemoryRegistry r;
  auto m = r.Add(Desc(0x1000, 64));
  std::atomic<bool> acquired{false}, release{false};
  std::thread io([&] {
    MemoryUse u(r.Find(0));
    ASSERT_TRUE(u);
    acquired = true;
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  ASSERT_TRUE(testing_util::PollUntil([&] { return acquired.load(); }, 2000));

  std::atomic<bool> removed{false};
  std::thread remover([&] {
    EXPECT_TRUE(r.Remove(0));
    removed = true;
  });
  // While the I/O holds its use, Remove blocks, and new users are refused.
  ASSERT_TRUE(testing_util::PollUntil([&] { return m->retired(); }, 2000));
  EXPECT_FALSE(MemoryUse(m));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(removed.load()) << "Remove returned while a MemoryUse was held";
  EXPECT_EQ(r.Find(0), nullptr);  // already unreachable by lookup

  release = true;
  io.join();
  ASSERT_TRUE(testing_util::PollUntil([&] { return removed.load(); }, 2000));
  remover.join();
  EXPECT_FALSE(MemoryUse(m));
}

TEST(MemoryUseTest, RetireRacingManyUsers) {
  for (int round = 0; round < 50; ++round) {
    auto m = std::make_shared<LocalMemory>(Desc(0x1000, 64));
    std::atomic<bool> stop{false};
    std::atomic<int> inside{0};
    std::atomic<bool> used_after_retire{false};
    std::atomic<bool> retire_done{false};
    std::vector<std::thread> users;
    for (int i = 0; i < 4; ++i) {
      users.emplace_back([&] {
        while (!stop.load()) {
          MemoryUse u(m);
          if (!u) continue;
          ++inside;
          if (retire_done.load()) used_after_retire = true;  // Retire returned while we were inside
          --inside;
        }
      });
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    m->Retire();
    retire_done = true;
    EXPECT_EQ(inside.load(), 0);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    stop = true;
    for (auto& t : users) t.join();
    EXPECT_FALSE(used_after_retire.load()) << "round " << round;
  }
}

TEST(MemoryRegistryTest, RemovalHooksRunAfterRetirementUntilRemoved) {
  MemoryRegistry r;
  auto a = r.Add(Desc(0x1000, 10));
  auto b = r.Add(Desc(0x2000, 20));
  auto c = r.Add(Desc(0x3000, 30));
  std::vector<MemoryId> seen;
  bool retired_when_called = true;
  std::shared_ptr<LocalMemory> watched = a;
  int calls = 0;
  uint64_t token = r.AddRemovalHook([&](const std::vector<std::shared_ptr<LocalMemory>>& retired) {
    ++calls;
    for (const auto& m : retired) {
      seen.push_back(m->desc.id);
      if (m == watched) retired_when_called = watched->retired();
    }
  });
  EXPECT_FALSE(r.Remove(99));  // unknown id: no hook call
  EXPECT_TRUE(r.Remove(a->desc.id));
  EXPECT_TRUE(retired_when_called);
  EXPECT_EQ(seen, std::vector<MemoryId>{0});
  r.RemoveRemovalHook(token);
  EXPECT_TRUE(r.Remove(b->desc.id));  // hook gone: not called
  EXPECT_EQ(seen.size(), 1u);
  EXPECT_EQ(calls, 1);
  auto d = r.Add(Desc(0x4000, 40));
  std::vector<std::vector<MemoryId>> batches;
  r.AddRemovalHook([&](const std::vector<std::shared_ptr<LocalMemory>>& retired) {
    batches.emplace_back();
    for (const auto& m : retired) {
      EXPECT_TRUE(m->retired());
      batches.back().push_back(m->desc.id);
    }
  });
  r.Clear();  // shutdown retires what is left and tells each hook once, about all of it
  ASSERT_EQ(batches.size(), 1u);
  std::sort(batches[0].begin(), batches[0].end());
  EXPECT_EQ(batches[0], (std::vector<MemoryId>{c->desc.id, d->desc.id}));
}

TEST(MemoryRegistryTest, WatchersAreKeptPerEngineAndRefusedOnceRetired) {
  MemoryRegistry r;
  auto m = r.Add(Desc(0x1000, 10));
  EngineDesc a, b;
  a.key = "a";
  a.port = 1;
  b.key = "b";
  EXPECT_EQ(m->AddWatcher(a), LocalMemory::WatchResult::kAdded);
  EXPECT_EQ(m->AddWatcher(b), LocalMemory::WatchResult::kAdded);
  a.port = 2;  // the same engine again, restarted elsewhere: replaced, not doubled
  EXPECT_EQ(m->AddWatcher(a), LocalMemory::WatchResult::kAdded);
  ASSERT_TRUE(r.Remove(m->desc.id));
  EngineDesc late;
  late.key = "late";
  EXPECT_EQ(m->AddWatcher(late), LocalMemory::WatchResult::kRetired);
  auto w = m->Watchers();
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].key, "a");
  EXPECT_EQ(w[0].port, 2);
  EXPECT_EQ(w[1].key, "b");
  // Clear hands back what it retired, watchers and all.
  auto n = r.Add(Desc(0x2000, 10));
  EXPECT_EQ(n->AddWatcher(b), LocalMemory::WatchResult::kAdded);
  auto cleared = r.Clear();
  ASSERT_EQ(cleared.size(), 1u);
  EXPECT_EQ(cleared[0]->Watchers().size(), 1u);
  EXPECT_EQ(n->AddWatcher(a), LocalMemory::WatchResult::kRetired);
}

TEST(MemoryRegistryTest, WatcherListIsBoundedAndRefusesNewcomersWhenFull) {
  MemoryRegistry r;
  auto m = r.Add(Desc(0x1000, 10));
  for (size_t i = 0; i < LocalMemory::kMaxWatchers; ++i) {
    EngineDesc e;
    e.key = "w" + std::to_string(i);
    ASSERT_EQ(m->AddWatcher(e), LocalMemory::WatchResult::kAdded);
  }
  EngineDesc extra;
  extra.key = "one-too-many";
  EXPECT_EQ(m->AddWatcher(extra), LocalMemory::WatchResult::kFull);
  EngineDesc again;
  again.key = "w0";  // a known watcher may still update its entry
  again.port = 7;
  EXPECT_EQ(m->AddWatcher(again), LocalMemory::WatchResult::kAdded);
  EXPECT_EQ(m->Watchers().size(), LocalMemory::kMaxWatchers);
}

}  // namespace
}  // namespace mori_torch
