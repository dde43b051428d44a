// The RDMA backend on real verbs (Soft-RoCE in the test VM): an initiator
// engine in this process, target engines in child processes. Every transfer
// is verified byte-exact (hashes of the peer's bytes). Needs an RDMA device;
// run through tests/rdma_vm/run_ctest.sh (scripts/test.sh does).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <iostream>
#include <thread>

#include "core/engine.h"
#include "rdma_vm_peer.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using rdma_test::FillPattern;
using rdma_test::HashBytes;
using rdma_test::PeerProcess;
using testing_util::Contains;
using testing_util::MsSince;

constexpr uint64_t kPeerBuf = 72ull << 20;
constexpr int kWaitMs = 60000;  // nothing may hang; the VM is slow

::testing::AssertionResult Ends(const StatusPtr& s, StatusCode want) {
  if (!s) return ::testing::AssertionFailure() << "null status";
  StatusCode c = s->WaitFor(kWaitMs);
  if (c == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "status " << StatusCodeName(c) << " (want " << StatusCodeName(want)
                                       << "): " << s->Message();
}

// Page-aligned anonymous host buffer.
struct HostBuf {
  explicit HostBuf(uint64_t n) : size(n) {
    p = static_cast<uint8_t*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    std::memset(p, 0, n);
  }
  ~HostBuf() { munmap(p, size); }
  uint8_t* p;
  uint64_t size;
};

// One shared target process for the suite (process start is slow in the VM).
class RdmaTransferTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { peer_ = new PeerProcess("rdma-target", kPeerBuf, "enable_notification=1"); }
  static void TearDownTestSuite() {
    delete peer_;
    peer_ = nullptr;
  }

  // A fresh initiator engine with `cfg` and a local buffer registered.
  void Start(const BackendConfig& cfg, uint64_t local_bytes = kPeerBuf) {
    EngineConfig ec;
    ec.host = rdma_test::TestHost();
    engine_ = std::make_unique<Engine>("rdma-init-" + std::to_string(++generation_), ec);
    engine_->CreateBackend(BackendType::RDMA, cfg);
    engine_->RegisterRemoteEngine(peer_->engine());
    local_buf_ = std::make_unique<HostBuf>(local_bytes);
    local_ = engine_->RegisterMemory(reinterpret_cast<uint64_t>(local_buf_->p), static_cast<int64_t>(local_bytes),
                                     -1, MemoryLocationType::CPU);
  }
  void TearDown() override {
    if (engine_) engine_->Shutdown();
    engine_.reset();
    local_buf_.reset();
  }
  const std::string& key() const { return engine_->Desc().key; }
  uint8_t* L() { return local_buf_->p; }

  // Write local [lo, +n) (pattern `seed`) to remote ro; verify the peer's bytes.
  void CheckWrite(uint64_t lo, uint64_t ro, uint64_t n, uint64_t seed, bool expect_notice) {
    FillPattern(L() + lo, 0, n, seed);
    const TransferUid uid = engine_->AllocateTransferUid();
    auto st = engine_->Write(local_, static_cast<int64_t>(lo), peer_->memory(), static_cast<int64_t>(ro),
                             static_cast<int64_t>(n), uid);
    ASSERT_TRUE(Ends(st, StatusCode::SUCCESS)) << "write of " << n << " bytes";
    EXPECT_EQ(peer_->Hash(ro, n), HashBytes(L() + lo, n)) << "write of " << n << " bytes at " << ro;
    EXPECT_EQ(Noticed(uid, expect_notice), expect_notice) << "notice of a " << n << "-byte write";
    EXPECT_FALSE(peer_->Pop(key(), uid)) << "pop consumes";
  }
  // The target's notice trails the initiator's completion by a moment (its
  // own completion thread records it): poll for it, or make sure that none
  // comes when none is expected.
  bool Noticed(TransferUid uid, bool expected = true) {
    const auto t0 = std::chrono::steady_clock::now();
    while (MsSince(t0) < (expected ? 10000 : 200)) {
      if (peer_->Pop(key(), uid)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  }
  // Read remote [ro, +n) (after the peer filled `seed`) into local lo; verify.
  void CheckRead(uint64_t lo, uint64_t ro, uint64_t n, uint64_t seed) {
    ASSERT_EQ(peer_->Command("fill " + std::to_string(seed)), "OK");
    std::memset(L() + lo, 0, n);
    auto st = engine_->Read(local_, static_cast<int64_t>(lo), peer_->memory(), static_cast<int64_t>(ro),
                            static_cast<int64_t>(n), engine_->AllocateTransferUid());
    ASSERT_TRUE(Ends(st, StatusCode::SUCCESS)) << "read of " << n << " bytes";
    std::vector<uint8_t> want(n);
    FillPattern(want.data(), ro, n, seed);
    EXPECT_EQ(HashBytes(L() + lo, n), HashBytes(want.data(), n)) << "read of " << n << " bytes at " << ro;
  }

  static PeerProcess* peer_;
  static int generation_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<HostBuf> local_buf_;
  MemoryDesc local_;
};
PeerProcess* RdmaTransferTest::peer_ = nullptr;
int RdmaTransferTest::generation_ = 0;

class RdmaSizesTest : public RdmaTransferTest, public ::testing::WithParamInterface<int> {};

TEST_P(RdmaSizesTest, SingleWriteAndReadFrom8BytesTo64MiB) {
  Start({{"qp_per_transfer", GetParam()}});
  const uint64_t sizes[] = {8, 4096, (64 << 10) + 13, 1 << 20, (9 << 20) + 7, 64 << 20};
  uint64_t seed = 100;
  for (uint64_t n : sizes) {
    const uint64_t lo = n < (64 << 20) ? 3 : 0, ro = n < (64 << 20) ? 4096 + 5 : 0;
    CheckWrite(lo, ro, n, ++seed, true);
    CheckRead(lo, ro, n, ++seed);
  }
}
INSTANTIATE_TEST_SUITE_P(QpPerTransfer, RdmaSizesTest, ::testing::Values(1, 4));

// `count` segments of `seg` bytes, remote slots shuffled so nothing merges.
struct Batch {
  std::vector<int64_t> lo, ro, sz;
};
Batch Shuffled(size_t count, int64_t seg, uint64_t seed) {
  Batch b;
  std::vector<int64_t> slots(count);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937_64(seed));
  for (size_t i = 0; i < count; ++i) {
    b.lo.push_back(static_cast<int64_t>(i) * seg);
    b.ro.push_back(slots[i] * seg * 2);  // gaps between remote slots
    b.sz.push_back(seg);
  }
  return b;
}

class RdmaBatchTest : public RdmaTransferTest, public ::testing::WithParamInterface<int> {};

TEST_P(RdmaBatchTest, EngineAndSessionBatchesOf1To4096Segments) {
  Start({{"qp_per_transfer", GetParam()}});
  auto sess = engine_->CreateSession(local_, peer_->memory());
  ASSERT_TRUE(sess);
  EXPECT_EQ(sess->backend_type(), BackendType::RDMA);
  uint64_t seed = 7;
  for (size_t count : {size_t{1}, size_t{64}, size_t{4096}}) {
    const int64_t seg = 4096;
    Batch b = Shuffled(count, seg, ++seed);
    for (int use_session = 0; use_session < 2; ++use_session) {
      // Write: each segment lands in its shuffled remote slot.
      FillPattern(L(), 0, count * seg, ++seed);
      const TransferUid uid = engine_->AllocateTransferUid();
      StatusPtr st = use_session ? sess->BatchWrite(b.lo, b.ro, b.sz, uid)
                                 : engine_->BatchTransfer(false, {local_}, {b.lo}, {peer_->memory()}, {b.ro}, {b.sz},
                                                          {static_cast<int64_t>(uid)})[0];
      ASSERT_TRUE(Ends(st, StatusCode::SUCCESS)) << count << " segments, session " << use_session;
      for (size_t i = 0; i < count; i += std::max<size_t>(1, count / 16)) {
        EXPECT_EQ(peer_->Hash(b.ro[i], seg), HashBytes(L() + b.lo[i], seg)) << "segment " << i;
      }
      EXPECT_TRUE(Noticed(uid)) << count << " segments";
      // Read them back in the shuffled order into a clean buffer.
      ASSERT_EQ(peer_->Command("fill " + std::to_string(++seed)), "OK");
      std::memset(L(), 0, count * seg);
      st = use_session ? sess->BatchRead(b.lo, b.ro, b.sz, engine_->AllocateTransferUid())
                       : engine_->BatchTransfer(true, {local_}, {b.lo}, {peer_->memory()}, {b.ro}, {b.sz},
                                                {static_cast<int64_t>(engine_->AllocateTransferUid())})[0];
      ASSERT_TRUE(Ends(st, StatusCode::SUCCESS));
      std::vector<uint8_t> want(seg);
      for (size_t i = 0; i < count; ++i) {
        FillPattern(want.data(), b.ro[i], seg, seed);
        ASSERT_EQ(HashBytes(L() + b.lo[i], seg), HashBytes(want.data(), seg)) << "segment " << i;
      }
    }
  }
  // Contiguous segments merge into one work request and still land right.
  Batch c;
  for (int i = 0; i < 256; ++i) {
    c.lo.push_back(i * 1000);
    c.ro.push_back(i * 1000);
    c.sz.push_back(1000);
  }
  FillPattern(L(), 0, 256000, ++seed);
  ASSERT_TRUE(Ends(sess->BatchWrite(c.lo, c.ro, c.sz, 1), StatusCode::SUCCESS));
  EXPECT_EQ(peer_->Hash(0, 256000), HashBytes(L(), 256000));
  // Single session transfers.
  CheckWrite(0, 0, 12345, ++seed, true);
  FillPattern(L(), 0, 777, ++seed);
  ASSERT_TRUE(Ends(sess->Write(0, 999, 777, 5), StatusCode::SUCCESS));
  EXPECT_EQ(peer_->Hash(999, 777), HashBytes(L(), 777));
  ASSERT_TRUE(Ends(sess->Read(4096, 999, 777, 6), StatusCode::SUCCESS));
  EXPECT_EQ(HashBytes(L() + 4096, 777), HashBytes(L(), 777));
}
INSTANTIATE_TEST_SUITE_P(QpPerTransfer, RdmaBatchTest, ::testing::Values(1, 4));

TEST_F(RdmaTransferTest, ChunkingChainsEventModeAndSeveralCompletionThreads) {
  Start({{"qp_per_transfer", 2},
         {"post_batch_size", 8},
         {"num_worker_threads", 2},
         {"poll_cq_mode", 1},
         {"enable_transfer_chunking", 1},
         {"chunk_bytes", 65536},
         {"max_chunks_per_transfer", 64}});
  CheckWrite(0, 0, 4 << 20, 31, true);
  CheckRead(0, 0, 4 << 20, 32);
  CheckWrite(1, 3, 100, 33, true);
  Batch b = Shuffled(1024, 4096, 34);
  FillPattern(L(), 0, 1024 * 4096, 35);
  ASSERT_TRUE(Ends(engine_->BatchTransfer(false, {local_}, {b.lo}, {peer_->memory()}, {b.ro}, {b.sz}, {9})[0],
                   StatusCode::SUCCESS));
  for (size_t i = 0; i < 1024; i += 97) EXPECT_EQ(peer_->Hash(b.ro[i], 4096), HashBytes(L() + b.lo[i], 4096));
}

TEST_F(RdmaTransferTest, EventModeReallyBlocks) {
  Start({{"poll_cq_mode", 1}, {"num_worker_threads", 1}});
  CheckWrite(0, 0, 4096, 41, true);  // connected, threads started
  // Idle for a while: an event-driven completion thread uses no CPU.
  timespec a{}, b{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
  const double cpu_ms = (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6;
  EXPECT_LT(cpu_ms, 100.0) << "process used " << cpu_ms << " ms of CPU in 1 s idle";
  CheckWrite(0, 0, 4096, 42, true);  // still completes after the idle period
}

TEST_F(RdmaTransferTest, TwoRailsEachWithItsOwnRegistrations) {
  // The VM has rxe0 and rxe1 (one per dummy interface); both engines use both.
  setenv("MORI_TORCH_RDMA_DEVICES", "rxe0,rxe1", 1);
  PeerProcess two("rdma-target-two-rails", 16 << 20, "num_nics_per_transfer=2");
  Start({{"num_nics_per_transfer", 2}, {"qp_per_transfer", 2}}, 16 << 20);
  unsetenv("MORI_TORCH_RDMA_DEVICES");
  engine_->RegisterRemoteEngine(two.engine());
  // 8 MiB spreads over all 4 QPs (2 per rail); each rail uses its own lkey/rkey.
  FillPattern(L(), 0, 8 << 20, 131);
  const TransferUid uid = engine_->AllocateTransferUid();
  ASSERT_TRUE(Ends(engine_->Write(local_, 0, two.memory(), 4096, 8 << 20, uid), StatusCode::SUCCESS));
  EXPECT_EQ(two.Hash(4096, 8 << 20), HashBytes(L(), 8 << 20));
  bool noticed = false;
  for (int i = 0; i < 5000 && !noticed; ++i) {
    noticed = two.Pop(key(), uid);
    if (!noticed) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  EXPECT_TRUE(noticed) << "4 notices (one per QP) complete the transfer";
  ASSERT_EQ(two.Command("fill 132"), "OK");
  Batch b = Shuffled(1024, 4096, 133);
  ASSERT_TRUE(Ends(engine_->BatchTransfer(true, {local_}, {b.lo}, {two.memory()}, {b.ro}, {b.sz}, {77})[0],
                   StatusCode::SUCCESS));
  std::vector<uint8_t> want(4096);
  for (size_t i = 0; i < 1024; ++i) {
    FillPattern(want.data(), b.ro[i], 4096, 132);
    ASSERT_EQ(HashBytes(L() + b.lo[i], 4096), HashBytes(want.data(), 4096)) << "segment " << i;
  }
}

TEST_F(RdmaTransferTest, NotificationsOffSendNoNotices) {
  Start({{"enable_notification", 0}, {"qp_per_transfer", 4}});
  CheckWrite(0, 0, 1 << 20, 51, false);
  CheckWrite(0, 0, 8, 52, false);
}

TEST_F(RdmaTransferTest, ConcurrentTransfersFromManyThreadsEachNoticeOnce) {
  Start({{"qp_per_transfer", 4}});
  constexpr int kThreads = 4, kPer = 25;
  constexpr uint64_t kSlot = 64 << 10;
  FillPattern(L(), 0, kThreads * kPer * kSlot, 61);
  std::vector<std::vector<std::pair<TransferUid, StatusPtr>>> got(kThreads);
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        const int64_t off = static_cast<int64_t>((t * kPer + i) * kSlot);
        const TransferUid uid = engine_->AllocateTransferUid();
        got[t].push_back({uid, engine_->Write(local_, off, peer_->memory(), off, kSlot, uid)});
      }
    });
  }
  for (auto& th : ts) th.join();
  for (auto& v : got) {
    for (auto& [uid, st] : v) {
      ASSERT_TRUE(Ends(st, StatusCode::SUCCESS));
      EXPECT_TRUE(Noticed(uid)) << "uid " << uid;
    }
  }
  EXPECT_EQ(peer_->Hash(0, kThreads * kPer * kSlot), HashBytes(L(), kThreads * kPer * kSlot));
}

TEST_F(RdmaTransferTest, OutOfRangeRequestsFailAndTheEngineKeepsWorking) {
  Start({{"qp_per_transfer", 2}});
  // Checked by the engine against the descriptor: failed at once.
  auto st = engine_->Write(local_, 0, peer_->memory(), static_cast<int64_t>(kPeerBuf) - 4, 8, 1);
  EXPECT_EQ(st->PeekCode(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(st->Message(), "out of bounds")) << st->Message();
  // A forged descriptor claiming more than was registered: the target's NIC
  // registration covers exactly the real range, so the NIC refuses.
  CheckWrite(0, 0, 4096, 71, true);  // keys of the real memory are cached now
  MemoryDesc forged = peer_->memory();
  forged.size *= 2;
  st = engine_->Write(local_, 0, forged, static_cast<int64_t>(kPeerBuf), 4096, 2);
  ASSERT_TRUE(Ends(st, StatusCode::ERR_NOT_FOUND));  // size differs from what the target reports
  // Same size but a larger address range than the target registered:
  forged = peer_->memory();
  forged.data -= 1 << 20;  // the descriptor's address is not the registration's
  st = engine_->Read(local_, 0, forged, 0, 4096, 3);
  ASSERT_TRUE(Ends(st, StatusCode::ERR_NOT_FOUND));
  EXPECT_TRUE(Contains(st->Message(), "no longer matches")) << st->Message();
  for (int i = 0; i < 20; ++i) {  // a run of failures, then good transfers
    auto bad = engine_->Read(local_, 0, peer_->memory(), 0, static_cast<int64_t>(kPeerBuf) + 1, 10 + i);
    EXPECT_EQ(bad->PeekCode(), StatusCode::ERR_INVALID_ARGS);
  }
  CheckWrite(8, 16, 65536, 72, true);
  CheckRead(0, 0, 65536, 73);
}

TEST_F(RdmaTransferTest, DeregisteredTargetMemoryFailsCleanly) {
  Start({});
  PeerProcess second("rdma-target-dereg", 1 << 20, "");
  engine_->RegisterRemoteEngine(second.engine());
  FillPattern(L(), 0, 4096, 81);
  ASSERT_TRUE(Ends(engine_->Write(local_, 0, second.memory(), 0, 4096, 1), StatusCode::SUCCESS));
  EXPECT_EQ(second.Hash(0, 4096), HashBytes(L(), 4096));
  ASSERT_EQ(second.Command("dereg"), "OK");
  // The cached remote key is dead: the target NIC refuses the access.
  auto st = engine_->Write(local_, 0, second.memory(), 0, 4096, 2);
  ASSERT_TRUE(Ends(st, StatusCode::ERR_RDMA_OP));
  EXPECT_TRUE(Contains(st->Message(), "deregistered")) << st->Message();
  // After reconnecting, the key request itself is refused.
  st = engine_->Read(local_, 0, second.memory(), 0, 4096, 3);
  st->WaitFor(kWaitMs);
  EXPECT_TRUE(st->Failed()) << st->Message();
  // Other peers are unaffected.
  CheckWrite(0, 0, 4096, 82, true);
}

TEST_F(RdmaTransferTest, PeerKilledMidTransferFailsWithinTheTimeoutAndOthersContinue) {
  Start({{"qp_per_transfer", 2}});
  auto victim = std::make_unique<PeerProcess>("rdma-target-victim", 64 << 20, "");
  engine_->RegisterRemoteEngine(victim->engine());
  FillPattern(L(), 0, 4096, 91);
  ASSERT_TRUE(Ends(engine_->Write(local_, 0, victim->memory(), 0, 4096, 1), StatusCode::SUCCESS));
  // A poster thread keeps writing to the victim while it is killed (Soft-RoCE
  // sends from the posting thread, so the poster is on the wire at the kill),
  // and goes on until two transfers were posted after the kill: those cannot
  // be acknowledged, whatever the VM's speed.
  std::vector<StatusPtr> inflight;
  std::atomic<bool> killed{false};
  size_t first_after_kill = 0;
  std::thread poster([&] {
    int after_kill = 0;
    for (int i = 0; i < 2000 && after_kill < 2; ++i) {
      const bool late = killed.load();
      inflight.push_back(engine_->Write(local_, 0, victim->memory(), 0, 8 << 20, 2 + i));
      if (late && after_kill++ == 0) first_after_kill = inflight.size() - 1;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  victim->Kill();
  killed = true;
  poster.join();
  ASSERT_GT(first_after_kill, 0u) << "no transfer was posted after the kill";
  size_t failed = 0;
  for (auto& st : inflight) {
    const StatusCode c = st->WaitFor(kWaitMs);
    EXPECT_TRUE(c == StatusCode::SUCCESS || IsError(c)) << StatusCodeName(c) << " " << st->Message();
    failed += IsError(c);
  }
  std::cerr << inflight.size() << " transfers, " << inflight.size() - first_after_kill << " posted after the kill, "
            << failed << " failed; all ended " << MsSince(t0) << " ms after the kill\n";
  EXPECT_LT(MsSince(t0), 10000) << "ending the transfers of a dead peer took too long";
  for (size_t i = first_after_kill; i < inflight.size(); ++i) {
    EXPECT_TRUE(inflight[i]->Failed()) << "transfer " << i << " was posted after the kill";
    EXPECT_TRUE(Contains(inflight[i]->Message(), "victim")) << inflight[i]->Message();
  }
  auto after = engine_->Write(local_, 0, victim->memory(), 0, 4096, 5000);
  after->WaitFor(kWaitMs);
  EXPECT_TRUE(after->Failed());
  CheckWrite(0, 0, 1 << 20, 92, true);  // the live peer still works
}

TEST_F(RdmaTransferTest, SendQueueFullFailsOnlyThatTransferAfterTheBound) {
  // 8 slots per QP, chains of 4: a 512-segment batch needs the queue to
  // drain many times. With no patience it fails "SQ full" ...
  Start({{"sq_depth", 8}, {"post_batch_size", 4}, {"sq_full_timeout_ms", 0}});
  Batch b = Shuffled(512, 16384, 101);
  FillPattern(L(), 0, 512 * 16384, 102);
  // Whether the queue is full at a given instant depends on how fast the
  // target acknowledges; a few tries make the outcome certain.
  bool saw_sq_full = false;
  TransferUid uid = 0;
  for (int attempt = 0; attempt < 5 && !saw_sq_full; ++attempt) {
    uid = engine_->AllocateTransferUid();
    auto st = engine_->BatchTransfer(false, {local_}, {b.lo}, {peer_->memory()}, {b.ro}, {b.sz},
                                     {static_cast<int64_t>(uid)})[0];
    const StatusCode c = st->WaitFor(kWaitMs);
    ASSERT_TRUE(c == StatusCode::SUCCESS || c == StatusCode::ERR_RDMA_OP) << StatusCodeName(c) << st->Message();
    if (c == StatusCode::ERR_RDMA_OP) {
      EXPECT_TRUE(Contains(st->Message(), "SQ full")) << st->Message();
      saw_sq_full = true;
    } else {
      EXPECT_TRUE(Noticed(uid));
    }
  }
  ASSERT_TRUE(saw_sq_full) << "512 chains of 4 never found an 8-slot queue full";
  EXPECT_FALSE(Noticed(uid, false));  // an incomplete transfer is never announced
  // ... and the next transfers on the same QPs are fine.
  CheckWrite(0, 0, 65536, 103, true);
  CheckRead(0, 0, 65536, 104);
}

TEST_F(RdmaTransferTest, SendQueueBackPressureWaitsForRoom) {
  Start({{"sq_depth", 8}, {"post_batch_size", 4}, {"sq_full_timeout_ms", 30000}, {"qp_per_transfer", 2}});
  Batch b = Shuffled(512, 16384, 111);
  FillPattern(L(), 0, 512 * 16384, 112);
  auto st = engine_->BatchTransfer(false, {local_}, {b.lo}, {peer_->memory()}, {b.ro}, {b.sz}, {1})[0];
  ASSERT_TRUE(Ends(st, StatusCode::SUCCESS));
  for (size_t i = 0; i < 512; i += 31) EXPECT_EQ(peer_->Hash(b.ro[i], 16384), HashBytes(L() + b.lo[i], 16384));
  EXPECT_TRUE(Noticed(1));
}

TEST_F(RdmaTransferTest, DeregisteringLocalMemoryAndRemovingTheBackendEndTransfers) {
  Start({{"qp_per_transfer", 2}});
  CheckWrite(0, 0, 4096, 121, true);
  // Deregistration waits for transfers using the memory, then later ones fail.
  auto st = engine_->Write(local_, 0, peer_->memory(), 0, 8 << 20, 2);
  engine_->DeregisterMemory(local_);
  EXPECT_TRUE(st->PeekCode() == StatusCode::SUCCESS || st->Failed()) << StatusCodeName(st->PeekCode());
  auto after = engine_->Write(local_, 0, peer_->memory(), 0, 8, 3);
  EXPECT_EQ(after->PeekCode(), StatusCode::ERR_NOT_FOUND);
  local_ = engine_->RegisterMemory(reinterpret_cast<uint64_t>(L()), 1 << 20, -1, MemoryLocationType::CPU);
  CheckWrite(0, 0, 4096, 122, true);
  // Removing the backend ends what is in flight.
  std::vector<StatusPtr> inflight;
  for (int i = 0; i < 4; ++i) inflight.push_back(engine_->Write(local_, 0, peer_->memory(), 0, 1 << 20, 10 + i));
  engine_->RemoveBackend(BackendType::RDMA);
  for (auto& s : inflight) {
    s->WaitFor(kWaitMs);
    EXPECT_TRUE(s->Code() == StatusCode::SUCCESS || s->Failed()) << s->Message();
  }
  auto none = engine_->Write(local_, 0, peer_->memory(), 0, 8, 20);
  EXPECT_EQ(none->PeekCode(), StatusCode::ERR_BAD_STATE);
}

}  // namespace
}  // namespace mori_torch

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);  // a dead peer's pipe must fail a write, not kill us
  if (argc > 1 && std::string(argv[1]) == "--peer") return mori_torch::rdma_test::RunPeer(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
