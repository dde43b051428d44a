// Retry over a fresh connection (core/retry_driver.h) with real faults: two
// TCP engines in this process, the target's connections shut down from
// inside the test while transfers run; every transfer must succeed with the
// right bytes and each completion notice pop exactly once. Also: errors that
// are not the path's are never retried, attempts are bounded and named, and
// the pieces (delay queue, path health, attempt fence, notice dedup) alone.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "core/attempt_fence.h"
#include "core/delay_queue.h"
#include "core/engine.h"
#include "core/failover.h"
#include "core/notification_table.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::Contains;
using testing_util::FillRandom;
using testing_util::PollUntil;
using testing_util::ShutDownInboundSockets;

constexpr size_t kBuf = 16 << 20;
constexpr int kWaitMs = 30000;

// Shuts down the target's inbound connections once, `delay_us` from now,
// from a thread of its own (joined on destruction).
class KillOnce {
 public:
  KillOnce(int port, int delay_us)
      : thread_([this, port, delay_us] {
          std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
          kills_ = ShutDownInboundSockets(port);
        }) {}
  ~KillOnce() { thread_.join(); }
  int kills() {
    thread_.join();
    thread_ = std::thread([] {});
    return kills_;
  }

 private:
  int kills_ = 0;
  std::thread thread_;
};

struct Pair {
  explicit Pair(EngineConfig initiator_cfg = {"127.0.0.1", 0}, BackendConfig tcp = {}) {
    a = std::make_unique<Engine>("retryA", initiator_cfg);
    b = std::make_unique<Engine>("retryB", EngineConfig{"127.0.0.1", 0});
    a->CreateBackend(BackendType::TCP, tcp);
    b->CreateBackend(BackendType::TCP, tcp);
    a->RegisterRemoteEngine(b->Desc());
    b->RegisterRemoteEngine(a->Desc());
    local.assign(kBuf, 0);
    remote.assign(kBuf, 0);
    lm = a->RegisterMemory(reinterpret_cast<uint64_t>(local.data()), kBuf, -1, MemoryLocationType::CPU);
    rm = b->RegisterMemory(reinterpret_cast<uint64_t>(remote.data()), kBuf, -1, MemoryLocationType::CPU);
  }
  ~Pair() {
    a->Shutdown();
    b->Shutdown();
  }
  std::unique_ptr<Engine> a, b;
  std::vector<uint8_t> local, remote;
  MemoryDesc lm, rm;
};

::testing::AssertionResult Succeeds(const StatusPtr& s) {
  StatusCode c = s->WaitFor(kWaitMs);
  if (c == StatusCode::SUCCESS) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << StatusCodeName(c) << ": " << s->Message();
}

bool Same(const uint8_t* a, const uint8_t* b, size_t n) { return std::memcmp(a, b, n) == 0; }

// Every size from one page to 16 MiB (striped over 4 connections), reads and
// writes, engine-level, batched and through a session, each with the
// target's connections shut down once at a random moment (before, during or
// after the transfer: many timings).
TEST(RetryTest, TransfersSurviveKilledConnections) {
  Pair p({"127.0.0.1", 0}, {{"striping_threshold_bytes", 1 << 20}});
  auto session = p.a->CreateSession(p.lm, p.rm);
  ASSERT_TRUE(session);
  std::vector<uint8_t> want(kBuf);
  std::mt19937 rng(7);
  int transfers = 0, kills = 0;
  {
    uint64_t seed = 1;
    for (size_t size : {size_t{4096}, size_t{65536}, size_t{1} << 20, size_t{4} << 20, kBuf}) {
      // Up to about the time the size takes on loopback here.
      std::uniform_int_distribution<int> delay_us(0, 200 + static_cast<int>(size >> 10));
      for (int round = 0; round < 6; ++round, ++seed) {
        const int flavour = round % 3;  // engine, batch, session
        // Write fresh bytes: a stale attempt's bytes would show.
        FillRandom(p.local, seed);
        const TransferUid uid = p.a->AllocateTransferUid();
        StatusPtr st;
        auto kill = std::make_unique<KillOnce>(p.b->Desc().port, delay_us(rng));
        if (flavour == 0) {
          st = p.a->Write(p.lm, 0, p.rm, 0, static_cast<int64_t>(size), uid);
        } else if (flavour == 1) {
          st = p.a->BatchTransfer(false, {p.lm}, {{0, int64_t(size / 2)}}, {p.rm}, {{0, int64_t(size / 2)}},
                                  {{int64_t(size / 2), int64_t(size - size / 2)}}, {int64_t(uid)})[0];
        } else {
          st = session->Write(0, 0, static_cast<int64_t>(size), uid);
        }
        ASSERT_TRUE(Succeeds(st)) << "write of " << size << " bytes, flavour " << flavour;
        kills += kill->kills();
        ASSERT_TRUE(Same(p.remote.data(), p.local.data(), size)) << "write of " << size << " bytes";
        // Exactly one notice, however many attempts it took.
        ASSERT_TRUE(PollUntil([&] { return p.b->PopInboundTransferStatus("retryA", uid); }, 5000)) << uid;
        ASSERT_FALSE(p.b->PopInboundTransferStatus("retryA", uid));

        FillRandom(p.remote, seed + 1000);
        std::memcpy(want.data(), p.remote.data(), size);
        std::memset(p.local.data(), 0, size);
        kill = std::make_unique<KillOnce>(p.b->Desc().port, delay_us(rng));
        st = flavour == 2 ? session->Read(0, 0, static_cast<int64_t>(size), uid + 1000000)
                          : p.a->Read(p.lm, 0, p.rm, 0, static_cast<int64_t>(size), uid + 1000000);
        ASSERT_TRUE(Succeeds(st)) << "read of " << size << " bytes, flavour " << flavour;
        kills += kill->kills();
        ASSERT_TRUE(Same(p.local.data(), want.data(), size)) << "read of " << size << " bytes";
        transfers += 2;
      }
    }
    EXPECT_GT(kills, 0);
  }
  const FailoverCounters f = p.a->Failover();
  EXPECT_GT(f.retry.retries, 0u) << "the killer never hit a transfer: the test proved nothing";
  EXPECT_EQ(f.retry.exhausted, 0u);
  EXPECT_EQ(f.failover.failovers, 0u) << "TCP alone has nothing to fail over to";
  // No notice counted twice, none left over.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(p.b->DroppedNotices(), 0u);
  RecordProperty("transfers", transfers);
  RecordProperty("retries", static_cast<int>(f.retry.retries));
}

// Many transfers in flight at once while connections die.
TEST(RetryTest, ConcurrentTransfersSurviveKilledConnections) {
  Pair p;
  FillRandom(p.local, 42);
  constexpr int kSlots = 64;
  constexpr int64_t kSlot = kBuf / kSlots;
  std::mt19937 rng(3);
  for (int round = 0; round < 10; ++round) {
    std::vector<StatusPtr> st;
    KillOnce kill(p.b->Desc().port, std::uniform_int_distribution<int>(0, 20000)(rng));
    for (int i = 0; i < kSlots; ++i) {
      st.push_back(p.a->Write(p.lm, i * kSlot, p.rm, i * kSlot, kSlot, p.a->AllocateTransferUid()));
    }
    for (auto& s : st) ASSERT_TRUE(Succeeds(s));
    ASSERT_TRUE(Same(p.remote.data(), p.local.data(), kBuf)) << "round " << round;
  }
}

TEST(RetryTest, TargetErrorsAreNotRetried) {
  Pair p;
  p.b->DeregisterMemory(p.rm);
  StatusPtr st = p.a->Write(p.lm, 0, p.rm, 0, 4096, 1);
  ASSERT_EQ(st->WaitFor(kWaitMs), StatusCode::ERR_NOT_FOUND) << st->Message();
  EXPECT_FALSE(Contains(st->Message(), "attempt")) << st->Message();
  EXPECT_EQ(p.a->Failover().retry.retries, 0u);
}

// A listener that accepts connections and resets each at once, as a peer
// whose process keeps crashing would: every attempt's path fails.
class ResettingListener {
 public:
  ResettingListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd_, 64);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] {
      while (true) {
        int c = ::accept(fd_, nullptr, nullptr);
        if (c < 0) return;
        ++accepted_;
        linger l{1, 0};
        ::setsockopt(c, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        ::close(c);
      }
    });
  }
  ~ResettingListener() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }
  int accepted() const { return accepted_.load(); }

 private:
  int fd_ = -1;
  int port_ = 0;
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

// Engine `b`'s descriptor with the port of `l`: connections to it fail.
EngineDesc Through(const Engine& b, const ResettingListener& l) {
  EngineDesc d = b.Desc();
  d.port = l.port();
  return d;
}

TEST(RetryTest, AttemptsAreBoundedAndNamed) {
  EngineConfig cfg{"127.0.0.1", 0};
  cfg.retry.max_attempts = 3;
  Pair p(cfg);
  ResettingListener broken;
  p.a->RegisterRemoteEngine(Through(*p.b, broken));
  StatusPtr st = p.a->Write(p.lm, 0, p.rm, 0, 4096, 1);
  ASSERT_EQ(st->WaitFor(kWaitMs), StatusCode::ERR_BAD_STATE) << st->Message();
  EXPECT_TRUE(Contains(st->Message(), "after 3 attempt(s)")) << st->Message();
  EXPECT_EQ(broken.accepted(), 3);
  const RetryStats r = p.a->Failover().retry;
  EXPECT_EQ(r.retries, 2u);
  EXPECT_EQ(r.exhausted, 1u);
  // The engine works again once the peer does.
  p.a->RegisterRemoteEngine(p.b->Desc());
  ASSERT_TRUE(Succeeds(p.a->Write(p.lm, 0, p.rm, 0, 4096, 2)));
}

TEST(RetryTest, OffMeansAPathFailureFailsTheTransfer) {
  EngineConfig cfg{"127.0.0.1", 0};
  cfg.retry.enabled = cfg.failover.enabled = false;
  Pair p(cfg);
  ResettingListener broken;
  p.a->RegisterRemoteEngine(Through(*p.b, broken));
  StatusPtr st = p.a->Write(p.lm, 0, p.rm, 0, 4096, 1);
  ASSERT_EQ(st->WaitFor(kWaitMs), StatusCode::ERR_BAD_STATE) << st->Message();
  EXPECT_FALSE(Contains(st->Message(), "attempt")) << st->Message();
  EXPECT_EQ(broken.accepted(), 1);
  EXPECT_EQ(p.a->Failover().retry.retries, 0u);
}

TEST(DelayQueueTest, RunsInTimeOrderAndEndsPendingTasksOnStop) {
  DelayQueue q;
  std::mutex mu;
  std::vector<int> ran;
  std::atomic<int> cancelled{0};
  auto task = [&](int id) {
    return [&, id](bool run) {
      if (!run) return void(++cancelled);
      std::lock_guard<std::mutex> lk(mu);
      ran.push_back(id);
    };
  };
  q.After(40, task(2));
  q.After(5, task(1));
  q.After(60000, task(3));
  ASSERT_TRUE(PollUntil(
      [&] {
        std::lock_guard<std::mutex> lk(mu);
        return ran.size() == 2;
      },
      5000));
  q.Stop();
  EXPECT_EQ(ran, (std::vector<int>{1, 2}));
  EXPECT_EQ(cancelled.load(), 1);
  q.After(0, task(4));  // after Stop: ends at once, not run
  EXPECT_EQ(cancelled.load(), 2);
}

TEST(PathHealthTest, DownPathIsProbedWithGrowingPauseAndReturns) {
  FailoverPolicy pol;
  pol.probe_ms = 30;
  pol.probe_max_ms = 1000;
  PathHealth h(pol);
  EXPECT_TRUE(h.Usable("peer", BackendType::RDMA));
  h.Failed("peer", BackendType::RDMA, "QP in error", /*alternative=*/false);
  EXPECT_TRUE(h.Usable("peer", BackendType::RDMA)) << "nothing to fail over to: no switch";
  const uint64_t g0 = h.Generation();
  h.Failed("peer", BackendType::RDMA, "QP in error", true);
  EXPECT_NE(h.Generation(), g0);
  EXPECT_FALSE(h.Usable("peer", BackendType::RDMA));
  EXPECT_TRUE(h.Usable("other", BackendType::RDMA)) << "health is per peer";
  EXPECT_TRUE(h.Usable("peer", BackendType::TCP)) << "and per backend";
  h.Succeeded("peer", BackendType::RDMA);  // not a probe: proves nothing
  EXPECT_EQ(h.Stats().paths_down, 1u);
  ASSERT_TRUE(PollUntil([&] { return h.Usable("peer", BackendType::RDMA); }, 2000));
  EXPECT_FALSE(h.Usable("peer", BackendType::RDMA)) << "one probe at a time";
  // The probe fails: the pause doubles (circuit breaker).
  h.Failed("peer", BackendType::RDMA, "again", true);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(PollUntil([&] { return h.Usable("peer", BackendType::RDMA); }, 2000));
  EXPECT_GE(testing_util::MsSince(t0), 50);
  h.Succeeded("peer", BackendType::RDMA);
  EXPECT_TRUE(h.Usable("peer", BackendType::RDMA));
  const FailoverStats s = h.Stats();
  EXPECT_EQ(s.failovers, 1u);
  EXPECT_EQ(s.returns, 1u);
  EXPECT_EQ(s.probes, 2u);
  EXPECT_EQ(s.paths_down, 0u);
}

TEST(AttemptFenceTest, RetryWaitsForEarlierAttempts) {
  AttemptFence f;
  ASSERT_TRUE(f.Enter("p", 7, 0, DeadlineAfterMs(1000)));
  ASSERT_TRUE(f.Enter("p", 7, 0, DeadlineAfterMs(1000))) << "parts of one attempt write side by side";
  ASSERT_TRUE(f.Enter("p", 8, 1, DeadlineAfterMs(1000))) << "other transfers are not held";
  f.Leave("p", 8, 1);
  EXPECT_FALSE(f.Enter("p", 7, 1, DeadlineAfterMs(30))) << "a retry must not land while attempt 0 writes";
  std::atomic<bool> entered{false};
  std::thread retry([&] { entered = f.Enter("p", 7, 1, DeadlineAfterMs(5000)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  f.Leave("p", 7, 0);
  EXPECT_FALSE(entered.load());
  f.Leave("p", 7, 0);
  retry.join();
  EXPECT_TRUE(entered.load());
  f.Leave("p", 7, 1);
  EXPECT_EQ(f.Active(), 0u);
}

TEST(NoticeDedupTest, EachPartCountsOnceAcrossAttempts) {
  NotificationTable t;
  t.Arrive("A", 1, 2, 0, 0);
  t.Arrive("A", 1, 2, 0, 1);  // the retry's copy of part 0
  EXPECT_FALSE(t.Pop("A", 1));
  t.Arrive("A", 1, 2, 1, 1);
  EXPECT_TRUE(t.Pop("A", 1));
  t.Arrive("A", 1, 2, 0, 2);  // a late copy after the pop: not a new notice
  t.Arrive("A", 1, 2, 1, 2);
  EXPECT_FALSE(t.Pop("A", 1));
  t.Arrive("A", 1, 1, 0, 0);  // the uid used again by a new transfer
  EXPECT_TRUE(t.Pop("A", 1));
}

TEST(NoticeDedupTest, RetryOverAnotherBackendReplacesTheParts) {
  NotificationTable t;
  t.Arrive("A", 5, 4, 0, 0);  // attempt 0: 4 parts, 1 arrived
  t.Arrive("A", 5, 1, 0, 1);  // attempt 1, one part: complete
  EXPECT_TRUE(t.Pop("A", 5));
  EXPECT_EQ(t.PartialCount(), 0u);
}

}  // namespace
}  // namespace mori_torch
