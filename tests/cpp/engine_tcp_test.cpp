// Two engines in one process over the TCP backend on 127.0.0.1: every
// transfer flavour at several sizes with byte-exact verification against a
// model of both buffers, completion notices, argument errors, target-side
// bounds checks, shutdown with transfers in flight and WaitAll.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "backends/tcp/tcp_notices.h"
#include "core/engine.h"
#include "core/event_loop.h"
#include "core/logging.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::CatchError;
using testing_util::Contains;
using testing_util::FillRandom;
using testing_util::MsSince;
using testing_util::PollUntil;

constexpr size_t kBuf = 8 << 20;
constexpr size_t kSmallBuf = 1 << 20;
constexpr int kWaitMs = 20000;  // generous bound: nothing may hang

// Where the first mismatch is, for readable failures on multi-MiB buffers.
::testing::AssertionResult SameBytes(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size " << got.size() << " vs " << want.size();
  if (std::memcmp(got.data(), want.data(), got.size()) == 0) return ::testing::AssertionSuccess();
  size_t i = 0;
  while (got[i] == want[i]) ++i;
  size_t n = 0;
  for (size_t k = i; k < got.size(); ++k) n += got[k] != want[k];
  return ::testing::AssertionFailure() << "first mismatch at byte " << i << " (got " << int(got[i]) << ", want "
                                       << int(want[i]) << "), " << n << " bytes differ";
}

::testing::AssertionResult Ends(const StatusPtr& s, StatusCode want) {
  if (!s) return ::testing::AssertionFailure() << "null status";
  StatusCode c = s->WaitFor(kWaitMs);
  if (c == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "status " << StatusCodeName(c) << " (want " << StatusCodeName(want)
                                       << "): " << s->Message();
}

// The status must already be terminal with `want` when the call returns.
::testing::AssertionResult FailedAtOnce(const StatusPtr& s, StatusCode want) {
  if (!s) return ::testing::AssertionFailure() << "null status";
  StatusCode c = s->PeekCode();
  if (c == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "status " << StatusCodeName(c) << " right after the call (want "
                                       << StatusCodeName(want) << "): " << s->Message();
}

// A transfer's segments as the three lists the API takes.
struct Lists {
  std::vector<int64_t> lo, ro, sz;
  void Add(int64_t l, int64_t r, int64_t s) {
    lo.push_back(l);
    ro.push_back(r);
    sz.push_back(s);
  }
};

// 1,000 segments of 4 KiB: local slots in order, remote slots shuffled and
// spaced 8 KiB apart (the gaps must stay untouched).
Lists ShuffledSegments(uint64_t seed, int64_t local_base, int64_t remote_base, bool shuffle_local) {
  constexpr int kSegs = 1000;
  constexpr int64_t kSeg = 4096;
  std::vector<int64_t> slots(kSegs);
  std::iota(slots.begin(), slots.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<int64_t> lslots(kSegs);
  std::iota(lslots.begin(), lslots.end(), 0);
  if (shuffle_local) std::shuffle(lslots.begin(), lslots.end(), rng);
  Lists l;
  for (int i = 0; i < kSegs; ++i) l.Add(local_base + lslots[i] * kSeg, remote_base + slots[i] * 2 * kSeg, kSeg);
  return l;
}

class EngineTcpTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    a_ = std::make_unique<Engine>("A", EngineConfig{"127.0.0.1", 0});
    b_ = std::make_unique<Engine>("B", EngineConfig{"127.0.0.1", 0});
    const BackendConfig cfg{{"num_data_conns", GetParam()}};
    a_->CreateBackend(BackendType::TCP, cfg);
    b_->CreateBackend(BackendType::TCP, cfg);
    a_->RegisterRemoteEngine(b_->Desc());
    b_->RegisterRemoteEngine(a_->Desc());
    abuf_.resize(kBuf);
    bbuf_.resize(kBuf);
    a2_.resize(kSmallBuf);
    b2_.resize(kSmallBuf);
    FillRandom(abuf_, 1);
    FillRandom(bbuf_, 2);
    FillRandom(a2_, 3);
    FillRandom(b2_, 4);
    want_a_ = abuf_;
    want_b_ = bbuf_;
    want_a2_ = a2_;
    want_b2_ = b2_;
    amem_ = Reg(*a_, abuf_);
    bmem_ = Reg(*b_, bbuf_);
    amem2_ = Reg(*a_, a2_);
    bmem2_ = Reg(*b_, b2_);
  }

  void TearDown() override {
    // Engines first: their threads may still reference the buffers.
    a_.reset();
    b_.reset();
  }

  static MemoryDesc Reg(Engine& e, std::vector<uint8_t>& buf) {
    return e.RegisterMemory(reinterpret_cast<uint64_t>(buf.data()), static_cast<int64_t>(buf.size()), -1,
                            MemoryLocationType::CPU);
  }

  // Applies a write (local -> remote) or read (remote -> local) to the model.
  static void Model(bool is_read, std::vector<uint8_t>& local, std::vector<uint8_t>& remote, const Lists& l) {
    for (size_t i = 0; i < l.sz.size(); ++i) {
      if (is_read) {
        std::memcpy(&local[l.lo[i]], &remote[l.ro[i]], l.sz[i]);
      } else {
        std::memcpy(&remote[l.ro[i]], &local[l.lo[i]], l.sz[i]);
      }
    }
  }

  // The destination must differ from the source before the transfer, so that
  // success cannot come from stale equal bytes.
  static void ExpectDestinationDiffers(bool is_read, const std::vector<uint8_t>& local,
                                       const std::vector<uint8_t>& remote, const Lists& l) {
    size_t differing = 0;
    for (size_t i = 0; i < l.sz.size(); ++i) {
      differing += std::memcmp(&local[l.lo[i]], &remote[l.ro[i]], l.sz[i]) != 0;
    }
    EXPECT_EQ(differing, l.sz.size()) << (is_read ? "read" : "write") << ": some destinations already equal";
  }

  void ExpectModel() {
    EXPECT_TRUE(SameBytes(abuf_, want_a_)) << "engine A buffer";
    EXPECT_TRUE(SameBytes(bbuf_, want_b_)) << "engine B buffer";
    EXPECT_TRUE(SameBytes(a2_, want_a2_)) << "engine A second buffer";
    EXPECT_TRUE(SameBytes(b2_, want_b2_)) << "engine B second buffer";
  }

  // The target (B) hands out the notice of (A, uid) exactly once.
  void ExpectNoticeOnce(TransferUid uid) {
    EXPECT_TRUE(PollUntil([&] { return b_->PopInboundTransferStatus("A", uid); }, 2000))
        << "no inbound notice on B for uid " << uid;
    EXPECT_FALSE(b_->PopInboundTransferStatus("A", uid)) << "notice for uid " << uid << " popped twice";
    EXPECT_FALSE(a_->PopInboundTransferStatus("B", uid)) << "the initiator got a notice for its own transfer";
  }

  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> abuf_, bbuf_, a2_, b2_;
  std::vector<uint8_t> want_a_, want_b_, want_a2_, want_b2_;
  MemoryDesc amem_, bmem_, amem2_, bmem2_;
};

const int64_t kSizes[] = {8, 8 << 10, 4 << 20};

TEST_P(EngineTcpTest, EngineWriteAndReadAtEverySize) {
  for (int64_t size : kSizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    Lists w;
    w.Add(13, 4096 + 7, size);  // odd offsets on purpose
    ExpectDestinationDiffers(false, abuf_, bbuf_, w);
    const TransferUid uw = a_->AllocateTransferUid();
    ASSERT_TRUE(Ends(a_->Write(amem_, w.lo[0], bmem_, w.ro[0], size, uw), StatusCode::SUCCESS));
    Model(false, want_a_, want_b_, w);
    ExpectModel();
    ExpectNoticeOnce(uw);

    Lists r;
    r.Add(kBuf - size - 3, kBuf - size - 1, size);  // near the end of both buffers
    ExpectDestinationDiffers(true, abuf_, bbuf_, r);
    const TransferUid ur = a_->AllocateTransferUid();
    ASSERT_TRUE(Ends(a_->Read(amem_, r.lo[0], bmem_, r.ro[0], size, ur), StatusCode::SUCCESS));
    Model(true, want_a_, want_b_, r);
    ExpectModel();
    ExpectNoticeOnce(ur);
    FillRandom(abuf_, 100 + size);  // fresh data for the next size
    want_a_ = abuf_;
  }
}

TEST_P(EngineTcpTest, SessionReadWriteAtEverySize) {
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  EXPECT_TRUE(sess->Alive());
  EXPECT_EQ(sess->backend_type(), BackendType::TCP);
  EXPECT_EQ(sess->local_desc(), amem_);
  EXPECT_EQ(sess->remote_desc(), bmem_);
  for (int64_t size : kSizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    Lists w;
    w.Add(kBuf - size, 0, size);  // ends exactly at the end of the local buffer
    ExpectDestinationDiffers(false, abuf_, bbuf_, w);
    const TransferUid uw = sess->AllocateTransferUid();
    ASSERT_TRUE(Ends(sess->Write(w.lo[0], w.ro[0], size, uw), StatusCode::SUCCESS));
    Model(false, want_a_, want_b_, w);
    ExpectModel();
    ExpectNoticeOnce(uw);

    Lists r;
    r.Add(0, kBuf - size, size);  // ends exactly at the end of the remote buffer
    ExpectDestinationDiffers(true, abuf_, bbuf_, r);
    const TransferUid ur = sess->AllocateTransferUid();
    ASSERT_TRUE(Ends(sess->Read(r.lo[0], r.ro[0], size, ur), StatusCode::SUCCESS));
    Model(true, want_a_, want_b_, r);
    ExpectModel();
    ExpectNoticeOnce(ur);
    FillRandom(bbuf_, 200 + size);
    want_b_ = bbuf_;
  }
}

TEST_P(EngineTcpTest, SessionBatchOfShuffledSegments) {
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  // Write 1,000 x 4 KiB to shuffled remote slots.
  Lists w = ShuffledSegments(7, 3, 100, false);
  ExpectDestinationDiffers(false, abuf_, bbuf_, w);
  const TransferUid uw = sess->AllocateTransferUid();
  ASSERT_TRUE(Ends(sess->BatchWrite(w.lo, w.ro, w.sz, uw), StatusCode::SUCCESS));
  Model(false, want_a_, want_b_, w);
  ExpectModel();
  ExpectNoticeOnce(uw);

  // Read them back, shuffled on both sides, into other local slots.
  FillRandom(bbuf_, 77);
  want_b_ = bbuf_;
  Lists r = ShuffledSegments(8, kBuf / 2 - 4096, 5, true);
  ExpectDestinationDiffers(true, abuf_, bbuf_, r);
  const TransferUid ur = sess->AllocateTransferUid();
  ASSERT_TRUE(Ends(sess->BatchRead(r.lo, r.ro, r.sz, ur), StatusCode::SUCCESS));
  Model(true, want_a_, want_b_, r);
  ExpectModel();
  ExpectNoticeOnce(ur);

  // Batches at each size (a few segments each, contiguous runs included).
  for (int64_t size : kSizes) {
    SCOPED_TRACE("size " + std::to_string(size));
    const int64_t s = std::min<int64_t>(size, kBuf / 4);
    Lists l;
    l.Add(0, s, s);      // these two are contiguous on both sides:
    l.Add(s, 2 * s, s);  // merged into one request
    l.Add(3 * s, 0, s);
    const TransferUid u1 = sess->AllocateTransferUid();
    ASSERT_TRUE(Ends(sess->BatchWrite(l.lo, l.ro, l.sz, u1), StatusCode::SUCCESS));
    Model(false, want_a_, want_b_, l);
    ExpectModel();
    ExpectNoticeOnce(u1);
    FillRandom(bbuf_, 300 + size);
    want_b_ = bbuf_;
    const TransferUid u2 = sess->AllocateTransferUid();
    ASSERT_TRUE(Ends(sess->BatchRead(l.lo, l.ro, l.sz, u2), StatusCode::SUCCESS));
    Model(true, want_a_, want_b_, l);
    ExpectModel();
    ExpectNoticeOnce(u2);
  }
}

TEST_P(EngineTcpTest, EngineBatchTransferOverTwoMemoryPairs) {
  for (bool is_read : {false, true}) {
    SCOPED_TRACE(is_read ? "batch read" : "batch write");
    Lists l0 = ShuffledSegments(is_read ? 21 : 22, 0, 64, is_read);
    Lists l1;
    l1.Add(1, 2, 8);
    l1.Add(4096, 8192, 8 << 10);
    l1.Add(kSmallBuf - 1000, 100000, 1000);
    ExpectDestinationDiffers(is_read, abuf_, bbuf_, l0);
    ExpectDestinationDiffers(is_read, a2_, b2_, l1);
    const int64_t u0 = static_cast<int64_t>(a_->AllocateTransferUid());
    const int64_t u1 = static_cast<int64_t>(a_->AllocateTransferUid());
    auto st = a_->BatchTransfer(is_read, {amem_, amem2_}, {l0.lo, l1.lo}, {bmem_, bmem2_}, {l0.ro, l1.ro},
                                {l0.sz, l1.sz}, {u0, u1});
    ASSERT_EQ(st.size(), 2u);
    ASSERT_TRUE(Ends(st[0], StatusCode::SUCCESS));
    ASSERT_TRUE(Ends(st[1], StatusCode::SUCCESS));
    EXPECT_EQ(Engine::WaitAll(st, 0), StatusCode::SUCCESS);
    Model(is_read, want_a_, want_b_, l0);
    Model(is_read, want_a2_, want_b2_, l1);
    ExpectModel();
    ExpectNoticeOnce(static_cast<TransferUid>(u0));
    ExpectNoticeOnce(static_cast<TransferUid>(u1));
    FillRandom(abuf_, 500);
    FillRandom(bbuf_, 501);
    FillRandom(a2_, 502);
    FillRandom(b2_, 503);
    want_a_ = abuf_;
    want_b_ = bbuf_;
    want_a2_ = a2_;
    want_b2_ = b2_;
  }
  // Empty batch and empty segment lists end with SUCCESS.
  EXPECT_TRUE(a_->BatchTransfer(false, std::vector<MemoryDesc>{}, {}, std::vector<MemoryDesc>{}, {}, {}, {}).empty());
  auto st = a_->BatchTransfer(false, {amem_}, {{}}, {bmem_}, {{}}, {{}}, {99});
  ASSERT_EQ(st.size(), 1u);
  EXPECT_TRUE(Ends(st[0], StatusCode::SUCCESS));
  ExpectModel();
}

TEST_P(EngineTcpTest, ConcurrentTransfersFromSeveralThreads) {
  // Threads own disjoint 1 MiB slices of both buffers and run mixed reads and
  // writes at random sizes; every byte is checked at the end.
  constexpr int kThreads = 4, kOps = 60;
  constexpr size_t kSlice = kBuf / kThreads;
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  std::vector<std::thread> ts;
  std::vector<std::vector<TransferUid>> uids(kThreads);
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      for (int i = 0; i < kOps; ++i) {
        const int64_t size = 1 + rng() % (rng() % 4 == 0 ? kSlice / 2 : 16 << 10);
        const int64_t lo = t * kSlice + rng() % (kSlice - size + 1);
        const int64_t ro = t * kSlice + rng() % (kSlice - size + 1);
        const bool is_read = rng() % 2;
        const bool use_session = rng() % 2;
        const TransferUid uid = a_->AllocateTransferUid();
        StatusPtr s;
        if (use_session) {
          s = is_read ? sess->Read(lo, ro, size, uid) : sess->Write(lo, ro, size, uid);
        } else {
          s = is_read ? a_->Read(amem_, lo, bmem_, ro, size, uid) : a_->Write(amem_, lo, bmem_, ro, size, uid);
        }
        if (s->WaitFor(kWaitMs) != StatusCode::SUCCESS) {
          ++failures;
          ADD_FAILURE() << "thread " << t << " op " << i << ": " << s->Message();
          continue;
        }
        Lists l;
        l.Add(lo, ro, size);
        Model(is_read, want_a_, want_b_, l);  // slices are disjoint: no lock needed
        uids[t].push_back(uid);
      }
    });
  }
  for (auto& th : ts) th.join();
  EXPECT_EQ(failures.load(), 0);
  ExpectModel();
  for (auto& v : uids) {
    for (TransferUid u : v) ExpectNoticeOnce(u);
  }
}

TEST_P(EngineTcpTest, PollingThreadsReceiveSmallResponsesThemselves) {
  // Small transfers of host memory are ended by whoever polls first: the
  // submitting thread's Code() loop, a second thread polling every status,
  // or the event loop. Several in flight per thread, reads and writes;
  // every byte and every notice is checked. Engines whose loops sleep
  // between events (where pollers receive), whatever this machine's CPUs.
  testing_util::ScopedEnv no_spin("MORI_TORCH_LOOP_SPIN_US", "0");
  TearDown();
  SetUp();
  constexpr int kThreads = 3, kRounds = 40, kInFlight = 8;
  constexpr size_t kSlice = kBuf / kThreads;
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  std::mutex shared_mu;
  std::vector<StatusPtr> shared;  // polled by the meddler too
  std::atomic<bool> stop{false};
  std::thread meddler([&] {
    while (!stop.load()) {
      std::vector<StatusPtr> snap;
      {
        std::lock_guard<std::mutex> lk(shared_mu);
        snap = shared;
      }
      for (auto& st : snap) st->Code();
    }
  });
  std::vector<std::thread> ts;
  std::vector<std::vector<TransferUid>> uids(kThreads);
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(2000 + t);
      for (int r = 0; r < kRounds; ++r) {
        // Disjoint ranges within the round: in-flight transfers never overlap.
        const size_t span = kSlice / kInFlight;
        std::vector<StatusPtr> sts;
        Lists l[kInFlight];
        bool reads[kInFlight];
        for (int i = 0; i < kInFlight; ++i) {
          const int64_t size = 1 + rng() % (16 << 10);
          const int64_t lo = t * kSlice + i * span + rng() % (span - size + 1);
          const int64_t ro = t * kSlice + i * span + rng() % (span - size + 1);
          reads[i] = rng() % 2;
          const TransferUid uid = a_->AllocateTransferUid();
          sts.push_back(reads[i] ? sess->Read(lo, ro, size, uid) : sess->Write(lo, ro, size, uid));
          l[i].Add(lo, ro, size);
          uids[t].push_back(uid);
        }
        {
          std::lock_guard<std::mutex> lk(shared_mu);
          shared.insert(shared.end(), sts.begin(), sts.end());
        }
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < kInFlight; ++i) {
          while (!IsTerminal(sts[i]->Code()) && MsSince(t0) < kWaitMs) {
          }
          if (sts[i]->PeekCode() != StatusCode::SUCCESS) {
            ++failures;
            ADD_FAILURE() << "thread " << t << " round " << r << " op " << i << ": " << sts[i]->Message();
            continue;
          }
          Model(reads[i], want_a_, want_b_, l[i]);  // slices are disjoint: no lock needed
        }
      }
    });
  }
  for (auto& th : ts) th.join();
  stop = true;
  meddler.join();
  EXPECT_EQ(failures.load(), 0);
  ExpectModel();
  for (auto& v : uids) {
    for (TransferUid u : v) ExpectNoticeOnce(u);
  }
}

TEST_P(EngineTcpTest, DroppedStatusesDoNotHurt) {
  std::vector<TransferUid> uids;
  Lists l;
  for (int i = 0; i < 200; ++i) {
    uids.push_back(a_->AllocateTransferUid());
    a_->Write(amem_, i * 1000, bmem_, i * 1000, 1000, uids.back());  // status dropped at once
    l.Add(i * 1000, i * 1000, 1000);
  }
  Model(false, want_a_, want_b_, l);
  // Nobody holds the statuses; the target's notices tell when each write
  // has landed.
  for (TransferUid u : uids) ExpectNoticeOnce(u);
  ASSERT_TRUE(Ends(a_->Write(amem_, 0, bmem_, 0, 8, a_->AllocateTransferUid()), StatusCode::SUCCESS));
  ExpectModel();
}

TEST_P(EngineTcpTest, ManySmallSegmentsBeyondIovMax) {
  // 5,000 x 100 B: more iovecs than one sendmsg/recvmsg takes (IOV_MAX 1024)
  // on both sides, unaligned, shuffled on the remote side.
  constexpr int kSegs = 5000, kSeg = 100;
  std::vector<int64_t> slots(kSegs);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(5));
  Lists l;
  for (int i = 0; i < kSegs; ++i) l.Add(1 + i * kSeg, 3 + slots[i] * (kSeg + 1), kSeg);
  for (bool is_read : {false, true}) {
    SCOPED_TRACE(is_read ? "read" : "write");
    FillRandom(is_read ? bbuf_ : abuf_, is_read ? 41 : 42);
    (is_read ? want_b_ : want_a_) = is_read ? bbuf_ : abuf_;
    const TransferUid u = a_->AllocateTransferUid();
    auto st = a_->BatchTransfer(is_read, {amem_}, {l.lo}, {bmem_}, {l.ro}, {l.sz}, {static_cast<int64_t>(u)});
    ASSERT_TRUE(Ends(st.at(0), StatusCode::SUCCESS));
    Model(is_read, want_a_, want_b_, l);
    ExpectModel();
    ExpectNoticeOnce(u);
  }
}

TEST_P(EngineTcpTest, ZeroSizeTransfers) {
  for (int64_t off : {int64_t{0}, int64_t{100}, static_cast<int64_t>(kBuf)}) {
    EXPECT_TRUE(Ends(a_->Write(amem_, off, bmem_, off, 0, 1), StatusCode::SUCCESS)) << off;
    EXPECT_TRUE(Ends(a_->Read(amem_, off, bmem_, off, 0, 2), StatusCode::SUCCESS)) << off;
  }
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  EXPECT_TRUE(Ends(sess->BatchWrite({0, 8}, {0, 8}, {0, 0}, 3), StatusCode::SUCCESS));
  EXPECT_TRUE(Ends(sess->BatchRead({}, {}, {}, 4), StatusCode::SUCCESS));
  ExpectModel();
}

TEST_P(EngineTcpTest, TransfersWithinOneEngine) {
  // The remote memory may be the initiator's own: it loops back over TCP.
  Lists l;
  l.Add(10, 20, 8 << 10);
  l.Add(100000, 500000, 300000);
  auto st = a_->BatchTransfer(false, {amem_}, {l.lo}, {amem2_}, {l.ro}, {l.sz}, {7});
  ASSERT_TRUE(Ends(st.at(0), StatusCode::SUCCESS));
  Model(false, want_a_, want_a2_, l);
  auto sess = a_->CreateSession(amem2_, amem_);
  ASSERT_NE(sess, nullptr);
  Lists r;
  r.Add(0, kBuf - 4096, 4096);
  ASSERT_TRUE(Ends(sess->Read(0, kBuf - 4096, 4096, 8), StatusCode::SUCCESS));
  Model(true, want_a2_, want_a_, r);
  ExpectModel();
  EXPECT_TRUE(PollUntil([&] { return a_->PopInboundTransferStatus("A", 7); }, 2000));
  EXPECT_TRUE(PollUntil([&] { return a_->PopInboundTransferStatus("A", 8); }, 2000));
}

TEST_P(EngineTcpTest, ShutdownWhileOtherThreadsSubmit) {
  std::atomic<bool> stop{false};
  std::vector<std::vector<StatusPtr>> all(3);
  std::vector<std::thread> ts;
  for (int t = 0; t < 3; ++t) {
    ts.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      constexpr int kInFlight = 8;
      while (!stop.load()) {
        const int64_t size = 1 + rng() % (256 << 10);
        // Transfers in flight at once never overlap (each its own slot of
        // the thread's third of the buffers): two serve threads copying
        // into the same bytes would be a data race in the test's memory.
        const int64_t off = t * (kBuf / 3) + static_cast<int64_t>(all[t].size() % kInFlight) * (320 << 10);
        StatusPtr s = (rng() % 2) ? a_->Write(amem_, off, bmem_, off, size, a_->AllocateTransferUid())
                                  : a_->Read(amem_, off, bmem_, off, size, a_->AllocateTransferUid());
        all[t].push_back(s);
        if (s->PeekCode() == StatusCode::ERR_BAD_STATE && Contains(s->Message(), "shut down")) break;
        if (all[t].size() % kInFlight == 0) {  // keep the queues short, and the slots free for the next round
          for (size_t i = all[t].size() - kInFlight; i < all[t].size(); ++i) all[t][i]->WaitFor(10000);
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  a_->Shutdown();
  for (auto& th : ts) th.join();
  stop = true;
  size_t n = 0;
  for (auto& v : all) {
    for (auto& s : v) {
      StatusCode c = s->WaitFor(10000);
      ASSERT_TRUE(IsTerminal(c)) << StatusCodeName(c);
      ++n;
    }
    ASSERT_FALSE(v.empty());
    EXPECT_TRUE(v.back()->Failed());  // each thread saw the shutdown
  }
  EXPECT_GT(n, 3u);
}

TEST_P(EngineTcpTest, SessionAndStatusOutliveTheEngine) {
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  auto s = sess->Write(0, 0, 4 << 20, 1);
  a_.reset();  // engine destroyed with a session and a status still held
  EXPECT_TRUE(IsTerminal(s->WaitFor(10000)));
  EXPECT_FALSE(sess->Alive());
  auto s2 = sess->Write(0, 0, 8, 2);
  EXPECT_TRUE(IsError(s2->WaitFor(10000))) << StatusCodeName(s2->Code());
  sess.reset();
}

// --- argument errors ------------------------------------------------------------

TEST_P(EngineTcpTest, OutOfRangeOffsetsFailAtOnceNamingTheValues) {
  const TransferUid u = a_->AllocateTransferUid();
  auto s = a_->Write(amem_, kBuf - 4, bmem_, 0, 8, u);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS));
  EXPECT_TRUE(Contains(s->Message(), "local")) << s->Message();
  EXPECT_TRUE(Contains(s->Message(), "offset " + std::to_string(kBuf - 4))) << s->Message();
  EXPECT_TRUE(Contains(s->Message(), "size 8")) << s->Message();
  EXPECT_TRUE(Contains(s->Message(), std::to_string(kBuf))) << s->Message();

  s = a_->Read(amem_, 0, bmem_, kBuf, 1, u);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS));
  EXPECT_TRUE(Contains(s->Message(), "remote")) << s->Message();
  EXPECT_TRUE(Contains(s->Message(), "offset " + std::to_string(kBuf))) << s->Message();

  s = a_->Write(amem_, 0, bmem_, 0, static_cast<int64_t>(kBuf) + 1, u);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS));

  s = a_->Write(amem_, -1, bmem_, 0, 8, u);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS));
  EXPECT_TRUE(Contains(s->Message(), "local_offset=-1")) << s->Message();

  s = a_->Write(amem_, 0, bmem_, INT64_MAX, 8, u);  // would wrap without care
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS));
  EXPECT_TRUE(Contains(s->Message(), std::to_string(INT64_MAX))) << s->Message();

  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  s = sess->BatchWrite({0, 0, kBuf - 10}, {0, 100, 0}, {8, 8, 11}, u);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS));
  EXPECT_TRUE(Contains(s->Message(), "segment 2")) << s->Message();
  s = sess->BatchRead({0, 0}, {0}, {8, 8}, u);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS));
  EXPECT_TRUE(Contains(s->Message(), "mismatched")) << s->Message();

  auto st = a_->BatchTransfer(false, {amem_, amem_}, {{0}}, {bmem_, bmem_}, {{0}, {0}}, {{8}, {8}}, {1, 2});
  ASSERT_EQ(st.size(), 2u);
  for (auto& x : st) {
    ASSERT_TRUE(FailedAtOnce(x, StatusCode::ERR_INVALID_ARGS));
    EXPECT_TRUE(Contains(x->Message(), "mismatched list lengths")) << x->Message();
  }
  // Nothing moved, and no notices were produced.
  ExpectModel();
  EXPECT_FALSE(b_->PopInboundTransferStatus("A", u));
}

TEST_P(EngineTcpTest, TwentyFailuresThenASuccess) {
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  for (int i = 0; i < 20; ++i) {
    StatusPtr s;
    switch (i % 4) {
      case 0:
        s = a_->Write(amem_, kBuf, bmem_, 0, 1, i);
        break;
      case 1:
        s = a_->Read(amem_, 0, bmem_, kBuf - 1, 2, i);
        break;
      case 2:
        s = sess->BatchWrite({0, kBuf}, {0, 0}, {1, 1}, i);
        break;
      default: {
        auto st = a_->BatchTransfer(true, {amem_}, {{0, 0}}, {bmem_}, {{0, kBuf}}, {{4, 4}}, {i});
        s = st.at(0);
      }
    }
    ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_INVALID_ARGS)) << "failure " << i;
  }
  Lists l;
  l.Add(100, 200, 64 << 10);
  const TransferUid u = a_->AllocateTransferUid();
  ASSERT_TRUE(Ends(sess->Write(100, 200, 64 << 10, u), StatusCode::SUCCESS));
  Model(false, want_a_, want_b_, l);
  ExpectModel();
  ExpectNoticeOnce(u);
}

TEST_P(EngineTcpTest, UnknownRemoteEngineIsNotFound) {
  MemoryDesc stranger = bmem_;
  stranger.engine_key = "nobody";
  auto s = a_->Write(amem_, 0, stranger, 0, 8, 1);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_NOT_FOUND));
  EXPECT_TRUE(Contains(s->Message(), "'nobody'")) << s->Message();
  auto e = CatchError([&] { a_->CreateSession(amem_, stranger); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);

  // After deregistering B, B's memory is unknown too.
  a_->DeregisterRemoteEngine(b_->Desc());
  s = a_->Write(amem_, 0, bmem_, 0, 8, 2);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_NOT_FOUND));
  auto e2 = CatchError([&] { a_->DeregisterRemoteEngine(b_->Desc()); });
  ASSERT_TRUE(e2.has_value());
  EXPECT_EQ(e2->code(), StatusCode::ERR_NOT_FOUND);
  // And registering again brings it back.
  a_->RegisterRemoteEngine(b_->Desc());
  ASSERT_TRUE(Ends(a_->Write(amem_, 0, bmem_, 0, 8, 3), StatusCode::SUCCESS));
  Lists l;
  l.Add(0, 0, 8);
  Model(false, want_a_, want_b_, l);
  ExpectModel();
}

TEST_P(EngineTcpTest, DeregisteredLocalMemoryIsNotFound) {
  std::vector<uint8_t> extra(64 << 10, 0x5a);
  MemoryDesc m = Reg(*a_, extra);
  auto sess = a_->CreateSession(m, bmem_);
  ASSERT_NE(sess, nullptr);
  ASSERT_TRUE(Ends(sess->Write(0, 0, 16, 1), StatusCode::SUCCESS));
  std::memset(&want_b_[0], 0x5a, 16);
  a_->DeregisterMemory(m);
  auto s = a_->Write(m, 0, bmem_, 0, 8, 2);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_NOT_FOUND));
  EXPECT_TRUE(Contains(s->Message(), "deregistered")) << s->Message();
  s = sess->Write(0, 0, 8, 3);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_NOT_FOUND));
  EXPECT_FALSE(sess->Alive());
  auto e = CatchError([&] { a_->DeregisterMemory(m); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);
  // Deregistered remote memory: the target refuses with NOT_FOUND.
  std::vector<uint8_t> rextra(4096, 1);
  MemoryDesc rm = Reg(*b_, rextra);
  b_->DeregisterMemory(rm);
  s = a_->Write(amem_, 0, rm, 0, 8, 4);
  ASSERT_TRUE(Ends(s, StatusCode::ERR_NOT_FOUND));
  EXPECT_TRUE(Contains(s->Message(), "not registered")) << s->Message();
  auto e2 = CatchError([&] { a_->CreateSession(amem_, rm); });
  ASSERT_TRUE(e2.has_value());
  EXPECT_EQ(e2->code(), StatusCode::ERR_NOT_FOUND);
  ExpectModel();
  EXPECT_EQ(rextra, std::vector<uint8_t>(4096, 1));
}

TEST_P(EngineTcpTest, ForgedOversizedRemoteDescIsRejectedByTheTarget) {
  // B registers only the first half of `guard`; A holds a descriptor claiming
  // the whole thing, so A's own checks pass and the target must refuse.
  constexpr size_t kReal = 32 << 10, kClaimed = 64 << 10;
  std::vector<uint8_t> guard(kClaimed);
  FillRandom(guard, 9);
  const std::vector<uint8_t> guard_orig = guard;
  MemoryDesc real = b_->RegisterMemory(reinterpret_cast<uint64_t>(guard.data()), kReal, -1, MemoryLocationType::CPU);
  MemoryDesc forged = real;
  forged.size = kClaimed;

  struct Case {
    bool is_read;
    Lists l;
  };
  std::vector<Case> cases;
  {
    Case c{false, {}};
    c.l.Add(0, 40 << 10, 8 << 10);  // wholly beyond the registration
    cases.push_back(c);
  }
  {
    Case c{false, {}};
    c.l.Add(0, kReal - 100, 4096);  // straddles the end
    cases.push_back(c);
  }
  {
    Case c{false, {}};  // many good segments and one bad one: nothing may be written
    for (int i = 0; i < 7; ++i) c.l.Add(i * 4096, i * 4096, 4096);
    c.l.Add(0, kClaimed - 8, 8);
    cases.push_back(c);
  }
  {
    Case c{true, {}};  // reads beyond the registration leak nothing
    c.l.Add(1000, kReal, 4096);
    cases.push_back(c);
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    const auto& c = cases[i];
    const TransferUid u = a_->AllocateTransferUid();
    StatusPtr s = c.l.sz.size() == 1 ? (c.is_read ? a_->Read(amem_, c.l.lo[0], forged, c.l.ro[0], c.l.sz[0], u)
                                                  : a_->Write(amem_, c.l.lo[0], forged, c.l.ro[0], c.l.sz[0], u))
                                     : a_->BatchTransfer(c.is_read, {amem_}, {c.l.lo}, {forged}, {c.l.ro}, {c.l.sz},
                                                         {static_cast<int64_t>(u)})[0];
    ASSERT_TRUE(Ends(s, StatusCode::ERR_INVALID_ARGS));
    EXPECT_TRUE(Contains(s->Message(), "rejected by target")) << s->Message();
    EXPECT_TRUE(Contains(s->Message(), "size " + std::to_string(kReal))) << s->Message();
    EXPECT_TRUE(SameBytes(guard, guard_orig));
    ExpectModel();
    EXPECT_FALSE(b_->PopInboundTransferStatus("A", u));
  }
  // The connection stayed in step: a good write to the real range works.
  std::vector<uint8_t> src(abuf_.begin(), abuf_.begin() + kReal);
  ASSERT_TRUE(Ends(a_->Write(amem_, 0, real, 0, kReal, a_->AllocateTransferUid()), StatusCode::SUCCESS));
  EXPECT_EQ(0, std::memcmp(guard.data(), src.data(), kReal));
  EXPECT_EQ(0, std::memcmp(guard.data() + kReal, guard_orig.data() + kReal, kClaimed - kReal));
  // A session validates the descriptor with the owner up front.
  auto e = CatchError([&] { a_->CreateSession(amem_, forged); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);
  b_->DeregisterMemory(real);
}

TEST_P(EngineTcpTest, RemovedBackendEndsWithBadState) {
  auto sess = a_->CreateSession(amem_, bmem_);
  ASSERT_NE(sess, nullptr);
  ASSERT_TRUE(Ends(sess->Write(0, 0, 8, 0), StatusCode::SUCCESS));
  a_->RemoveBackend(BackendType::TCP);
  // A session pinned to the removed backend fails instead of dangling.
  EXPECT_FALSE(sess->Alive());
  EXPECT_TRUE(Ends(sess->Write(0, 0, 8, 1), StatusCode::ERR_BAD_STATE));
  EXPECT_FALSE(a_->HasBackend(BackendType::TCP));
  auto s = a_->Write(amem_, 0, bmem_, 0, 8, 1);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_BAD_STATE));
  EXPECT_TRUE(Contains(s->Message(), "No available backend found")) << s->Message();
  a_->CreateBackend(BackendType::TCP, {{"num_data_conns", GetParam()}});
  ASSERT_TRUE(Ends(a_->Write(amem_, 0, bmem_, 0, 8, 2), StatusCode::SUCCESS));
  Lists l;
  l.Add(0, 0, 8);
  Model(false, want_a_, want_b_, l);
  ExpectModel();
}

// --- shutdown with transfers in flight ------------------------------------------

// Enough traffic that the last transfers are certainly still queued or on the
// wire when shutdown starts: 16 x 8 MiB.
std::vector<StatusPtr> Flood(Engine& e, const MemoryDesc& local, const MemoryDesc& remote) {
  std::vector<StatusPtr> st;
  for (int i = 0; i < 16; ++i) st.push_back(e.Write(local, 0, remote, 0, kBuf, e.AllocateTransferUid()));
  return st;
}

TEST_P(EngineTcpTest, InitiatorShutdownEndsTransfersInFlight) {
  auto st = Flood(*a_, amem_, bmem_);
  const auto t0 = std::chrono::steady_clock::now();
  a_->Shutdown();
  EXPECT_LT(MsSince(t0), 10000);
  for (size_t i = 0; i < st.size(); ++i) {
    StatusCode c = st[i]->WaitFor(5000);
    EXPECT_TRUE(IsTerminal(c)) << "transfer " << i << " still " << StatusCodeName(c);
  }
  EXPECT_TRUE(st.back()->Failed()) << StatusCodeName(st.back()->Code());
  EXPECT_FALSE(st.back()->Message().empty());
  // The engine refuses further work instead of crashing.
  auto s = a_->Write(amem_, 0, bmem_, 0, 8, 1);
  ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_BAD_STATE));
  EXPECT_TRUE(Contains(s->Message(), "shut down")) << s->Message();
  a_->Shutdown();  // idempotent
}

TEST_P(EngineTcpTest, TargetShutdownEndsTransfersInFlight) {
  auto st = Flood(*a_, amem_, bmem_);
  const auto t0 = std::chrono::steady_clock::now();
  b_->Shutdown();
  EXPECT_LT(MsSince(t0), 10000);
  for (size_t i = 0; i < st.size(); ++i) {
    StatusCode c = st[i]->WaitFor(10000);
    EXPECT_TRUE(IsTerminal(c)) << "transfer " << i << " still " << StatusCodeName(c);
  }
  EXPECT_TRUE(st.back()->Failed()) << StatusCodeName(st.back()->Code());
  // Writes into B after its shutdown fail too (connection refused or reset).
  auto s = a_->Write(amem_, 0, bmem_, 0, 8, 1);
  EXPECT_TRUE(Ends(s, StatusCode::ERR_BAD_STATE));
}

TEST_P(EngineTcpTest, DeregisterRemoteEngineEndsTransfersInFlight) {
  auto st = Flood(*a_, amem_, bmem_);
  a_->DeregisterRemoteEngine(b_->Desc());
  for (size_t i = 0; i < st.size(); ++i) {
    StatusCode c = st[i]->WaitFor(10000);
    EXPECT_TRUE(IsTerminal(c)) << "transfer " << i << " still " << StatusCodeName(c);
  }
  EXPECT_TRUE(st.back()->Failed());
}

// A rendezvous directory that sees a peer leave deregisters it with a reason;
// the transfers it ends say so, with ERR_BAD_STATE.
TEST_P(EngineTcpTest, DeregisterRemoteEngineWithReasonNamesItInFailedTransfers) {
  auto st = Flood(*a_, amem_, bmem_);
  a_->DeregisterRemoteEngine(b_->Desc(), "peer left (its directory entry vanished)");
  for (size_t i = 0; i < st.size(); ++i) {
    StatusCode c = st[i]->WaitFor(10000);
    EXPECT_TRUE(IsTerminal(c)) << "transfer " << i << " still " << StatusCodeName(c);
  }
  ASSERT_TRUE(st.back()->Failed());
  EXPECT_EQ(st.back()->Code(), StatusCode::ERR_BAD_STATE) << st.back()->Message();
  EXPECT_TRUE(Contains(st.back()->Message(), "peer left")) << st.back()->Message();
}

TEST_P(EngineTcpTest, DeregisterLocalMemoryWithTransfersInFlight) {
  auto st = Flood(*a_, amem_, bmem_);
  const auto t0 = std::chrono::steady_clock::now();
  a_->DeregisterMemory(amem_);  // waits for the sends using it, stops the rest
  EXPECT_LT(MsSince(t0), 10000);
  for (size_t i = 0; i < st.size(); ++i) {
    StatusCode c = st[i]->WaitFor(10000);
    EXPECT_TRUE(IsTerminal(c)) << "transfer " << i << " still " << StatusCodeName(c);
  }
  EXPECT_EQ(st.back()->Code(), StatusCode::ERR_NOT_FOUND) << st.back()->Message();
  EXPECT_TRUE(FailedAtOnce(a_->Write(amem_, 0, bmem_, 0, 8, 1), StatusCode::ERR_NOT_FOUND));
  // The connections are still good for other memory.
  ASSERT_TRUE(Ends(a_->Write(amem2_, 0, bmem2_, 0, 4096, 2), StatusCode::SUCCESS));
  EXPECT_EQ(0, std::memcmp(a2_.data(), b2_.data(), 4096));
}

TEST_P(EngineTcpTest, PeerRestartOnTheSamePortReconnects) {
  // Open every data connection (a striped write) and the control connection.
  ASSERT_TRUE(Ends(a_->Write(amem_, 0, bmem_, 0, 4 << 20, 1), StatusCode::SUCCESS));
  ASSERT_NE(a_->CreateSession(amem_, bmem_), nullptr);
  const int port = b_->Desc().port;
  b_.reset();  // the target dies; A's idle connections to it are now stale
  b_ = std::make_unique<Engine>("B", EngineConfig{"127.0.0.1", port});
  ASSERT_EQ(b_->Desc().port, port);
  b_->CreateBackend(BackendType::TCP, {{"num_data_conns", GetParam()}});
  b_->RegisterRemoteEngine(a_->Desc());
  std::vector<uint8_t> fresh(kBuf, 0);
  MemoryDesc m = Reg(*b_, fresh);
  EXPECT_EQ(m.id, 0u);
  // Same key, host, port and pid: A's registration still matches. The very
  // first transfers after the restart succeed: stale connections are
  // noticed and reopened, not used for one failing request each.
  a_->RegisterRemoteEngine(b_->Desc());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(Ends(a_->Write(amem_, 0, m, 0, 4 << 20, 10 + i), StatusCode::SUCCESS)) << "write " << i;
  }
  EXPECT_EQ(0, std::memcmp(fresh.data(), abuf_.data(), 4 << 20));
  auto sess = a_->CreateSession(amem_, m);  // control connection reopened too
  ASSERT_NE(sess, nullptr);
  ASSERT_TRUE(Ends(sess->Read(kBuf - 8, 8, 8, 20), StatusCode::SUCCESS));
  EXPECT_EQ(0, std::memcmp(abuf_.data() + kBuf - 8, fresh.data() + 8, 8));
  b_.reset();  // before `fresh` goes away
}

INSTANTIATE_TEST_SUITE_P(DataConns, EngineTcpTest, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int>& p) { return "conns" + std::to_string(p.param); });

// --- engines without backends ---------------------------------------------------

// A read's completion notice waits (notice_delay_us) to ride on the next
// request to the same peer; it must still reach the target: with that
// request, when the delay ends, or when the initiator shuts down.
class ReadNoticeTest : public ::testing::Test {
 protected:
  void Start(int64_t notice_delay_us, BackendConfig more = {}, EngineConfig bcfg = EngineConfig{"127.0.0.1", 0}) {
    a_ = std::make_unique<Engine>("A", EngineConfig{"127.0.0.1", 0});
    b_ = std::make_unique<Engine>("B", bcfg);
    more["notice_delay_us"] = notice_delay_us;
    a_->CreateBackend(BackendType::TCP, more);
    b_->CreateBackend(BackendType::TCP, BackendConfig{});
    a_->RegisterRemoteEngine(b_->Desc());
    abuf_.assign(kBuf, 0);
    bbuf_.resize(kBuf);
    FillRandom(bbuf_, 5);
    amem_ = a_->RegisterMemory(reinterpret_cast<uint64_t>(abuf_.data()), kBuf, -1, MemoryLocationType::CPU);
    bmem_ = b_->RegisterMemory(reinterpret_cast<uint64_t>(bbuf_.data()), kBuf, -1, MemoryLocationType::CPU);
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
  }
  // Reads `size` bytes from B at `off` (into A at the same offset) and checks them.
  void Read(int64_t off, int64_t size, TransferUid uid) {
    ASSERT_TRUE(Ends(a_->Read(amem_, off, bmem_, off, size, uid), StatusCode::SUCCESS));
    ASSERT_EQ(std::memcmp(&abuf_[off], &bbuf_[off], size), 0) << "read of " << size << " bytes at " << off;
  }
  bool Notice(TransferUid uid) { return b_->PopInboundTransferStatus("A", uid); }

  std::unique_ptr<Engine> a_, b_;
  std::vector<uint8_t> abuf_, bbuf_;
  MemoryDesc amem_, bmem_;
};

TEST_F(ReadNoticeTest, HeldNoticesRideOnTheNextRequest) {
  Start(/*notice_delay_us=*/10 * 1000 * 1000);  // never by the timer in this test
  Read(0, 4096, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(Notice(1)) << "the notice was sent at once, not held";
  Read(1 << 20, 4 << 20, 2);  // the next request: read 1's notice rides on it
  EXPECT_TRUE(PollUntil([&] { return Notice(1); }, 2000)) << "the held notice did not ride on the next request";
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(Notice(2)) << "the striped read's notices (one per part) were sent at once, not held";
  // Any request to B takes them along: a write here.
  ASSERT_TRUE(Ends(a_->Write(amem_, 0, bmem_, 6 << 20, 8, 3), StatusCode::SUCCESS));
  EXPECT_TRUE(PollUntil([&] { return Notice(2); }, 2000)) << "the striped read's notices did not ride along";
  EXPECT_TRUE(PollUntil([&] { return Notice(3); }, 2000)) << "the write's own notice";
  EXPECT_FALSE(Notice(1)) << "popped twice";
}

TEST_F(ReadNoticeTest, HeldNoticeLeavesWhenItsDelayEnds) {
  Start(/*notice_delay_us=*/50 * 1000);
  for (TransferUid uid = 1; uid <= 3; ++uid) {
    // Timed from before the read, as in DefaultHoldsWhereTheLoopsSpin: a
    // lower bound whatever the scheduler does after the read.
    const auto t0 = std::chrono::steady_clock::now();
    Read(0, 4096, uid);
    EXPECT_TRUE(PollUntil([&] { return Notice(uid); }, 5000)) << "no notice for read " << uid;
    // Nothing else went to B: only the timer can have sent it.
    EXPECT_GE(MsSince(t0), 20) << "read " << uid << "'s notice came before its delay";
  }
}

TEST_F(ReadNoticeTest, HeldNoticesLeaveWhenTheInitiatorShutsDown) {
  Start(/*notice_delay_us=*/10 * 1000 * 1000);
  Read(0, 4096, 1);
  Read(1 << 20, 4 << 20, 2);
  a_->Shutdown();
  EXPECT_TRUE(PollUntil([&] { return Notice(1); }, 5000)) << "the held notice was lost at shutdown";
  EXPECT_TRUE(PollUntil([&] { return Notice(2); }, 5000)) << "the striped read's notices were lost at shutdown";
}

TEST_F(ReadNoticeTest, NoticesLeaveAtShutdownWhateverTheSendPath) {
  // Every request through the sender threads: a notice cannot be written by
  // the closing thread itself. Held (10 s) or sent at once (0), the engine
  // shuts down right after the read and the notice must still arrive.
  for (int64_t delay_us : {int64_t{10} * 1000 * 1000, int64_t{0}}) {
    Start(delay_us, BackendConfig{{"inline_max_bytes", 0}});
    Read(0, 4096, 1);
    a_->Shutdown();
    EXPECT_TRUE(PollUntil([&] { return Notice(1); }, 5000)) << "lost at shutdown, notice_delay_us=" << delay_us;
    TearDown();
  }
}

TEST_F(ReadNoticeTest, NoticesOfARefusedConnectionGoOnAnother) {
  // B takes few connections from A, so some of A's four data connections
  // are refused; notices that rode on a request to one of those go back to
  // the courier and leave on an open connection.
  EngineConfig bcfg{"127.0.0.1", 0};
  bcfg.control.caps.max_connections_per_peer = 3;
  Start(/*notice_delay_us=*/20 * 1000, BackendConfig{{"num_data_conns", 4}}, bcfg);
  std::vector<TransferUid> done;
  int refused = 0;
  for (TransferUid uid = 1; uid <= 16; ++uid) {
    StatusPtr s = a_->Read(amem_, 0, bmem_, 0, 4096, uid);
    if (s->WaitFor(kWaitMs) == StatusCode::SUCCESS) {
      done.push_back(uid);
    } else {
      ++refused;
    }
  }
  ASSERT_GT(refused, 0) << "every connection was accepted: the test needs some refused";
  ASSERT_GE(done.size(), 2u) << "no read got through";
  for (TransferUid uid : done) EXPECT_TRUE(PollUntil([&] { return Notice(uid); }, 5000)) << "notice of read " << uid;
}

TEST(NoticeDelayTest, DefaultFollowsWhetherTheLoopsSpin) {
  const tcp::TcpConfig dflt = tcp::TcpConfig::FromMap({});
  ASSERT_EQ(dflt.notice_delay_us, -1);
  {
    testing_util::ScopedEnv spin("MORI_TORCH_LOOP_SPIN_US", "50");
    EventLoop loop(1);
    EXPECT_EQ(tcp::NoticeDelayUs(dflt, loop), 1000) << "held where the loops spin";
  }
  {
    testing_util::ScopedEnv sleep("MORI_TORCH_LOOP_SPIN_US", "0");
    EventLoop loop(1);
    EXPECT_EQ(tcp::NoticeDelayUs(dflt, loop), 0) << "at once where they sleep";
    tcp::TcpConfig set = dflt;
    set.notice_delay_us = 250;
    EXPECT_EQ(tcp::NoticeDelayUs(set, loop), 250) << "a set value stands";
  }
}

TEST_F(ReadNoticeTest, DefaultHoldsWhereTheLoopsSpin) {
  testing_util::ScopedEnv spin("MORI_TORCH_LOOP_SPIN_US", "50");  // read when the engines' loops start
  Start(/*notice_delay_us=*/-1);                                  // the default
  for (TransferUid uid = 1; uid <= 3; ++uid) {
    // Timed from before the read: the hold starts after it, so this lower
    // bound holds however long the scheduler keeps this thread off a busy
    // machine between the read's end and the clock (CI timed it from after
    // the read and once saw 2 us).
    const auto t0 = std::chrono::steady_clock::now();
    Read(0, 4096, uid);
    const auto give_up = t0 + std::chrono::seconds(5);
    bool arrived = false;
    while (!(arrived = Notice(uid)) && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    ASSERT_TRUE(arrived) << "no notice for read " << uid;
    // Nothing else went to B: held for its 1 ms, it cannot have come sooner.
    const auto us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0);
    EXPECT_GE(us.count(), 500) << "read " << uid << "'s notice was not held";
  }
}

TEST_F(ReadNoticeTest, ZeroDelaySendsAtOnce) {
  Start(/*notice_delay_us=*/0);
  Read(0, 4096, 1);
  EXPECT_TRUE(PollUntil([&] { return Notice(1); }, 2000));
}

TEST(EngineNoBackendTest, BadStateAndNoSession) {
  Engine c("C", EngineConfig{"127.0.0.1", 0});
  Engine d("D", EngineConfig{"127.0.0.1", 0});
  c.RegisterRemoteEngine(d.Desc());
  d.RegisterRemoteEngine(c.Desc());
  std::vector<uint8_t> cb(4096, 1), db(4096, 2);
  MemoryDesc cm = c.RegisterMemory(reinterpret_cast<uint64_t>(cb.data()), 4096, -1, MemoryLocationType::CPU);
  MemoryDesc dm = d.RegisterMemory(reinterpret_cast<uint64_t>(db.data()), 4096, -1, MemoryLocationType::CPU);
  EXPECT_EQ(cm.id, 0u);
  EXPECT_EQ(dm.id, 0u);
  EXPECT_FALSE(c.HasBackend(BackendType::TCP));
  for (auto s : {c.Write(cm, 0, dm, 0, 8, 1), c.Read(cm, 0, dm, 0, 8, 2)}) {
    ASSERT_TRUE(FailedAtOnce(s, StatusCode::ERR_BAD_STATE));
    EXPECT_TRUE(Contains(s->Message(), "No available backend found")) << s->Message();
  }
  auto st = c.BatchTransfer(false, {cm, cm, cm}, {{0}, {8}, {16}}, {dm, dm, dm}, {{0}, {8}, {16}}, {{8}, {8}, {8}},
                            {3, 4, 5});
  ASSERT_EQ(st.size(), 3u);
  for (auto& s : st) EXPECT_TRUE(FailedAtOnce(s, StatusCode::ERR_BAD_STATE));  // every one ends
  EXPECT_EQ(c.CreateSession(cm, dm), nullptr);
  EXPECT_EQ(db, std::vector<uint8_t>(4096, 2));

  // Bad backend configs are refused by name.
  auto e = CatchError([&] { c.CreateBackend(BackendType::TCP, {{"num_data_conns", 0}}); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(e->what(), "num_data_conns=0")) << e->what();
  e = CatchError([&] { c.CreateBackend(BackendType::TCP, {{"no_such_field", 1}}); });
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(Contains(e->what(), "no_such_field")) << e->what();
  EXPECT_FALSE(c.HasBackend(BackendType::TCP));

  // A backend on the initiator only: the target refuses the data connection.
  c.CreateBackend(BackendType::TCP, {});
  auto s = c.Write(cm, 0, dm, 0, 8, 6);
  ASSERT_TRUE(Ends(s, StatusCode::ERR_BAD_STATE));
  EXPECT_TRUE(Contains(s->Message(), "no TCP backend")) << s->Message();
  // With both, it works.
  d.CreateBackend(BackendType::TCP, {});
  c.CreateBackend(BackendType::TCP, {});  // duplicate: kept, no error
  ASSERT_TRUE(Ends(c.Write(cm, 0, dm, 0, 8, 7), StatusCode::SUCCESS));
  EXPECT_EQ(db[0], 1);
  EXPECT_EQ(db[8], 2);
  ASSERT_NE(c.CreateSession(cm, dm), nullptr);
}

TEST(EngineTest, KeyAndConfigValidation) {
  auto e = CatchError([] { Engine x("", EngineConfig{"127.0.0.1", 0}); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
  e = CatchError([] { Engine x(std::string(2000, 'k'), EngineConfig{"127.0.0.1", 0}); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
  e = CatchError([] { Engine x("k", EngineConfig{"127.0.0.1", 70000}); });
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(Contains(e->what(), "70000")) << e->what();
  Engine ok("k", EngineConfig{"", 0});  // "" listens on 127.0.0.1
  EXPECT_EQ(ok.Desc().host, "127.0.0.1");
  e = CatchError([&] { Engine x("k2", EngineConfig{"127.0.0.1", ok.Desc().port}); });  // port taken
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(Contains(e->what(), std::to_string(ok.Desc().port))) << e->what();
  e = CatchError([&] { ok.CreateBackend(BackendType::RDMA, {}); });
  ASSERT_TRUE(e.has_value());
  EXPECT_TRUE(Contains(e->what(), "RDMA")) << e->what();
  e = CatchError([&] { ok.CreateBackend(static_cast<BackendType>(9), {}); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
}

TEST(EngineTest, RegisterMemoryRejectsBadArguments) {
  Engine e("E", EngineConfig{"127.0.0.1", 0});
  std::vector<uint8_t> buf(100);
  const auto p = reinterpret_cast<uint64_t>(buf.data());
  struct Case {
    uint64_t ptr;
    int64_t size;
    MemoryLocationType loc;
    const char* needle;
  };
  const Case cases[] = {
      {0, 100, MemoryLocationType::CPU, "null"},
      {p, 0, MemoryLocationType::CPU, "size must be positive, got 0"},
      {p, -5, MemoryLocationType::CPU, "got -5"},
      {UINT64_MAX - 10, 100, MemoryLocationType::CPU, "overflows"},
      {p, 100, MemoryLocationType::Unknown, "mem_loc 0"},
      {p, 100, MemoryLocationType::GPU, "GPU"},
  };
  for (const auto& c : cases) {
    auto err = CatchError([&] { e.RegisterMemory(c.ptr, c.size, -1, c.loc); });
    ASSERT_TRUE(err.has_value()) << c.needle;
    EXPECT_EQ(err->code(), StatusCode::ERR_INVALID_ARGS) << c.needle;
    EXPECT_TRUE(Contains(err->what(), c.needle)) << err->what();
  }
  // A range that is not mapped in this process.
  const long page = sysconf(_SC_PAGESIZE);
  void* hole = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(hole, MAP_FAILED);
  ASSERT_EQ(munmap(static_cast<char*>(hole) + page, page), 0);
  auto err =
      CatchError([&] { e.RegisterMemory(reinterpret_cast<uint64_t>(hole), 2 * page, -1, MemoryLocationType::CPU); });
  ASSERT_TRUE(err.has_value());
  EXPECT_EQ(err->code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(err->what(), "not mapped")) << err->what();
  munmap(hole, page);

  MemoryDesc m = e.RegisterMemory(p, 100, -1, MemoryLocationType::CPU);
  EXPECT_EQ(m.id, 0u);
  EXPECT_EQ(m.engine_key, "E");
  EXPECT_EQ(m.data, p);
  EXPECT_EQ(m.size, 100u);
  EXPECT_EQ(m.device_id, -1);
  MemoryDesc m2 = e.RegisterMemory(p + 10, 10, -1, MemoryLocationType::CPU);
  EXPECT_EQ(m2.id, 1u);
  const auto packed = m2.Pack();
  EXPECT_EQ(MemoryDesc::Unpack(packed.data(), packed.size()), m2);
  EXPECT_GT(e.Desc().port, 0);
  EXPECT_EQ(e.Desc().host, "127.0.0.1");
  EXPECT_EQ(e.Desc().key, "E");
  const TransferUid first = e.AllocateTransferUid();
  EXPECT_EQ(e.AllocateTransferUid(), first + 1);
}

// --- WaitAll ---------------------------------------------------------------------

TEST(WaitAllTest, Semantics) {
  using Clock = std::chrono::steady_clock;
  EXPECT_EQ(Engine::WaitAll({}, -1), StatusCode::SUCCESS);
  EXPECT_EQ(Engine::WaitAll({}, 0), StatusCode::SUCCESS);
  EXPECT_EQ(Engine::WaitAll({nullptr, nullptr}, 0), StatusCode::SUCCESS);
  auto ok = MakeStatus(StatusCode::SUCCESS);
  auto pending = MakeStatus(StatusCode::IN_PROGRESS);
  auto bad = MakeStatus(StatusCode::ERR_NOT_FOUND, "gone");
  auto bad2 = MakeStatus(StatusCode::ERR_BAD_STATE, "broken");
  EXPECT_EQ(Engine::WaitAll({nullptr, ok, nullptr}, -1), StatusCode::SUCCESS);
  EXPECT_EQ(Engine::WaitAll({ok, pending}, 0), StatusCode::IN_PROGRESS);
  // timeout 0: a seen failure beats IN_PROGRESS, whatever the order.
  EXPECT_EQ(Engine::WaitAll({pending, bad}, 0), StatusCode::ERR_NOT_FOUND);
  EXPECT_EQ(Engine::WaitAll({bad, pending}, 0), StatusCode::ERR_NOT_FOUND);
  EXPECT_EQ(Engine::WaitAll({ok, bad, bad2}, 0), StatusCode::ERR_NOT_FOUND);
  // > 0: one shared deadline; an error beats IN_PROGRESS.
  auto t0 = Clock::now();
  EXPECT_EQ(Engine::WaitAll({pending, MakeStatus(), MakeStatus(), MakeStatus(), MakeStatus()}, 60),
            StatusCode::IN_PROGRESS);
  EXPECT_GE(MsSince(t0), 55);
  EXPECT_LT(MsSince(t0), 250);  // one shared 60 ms deadline, not 5 x 60 ms
  t0 = Clock::now();
  EXPECT_EQ(Engine::WaitAll({pending, bad}, 50), StatusCode::ERR_NOT_FOUND);
  EXPECT_LT(MsSince(t0), 1000);
  // < 0: waits for all and returns the first error.
  auto s1 = MakeStatus(), s2 = MakeStatus(), s3 = MakeStatus();
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    s3->Update(StatusCode::ERR_BAD_STATE, "third");
    s1->Update(StatusCode::SUCCESS);
    s2->Update(StatusCode::ERR_INVALID_ARGS, "second");
  });
  EXPECT_EQ(Engine::WaitAll({s1, nullptr, s2, s3}, -1), StatusCode::ERR_INVALID_ARGS);
  t.join();
  auto s4 = MakeStatus(), s5 = MakeStatus();
  std::thread t2([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    s5->Update(StatusCode::SUCCESS);
    s4->Update(StatusCode::SUCCESS);
  });
  EXPECT_EQ(Engine::WaitAll({s4, s5}, -1), StatusCode::SUCCESS);
  t2.join();
  EXPECT_EQ(Engine::WaitAll({s4, s5}, 5000), StatusCode::SUCCESS);
}

}  // namespace
}  // namespace mori_torch
