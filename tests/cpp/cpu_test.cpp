// LockSpinningFirst: it excludes like the mutex it takes and, past its
// spins, still waits until a long holder lets go.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "core/cpu.h"

namespace mori_torch {
namespace {

TEST(LockSpinningFirstTest, ExcludesOtherHoldersLikeTheMutex) {
  std::mutex m;
  int64_t counter = 0;  // unsynchronised but for the lock: TSan sees any race
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        if (i % 2 == 0) {
          LockSpinningFirst(m);
          ++counter;
          m.unlock();
        } else {
          std::lock_guard<std::mutex> lk(m);  // mixed with plain lock() holders
          ++counter;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, 80000);
}

TEST(LockSpinningFirstTest, TakesAFreeMutexAndLeavesItHeld) {
  std::mutex m;
  auto taken_elsewhere = [&] {  // try_lock from another thread (the owner's own is undefined)
    bool took = false;
    std::thread([&] {
      took = m.try_lock();
      if (took) m.unlock();
    }).join();
    return took;
  };
  LockSpinningFirst(m);
  EXPECT_FALSE(taken_elsewhere());
  m.unlock();
  EXPECT_TRUE(taken_elsewhere());
}

TEST(LockSpinningFirstTest, WaitsForAHolderPastItsSpinsAndThenGetsTheLock) {
  std::mutex m;
  std::atomic<bool> held{false}, released{false};
  std::thread holder([&] {
    std::lock_guard<std::mutex> lk(m);
    held = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // far past the spins
    released = true;
  });
  while (!held.load()) std::this_thread::yield();
  LockSpinningFirst(m);
  EXPECT_TRUE(released.load());  // taken only after the holder let go
  m.unlock();
  holder.join();
}

}  // namespace
}  // namespace mori_torch
