// The RDMA backend on real verbs (Soft-RoCE in the test VM): an initiator
// engine in this process, target engines in child processes. Every transfer
// is verified byte-exact (hashes of the peer's bytes). Needs an RDMA device;
// run through tests/rdma_vm/run_ctest.sh (scripts/test.sh does).
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "backends/rdma/rdma_backend.h"
#include "backends/rdma/rdma_completion.h"
#include "backends/rdma/rdma_device.h"
#include "backends/rdma/rdma_mr_cache.h"
#include "backends/rdma/verbs_loader.h"
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
using testing_util::ScopedEnv;

constexpr uint64_t kPeerBuf = 72ull << 20;
constexpr int kWaitMs = 60000;  // nothing may hang; the VM is slow

::testing::AssertionResult Ends(const StatusPtr& s, StatusCode want) {
  if (!s) return ::testing::AssertionFailure() << "null status";
  StatusCode c = s->WaitFor(kWaitMs);
  if (c == want) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "status " << StatusCodeName(c) << " (want " << StatusCodeName(want)
                                       << "): " << s->Message();
}

// Scheduler counters of one thread (/proc/self/task/TID/status and stat).
struct ThreadStats {
  uint64_t voluntary = 0;    // times it blocked (sleep, poll, lock)
  uint64_t involuntary = 0;  // times it was preempted
  uint64_t cpu_ticks = 0;    // utime + stime, in clock ticks
};

// The RDMA completion threads of this process (by their name), by thread id.
std::map<pid_t, ThreadStats> CompletionThreads() {
  std::map<pid_t, ThreadStats> out;
  DIR* d = opendir("/proc/self/task");
  if (!d) return out;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string dir = std::string("/proc/self/task/") + e->d_name;
    std::ifstream comm(dir + "/comm");
    std::string name;
    std::getline(comm, name);
    if (name != rdma::kCompletionThreadName) continue;
    ThreadStats st;
    std::ifstream status(dir + "/status");
    for (std::string line; std::getline(status, line);) {
      std::istringstream ls(line);
      std::string key;
      uint64_t v = 0;
      ls >> key >> v;
      if (key == "voluntary_ctxt_switches:") st.voluntary = v;
      if (key == "nonvoluntary_ctxt_switches:") st.involuntary = v;
    }
    std::ifstream stat(dir + "/stat");
    const std::string all((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    // After the ")" that ends the name: field 3 (state) on; utime 14, stime 15.
    std::istringstream rest(all.substr(all.rfind(')') + 2));
    std::string f;
    for (int i = 3; i <= 15 && (rest >> f); ++i) {
      if (i >= 14) st.cpu_ticks += std::stoull(f);
    }
    out[static_cast<pid_t>(std::stol(e->d_name))] = st;
  }
  closedir(d);
  return out;
}

// The one completion thread that is in `now` but not in `before` (0 if not
// exactly one).
pid_t NewThread(const std::map<pid_t, ThreadStats>& before, const std::map<pid_t, ThreadStats>& now) {
  pid_t found = 0;
  for (auto& [tid, st] : now) {
    if (before.count(tid)) continue;
    if (found) return 0;
    found = tid;
  }
  return found;
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

  // A fresh initiator engine with `cfg` and a local buffer registered;
  // `failover` false: a broken path fails its transfers (no retry).
  void Start(const BackendConfig& cfg, uint64_t local_bytes = kPeerBuf, bool failover = true) {
    EngineConfig ec;
    ec.host = rdma_test::TestHost();
    ec.retry.enabled = ec.failover.enabled = failover;
    engine_ = std::make_unique<Engine>("rdma-init-" + std::to_string(++generation_), ec);
    engine_->CreateBackend(BackendType::RDMA, cfg);
    engine_->RegisterRemoteEngine(peer_->engine());
    local_buf_ = std::make_unique<HostBuf>(local_bytes);
    local_ = engine_->RegisterMemory(reinterpret_cast<uint64_t>(local_buf_->p), static_cast<int64_t>(local_bytes), -1,
                                     MemoryLocationType::CPU);
  }
  void TearDown() override {
    if (engine_) engine_->Shutdown();
    engine_.reset();
    local_buf_.reset();
  }
  // 4 KiB writes from a slot of the local buffer to the same slot of `to`'s,
  // with their uids and statuses in order; a call returns its index.
  struct SlotWrites {
    Engine* engine;
    MemoryDesc local;
    PeerProcess* to;
    std::vector<TransferUid> uids;
    std::vector<StatusPtr> st;
    size_t operator()(int slot) {
      uids.push_back(engine->AllocateTransferUid());
      st.push_back(engine->Write(local, slot * 4096, to->memory(), slot * 4096, 4096, uids.back()));
      return st.size() - 1;
    }
  };
  SlotWrites WritesTo(PeerProcess* to) { return {engine_.get(), local_, to, {}, {}}; }
  // Writes 0 and 1 of `write` (to `to`, whose QP has one notice buffer):
  // the first connects and is announced (the buffer is posted again), the
  // second, after `to` is stopped, takes the buffer and completes. From
  // then on a notice on that QP finds no buffer and is retried without
  // limit (receiver not ready) until `to` runs again: nothing behind it
  // completes.
  ::testing::AssertionResult StopWithNoticeBufferUsedUp(SlotWrites& write, PeerProcess& to) {
    write(0);
    auto r = Ends(write.st[0], StatusCode::SUCCESS);
    if (!r) return r << " (write 0)";
    if (!Noticed(write.uids[0], true, &to)) return ::testing::AssertionFailure() << "write 0 was not announced";
    to.Stop();
    write(1);
    r = Ends(write.st[1], StatusCode::SUCCESS);
    return r ? r : r << " (write 1, the target stopped)";
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
  // comes when none is expected. `from`: the target (default: the shared one).
  bool Noticed(TransferUid uid, bool expected = true, PeerProcess* from = nullptr) {
    PeerProcess* p = from ? from : peer_;
    const auto t0 = std::chrono::steady_clock::now();
    while (MsSince(t0) < (expected ? 10000 : 200)) {
      if (p->Pop(key(), uid)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  }
  // Read remote [ro, +n) (after the peer filled `seed`) into local lo; verify,
  // and that the target was told (once) exactly when notifications are on.
  void CheckRead(uint64_t lo, uint64_t ro, uint64_t n, uint64_t seed, bool expect_notice = true) {
    ASSERT_EQ(peer_->Command("fill " + std::to_string(seed)), "OK");
    std::memset(L() + lo, 0, n);
    const TransferUid uid = engine_->AllocateTransferUid();
    auto st = engine_->Read(local_, static_cast<int64_t>(lo), peer_->memory(), static_cast<int64_t>(ro),
                            static_cast<int64_t>(n), uid);
    ASSERT_TRUE(Ends(st, StatusCode::SUCCESS)) << "read of " << n << " bytes";
    std::vector<uint8_t> want(n);
    FillPattern(want.data(), ro, n, seed);
    EXPECT_EQ(HashBytes(L() + lo, n), HashBytes(want.data(), n)) << "read of " << n << " bytes at " << ro;
    EXPECT_EQ(Noticed(uid, expect_notice), expect_notice) << "notice of a " << n << "-byte read";
    EXPECT_FALSE(peer_->Pop(key(), uid)) << "pop consumes";
  }
  // The RDMA peer behind a session (for its connection's accessors).
  static rdma::RdmaPeer* RdmaPeerOf(Session& s) { return dynamic_cast<rdma::RdmaPeer*>(s.peer().get()); }

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
      const TransferUid read_uid = engine_->AllocateTransferUid();
      st = use_session ? sess->BatchRead(b.lo, b.ro, b.sz, read_uid)
                       : engine_->BatchTransfer(true, {local_}, {b.lo}, {peer_->memory()}, {b.ro}, {b.sz},
                                                {static_cast<int64_t>(read_uid)})[0];
      ASSERT_TRUE(Ends(st, StatusCode::SUCCESS));
      EXPECT_TRUE(Noticed(read_uid)) << "read of " << count << " segments, session " << use_session;
      EXPECT_FALSE(peer_->Pop(key(), read_uid)) << "pop consumes";
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
  EXPECT_TRUE(Noticed(5));
  EXPECT_TRUE(Noticed(6)) << "session read";
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

// EVENT mode really blocks: while nothing completes, the completion thread
// sleeps in poll() (no wake-ups, no CPU time); a POLLING thread, the control,
// keeps waking up. Counted per thread (/proc/self/task), so other threads of
// the process do not matter, and the EVENT thread is shown to be the one
// that handles completions (it wakes for the next transfer).
TEST_F(RdmaTransferTest, EventModeReallyBlocksAndPollingModeDoesNot) {
  using std::chrono::milliseconds;
  auto before = CompletionThreads();
  Start({{"poll_cq_mode", 1}, {"num_worker_threads", 1}}, 1 << 20);
  CheckWrite(0, 0, 4096, 41, true);  // connected: its thread watches a CQ now
  const pid_t event_tid = NewThread(before, CompletionThreads());
  ASSERT_NE(event_tid, 0) << "no (or more than one) new completion thread named " << rdma::kCompletionThreadName;
  std::this_thread::sleep_for(milliseconds(200));  // back in poll() after the last completion
  const ThreadStats e0 = CompletionThreads()[event_tid];
  std::this_thread::sleep_for(milliseconds(1000));
  const ThreadStats e1 = CompletionThreads()[event_tid];
  std::cerr << "EVENT thread over 1 s idle: " << e1.voluntary - e0.voluntary << " wake-ups, "
            << e1.cpu_ticks - e0.cpu_ticks << " CPU ticks\n";
  EXPECT_LE(e1.voluntary - e0.voluntary, 1u) << "the EVENT completion thread woke up while idle";
  EXPECT_LE(e1.involuntary - e0.involuntary, 1u);
  EXPECT_LE(e1.cpu_ticks - e0.cpu_ticks, 1u) << "the EVENT completion thread used CPU while idle";
  CheckWrite(0, 0, 4096, 42, true);  // a completion still wakes it ...
  EXPECT_TRUE(testing_util::PollUntil([&] { return CompletionThreads()[event_tid].voluntary > e1.voluntary; }, 10000))
      << "... and it is the thread that handled the completion";

  // The control: the same in POLLING mode wakes up all the time.
  engine_->Shutdown();
  engine_.reset();
  before = CompletionThreads();
  Start({{"poll_cq_mode", 0}, {"num_worker_threads", 1}}, 1 << 20);
  CheckWrite(0, 0, 4096, 43, true);
  const pid_t poll_tid = NewThread(before, CompletionThreads());
  ASSERT_NE(poll_tid, 0);
  std::this_thread::sleep_for(milliseconds(200));
  const ThreadStats p0 = CompletionThreads()[poll_tid];
  std::this_thread::sleep_for(milliseconds(1000));
  const ThreadStats p1 = CompletionThreads()[poll_tid];
  std::cerr << "POLLING thread over 1 s idle: " << p1.voluntary - p0.voluntary << " wake-ups, "
            << p1.cpu_ticks - p0.cpu_ticks << " CPU ticks\n";
  // It sleeps at most 200 us between polls: 50 wake-ups come within 10 s
  // on any machine (about 1 s is measured above for the record).
  EXPECT_TRUE(
      testing_util::PollUntil([&] { return CompletionThreads()[poll_tid].voluntary - p0.voluntary >= 50; }, 10000))
      << "the POLLING thread did not keep waking up: the measurement cannot tell the modes apart";
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
  auto sent_pkts = [](const char* dev) {
    std::ifstream f(std::string("/sys/class/infiniband/") + dev + "/ports/1/hw_counters/sent_pkts");
    uint64_t v = 0;
    f >> v;
    return v;
  };
  const uint64_t sent0 = sent_pkts("rxe0"), sent1 = sent_pkts("rxe1");
  const TransferUid uid = engine_->AllocateTransferUid();
  ASSERT_TRUE(Ends(engine_->Write(local_, 0, two.memory(), 4096, 8 << 20, uid), StatusCode::SUCCESS));
  EXPECT_EQ(two.Hash(4096, 8 << 20), HashBytes(L(), 8 << 20));
  // Both rails are in use: the connection says so, and each NIC sent packets.
  auto sess = engine_->CreateSession(local_, two.memory());
  ASSERT_TRUE(sess);
  ASSERT_NE(RdmaPeerOf(*sess), nullptr);
  EXPECT_EQ(RdmaPeerOf(*sess)->ConnectedRails(), 2u) << "the connection is not spread over both NICs";
  // 8 MiB in 4 stripes, 2 per rail: 4 MiB, at least 1024 packets (MTU <= 4 KiB), on each.
  EXPECT_GT(sent_pkts("rxe0") - sent0, 512u) << "rxe0 carried no share of the data";
  EXPECT_GT(sent_pkts("rxe1") - sent1, 512u) << "rxe1 carried no share of the data";
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
      EXPECT_FALSE(peer_->Pop(key(), uid)) << "uid " << uid << " popped twice: a notice counted more than once";
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
  // A forged descriptor claiming more than was registered: the range is
  // within the forged size, so the engine lets it through, but the target's
  // key reply states the real address and size, and the initiator refuses
  // before anything is posted (ERR_NOT_FOUND). (Were it posted, the NIC would
  // refuse too: the registration covers exactly the real range.)
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

// How the SQ-full tests fill a send queue for certain: the target is stopped
// (SIGSTOP) and has one notice buffer per QP (notif_per_qp=1). The first
// notice after the stop lands in that buffer; every later notice on the QP
// finds none and is retried (receiver not ready, without limit) until the
// target runs again, so its chain and every chain behind it stay in the
// send queue: nothing is acknowledged. A small write takes 2 slots (data +
// notice). The buffer is posted again before the notice is visible to pop,
// so a popped notice means the buffer is back.
constexpr int64_t kSqBoundMs = 300;

TEST_F(RdmaTransferTest, SendQueueFullFailsOnlyThatTransferAfterTheBound) {
  PeerProcess stall("rdma-target-sq-full", 1 << 20, "");
  Start({{"sq_depth", 8}, {"notif_per_qp", 1}, {"sq_full_timeout_ms", kSqBoundMs}, {"qp_per_transfer", 1}}, 1 << 20);
  engine_->RegisterRemoteEngine(stall.engine());
  auto sess = engine_->CreateSession(local_, stall.memory());
  ASSERT_TRUE(sess);
  FillPattern(L(), 0, 1 << 20, 141);
  SlotWrites write = WritesTo(&stall);
  auto& uids = write.uids;
  auto& st = write.st;
  ASSERT_TRUE(StopWithNoticeBufferUsedUp(write, stall));
  ASSERT_EQ(RdmaPeerOf(*sess)->ConnectedSqDepth(), 8u);
  for (int i = 2; i <= 5; ++i) write(i);  // 4 x 2 slots: the queue is full, nothing completes
  const auto t0 = std::chrono::steady_clock::now();
  write(6);  // returns once it gave up waiting for room
  const int64_t waited = MsSince(t0);
  ASSERT_EQ(st[6]->PeekCode(), StatusCode::ERR_RDMA_OP) << st[6]->Message();
  EXPECT_TRUE(Contains(st[6]->Message(), "SQ full")) << st[6]->Message();
  EXPECT_GE(waited, kSqBoundMs) << "gave up before the configured bound";
  std::cerr << "SQ full after " << waited << " ms (bound " << kSqBoundMs << " ms)\n";
  for (int i = 2; i <= 5; ++i) {
    EXPECT_EQ(st[i]->PeekCode(), StatusCode::IN_PROGRESS) << "write " << i << " ended while the target was stopped";
  }

  stall.Continue();
  // Only write 6 failed: the others complete, land and are announced.
  for (int i = 1; i <= 5; ++i) {
    ASSERT_TRUE(Ends(st[i], StatusCode::SUCCESS)) << "write " << i;
    EXPECT_EQ(stall.Hash(i * 4096, 4096), HashBytes(L() + i * 4096, 4096)) << "write " << i;
    EXPECT_TRUE(Noticed(uids[i], true, &stall)) << "write " << i;
  }
  const std::vector<uint8_t> zeros(4096, 0);
  EXPECT_EQ(stall.Hash(6 * 4096, 4096), HashBytes(zeros.data(), 4096)) << "the failed write was not posted";
  EXPECT_FALSE(Noticed(uids[6], false, &stall)) << "an incomplete transfer is never announced";
  // The connection is fine: the next transfers on the same QP go through.
  write(7);
  ASSERT_TRUE(Ends(st[7], StatusCode::SUCCESS));
  EXPECT_EQ(stall.Hash(7 * 4096, 4096), HashBytes(L() + 7 * 4096, 4096));
  EXPECT_TRUE(Noticed(uids[7], true, &stall));
  EXPECT_EQ(stall.Notices().second, 0u) << "the target holds a partly announced transfer";
}

// A transfer over two QPs whose second QP has no room within the bound
// fails "SQ full" without announcing any part of it: the notices go out
// only once every QP the transfer uses has room, so the target never keeps
// a partial notice. Counted on the target: notices received, and transfers
// with some but not all of their notices (must be none).
TEST_F(RdmaTransferTest, SendQueueFullOnOneQpOfAStripedTransferAnnouncesNoPart) {
  PeerProcess stall("rdma-target-sq-striped", 1 << 20, "");
  Start({{"sq_depth", 8}, {"notif_per_qp", 1}, {"sq_full_timeout_ms", kSqBoundMs}, {"qp_per_transfer", 2}}, 1 << 20);
  engine_->RegisterRemoteEngine(stall.engine());
  FillPattern(L(), 0, 1 << 20, 151);
  // Small writes go to QP 0, 1, 0, 1, ... (one QP each, round-robin).
  SlotWrites write = WritesTo(&stall);
  auto& uids = write.uids;
  auto& st = write.st;
  for (int i = 0; i < 2; ++i) {  // one per QP; popped: both QPs' buffers are posted
    const size_t k = write(i);
    ASSERT_TRUE(Ends(st[k], StatusCode::SUCCESS));
    ASSERT_TRUE(Noticed(uids[k], true, &stall));
  }
  const auto counters0 = stall.Notices();

  stall.Stop();
  for (int i = 2; i < 4; ++i) {  // take each QP's buffer: they complete
    const size_t k = write(i);
    ASSERT_TRUE(Ends(st[k], StatusCode::SUCCESS));
  }
  // Stuck from here on: QP 0 gets 4 writes (8 slots, full), QP 1 gets 3 (6).
  for (int i = 4; i < 11; ++i) write(i);
  // 128 KiB: two 64 KiB stripes, one per QP, each 1 write + notice. The
  // round-robin start is QP 1 now, which has room; QP 0 has none.
  const TransferUid striped = engine_->AllocateTransferUid();
  const auto t0 = std::chrono::steady_clock::now();
  auto big = engine_->Write(local_, 256 << 10, stall.memory(), 256 << 10, 128 << 10, striped);
  const int64_t waited = MsSince(t0);
  // It ends when it gives up: none of its parts was posted (a posted part,
  // with its notice, would keep it in flight until the target runs again).
  ASSERT_EQ(big->PeekCode(), StatusCode::ERR_RDMA_OP)
      << "a part of the failed transfer was posted: " << StatusCodeName(big->PeekCode()) << " " << big->Message();
  EXPECT_TRUE(Contains(big->Message(), "SQ full")) << big->Message();
  EXPECT_GE(waited, kSqBoundMs);
  for (size_t k = 4; k < st.size(); ++k) EXPECT_EQ(st[k]->PeekCode(), StatusCode::IN_PROGRESS) << "write " << k;

  stall.Continue();
  for (size_t k = 2; k < st.size(); ++k) {
    ASSERT_TRUE(Ends(st[k], StatusCode::SUCCESS)) << "write " << k;
    EXPECT_EQ(stall.Hash(k * 4096, 4096), HashBytes(L() + k * 4096, 4096)) << "write " << k;
    EXPECT_TRUE(Noticed(uids[k], true, &stall)) << "write " << k;
  }
  // One more write per QP, behind anything the striped transfer could have
  // put on either QP: once these are announced, the target has seen it all.
  for (int i = 11; i < 13; ++i) {
    const size_t k = write(i);
    ASSERT_TRUE(Ends(st[k], StatusCode::SUCCESS));
    EXPECT_TRUE(Noticed(uids[k], true, &stall));
  }
  EXPECT_FALSE(Noticed(striped, false, &stall));
  const auto counters1 = stall.Notices();
  EXPECT_EQ(counters1.first - counters0.first, st.size() - 2)
      << "notices received: one per successful write, none of the failed striped transfer";
  EXPECT_EQ(counters1.second, 0u) << "the target holds a partly announced transfer";
}

// A QP that completes nothing for inactivity_timeout_ms drops its
// connection. Made here as in the SQ-full tests: the target is stopped with
// its one notice buffer used up, so the next write's notice is retried
// without limit (receiver not ready) and its chain never ends; the same
// silence comes from a path whose retransmissions never get through (rxe
// retries without limit at retry_cnt 7). Failover on: the write is retried
// over a fresh connection and lands once the target runs again. Off: it
// fails, naming the bound, instead of staying IN_PROGRESS while the target
// is stopped; the next transfer reconnects. The second run's completion
// thread waits on events: asleep while idle, it must wake up when work is
// posted to watch it.
constexpr int64_t kStallBoundMs = 500;

TEST_F(RdmaTransferTest, StalledQpDropsItsConnectionAfterTheInactivityBound) {
  for (bool failover : {true, false}) {
    SCOPED_TRACE(failover ? "failover on" : "failover off");
    PeerProcess stall(failover ? "rdma-target-stall-retry" : "rdma-target-stall-fail", 1 << 20, "");
    Start({{"notif_per_qp", 1},
           {"qp_per_transfer", 1},
           {"inactivity_timeout_ms", kStallBoundMs},
           {"poll_cq_mode", failover ? 0 : 1}},
          1 << 20, failover);
    engine_->RegisterRemoteEngine(stall.engine());
    FillPattern(L(), 0, 1 << 20, failover ? 171 : 172);
    SlotWrites write = WritesTo(&stall);
    auto& uids = write.uids;
    auto& st = write.st;
    ASSERT_TRUE(StopWithNoticeBufferUsedUp(write, stall));
    const auto t0 = std::chrono::steady_clock::now();
    write(2);  // its notice finds no buffer: nothing completes on the QP
    if (failover) {
      // Dropped after the bound, then retried: the retry's connection
      // waits for the stopped target (within connect_timeout_ms).
      ASSERT_TRUE(testing_util::PollUntil([&] { return engine_->Failover().retry.retries >= 1; }, 20000))
          << "the stalled write was not retried: " << StatusCodeName(st[2]->PeekCode()) << " " << st[2]->Message();
      EXPECT_GE(MsSince(t0), kStallBoundMs) << "dropped before the bound";
      stall.Continue();
      ASSERT_TRUE(Ends(st[2], StatusCode::SUCCESS));
      EXPECT_EQ(stall.Hash(2 * 4096, 4096), HashBytes(L() + 2 * 4096, 4096));
      EXPECT_TRUE(Noticed(uids[2], true, &stall));
      EXPECT_FALSE(stall.Pop(key(), uids[2])) << "noticed twice";
      EXPECT_GE(engine_->Failover().retry.recovered, 1u);
    } else {
      const StatusCode code = st[2]->WaitFor(kWaitMs);
      const int64_t waited = MsSince(t0);
      stall.Continue();
      ASSERT_EQ(code, StatusCode::ERR_RDMA_OP) << st[2]->Message();
      EXPECT_TRUE(Contains(st[2]->Message(), "inactivity_timeout_ms=500")) << st[2]->Message();
      EXPECT_GE(waited, kStallBoundMs);
      EXPECT_LT(waited, kStallBoundMs + 10000) << "the stall was not judged in time";
      std::cerr << "stalled write failed after " << waited << " ms (bound " << kStallBoundMs << " ms)\n";
      EXPECT_EQ(engine_->Failover().retry.retries, 0u);
      write(3);  // a fresh connection
      ASSERT_TRUE(Ends(st[3], StatusCode::SUCCESS));
      EXPECT_EQ(stall.Hash(3 * 4096, 4096), HashBytes(L() + 3 * 4096, 4096));
      EXPECT_TRUE(Noticed(uids[3], true, &stall));
    }
    EXPECT_EQ(stall.Notices().second, 0u) << "the target holds a partly announced transfer";
    TearDown();
  }
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
  Start({{"qp_per_transfer", 2}, {"notif_per_qp", 1}});
  CheckWrite(0, 0, 4096, 121, true);
  // Deregistration waits for transfers using the memory, then later ones fail.
  auto st = engine_->Write(local_, 0, peer_->memory(), 0, 8 << 20, 2);
  engine_->DeregisterMemory(local_);
  EXPECT_TRUE(st->PeekCode() == StatusCode::SUCCESS || st->Failed()) << StatusCodeName(st->PeekCode());
  auto after = engine_->Write(local_, 0, peer_->memory(), 0, 8, 3);
  EXPECT_EQ(after->PeekCode(), StatusCode::ERR_NOT_FOUND);
  local_ = engine_->RegisterMemory(reinterpret_cast<uint64_t>(L()), 1 << 20, -1, MemoryLocationType::CPU);
  CheckWrite(0, 0, 4096, 122, true);
  // Removing the backend ends what is in flight, with its reason. In flight
  // for certain: a stopped target with one notice buffer per QP (see the
  // SQ-full tests) acknowledges at most one more write per QP.
  PeerProcess stall("rdma-target-removal", 1 << 20, "");
  engine_->RegisterRemoteEngine(stall.engine());
  for (int i = 0; i < 2; ++i) {  // one per QP; popped: each QP's buffer is posted
    const TransferUid uid = engine_->AllocateTransferUid();
    ASSERT_TRUE(Ends(engine_->Write(local_, 0, stall.memory(), 0, 4096, uid), StatusCode::SUCCESS));
    ASSERT_TRUE(Noticed(uid, true, &stall));
  }
  stall.Stop();
  std::vector<StatusPtr> inflight;
  for (int i = 0; i < 6; ++i) inflight.push_back(engine_->Write(local_, 0, stall.memory(), i * 4096, 4096, 30 + i));
  size_t pending = 0;
  for (auto& s : inflight) pending += s->PeekCode() == StatusCode::IN_PROGRESS;
  ASSERT_GE(pending, 4u) << "3 writes per QP, at most 1 of them acknowledged";
  engine_->RemoveBackend(BackendType::RDMA);
  size_t removed = 0;
  for (auto& s : inflight) {
    const StatusCode c = s->WaitFor(kWaitMs);
    if (c == StatusCode::SUCCESS) continue;
    EXPECT_EQ(c, StatusCode::ERR_RDMA_OP) << s->Message();
    EXPECT_TRUE(Contains(s->Message(), "RDMA backend was removed")) << s->Message();
    ++removed;
  }
  EXPECT_GE(removed, 4u) << "the writes that could not complete did not fail with the removal";
  stall.Continue();
  auto none = engine_->Write(local_, 0, peer_->memory(), 0, 8, 20);
  EXPECT_EQ(none->PeekCode(), StatusCode::ERR_BAD_STATE);
}

// GID selection. The suite itself runs without MORI_RDMA_GID_INDEX (see
// tests/rdma_vm/run_in_vm.sh), so every test above already used the
// automatic choice; this one checks what it picks on both rails.
TEST(RdmaDeviceTest, AutomaticGidIsTheIpv4MappedRoceV2OneAndOverridesWin) {
  ScopedEnv no_env1("MORI_RDMA_GID_INDEX", nullptr), no_env2("MORI_TORCH_RDMA_GID_INDEX", nullptr);
  ScopedEnv no_env3("MORI_IB_GID_INDEX", nullptr);
  ScopedEnv both("MORI_TORCH_RDMA_DEVICES", "rxe0,rxe1");
  std::string why;
  const rdma::VerbsApi* api = rdma::LoadVerbs(&why);
  ASSERT_NE(api, nullptr) << why;
  auto rails = rdma::OpenActiveDevices(api, -1);
  ASSERT_EQ(rails.size(), 2u);
  // rxe's table: index 0 the link-local default GID, index 1 the IPv4-mapped
  // RoCE v2 GID of the interface's address (connecting through 0 fails).
  EXPECT_EQ(rails[0]->name, "rxe0");
  EXPECT_EQ(rails[0]->gid_index, 1);
  EXPECT_EQ(rdma::GidText(rails[0]->gid), "0000:0000:0000:0000:0000:ffff:c000:0201");  // ::ffff:192.0.2.1
  EXPECT_EQ(rails[1]->name, "rxe1");
  EXPECT_EQ(rails[1]->gid_index, 1);
  EXPECT_EQ(rdma::GidText(rails[1]->gid), "0000:0000:0000:0000:0000:ffff:c000:0202");  // ::ffff:192.0.2.2
  // The environment overrides the automatic choice, the config overrides both.
  {
    ScopedEnv env("MORI_RDMA_GID_INDEX", "0");
    rails = rdma::OpenActiveDevices(api, -1);
    ASSERT_EQ(rails.size(), 2u);
    EXPECT_EQ(rails[0]->gid_index, 0);
    EXPECT_EQ(rdma::GidText(rails[0]->gid).substr(0, 4), "fe80");
    rails = rdma::OpenActiveDevices(api, 1);
    EXPECT_EQ(rails[0]->gid_index, 1);
  }
  // MORI's names, as SGLang sets them: MORI_IB_GID_INDEX, and
  // MORI_RDMA_DEVICES in its order, or with '^' to exclude.
  {
    ScopedEnv ours("MORI_TORCH_RDMA_DEVICES", nullptr), mori("MORI_RDMA_DEVICES", "rxe1,rxe0");
    ScopedEnv gid("MORI_IB_GID_INDEX", "0");
    rails = rdma::OpenActiveDevices(api, -1);
    ASSERT_EQ(rails.size(), 2u);
    EXPECT_EQ(rails[0]->name, "rxe1");
    EXPECT_EQ(rails[1]->name, "rxe0");
    EXPECT_EQ(rails[0]->gid_index, 0);
  }
  {
    ScopedEnv ours("MORI_TORCH_RDMA_DEVICES", nullptr), mori("MORI_RDMA_DEVICES", "^rxe0");
    rails = rdma::OpenActiveDevices(api, -1);
    ASSERT_EQ(rails.size(), 1u);
    EXPECT_EQ(rails[0]->name, "rxe1");
    EXPECT_EQ(rails[0]->gid_index, 1);
  }
}

TEST(RdmaDeviceTest, UnusableGidIndexFailsNamingIt) {
  ScopedEnv no_env1("MORI_RDMA_GID_INDEX", nullptr), no_env2("MORI_TORCH_RDMA_GID_INDEX", nullptr);
  ScopedEnv no_env3("MORI_IB_GID_INDEX", nullptr);
  EngineConfig ec;
  ec.host = rdma_test::TestHost();
  Engine e("rdma-gid-99", ec);
  auto err = testing_util::CatchError([&] { e.CreateBackend(BackendType::RDMA, {{"gid_index", 99}}); });
  ASSERT_TRUE(err);
  EXPECT_EQ(err->code(), StatusCode::ERR_BAD_STATE);
  EXPECT_TRUE(Contains(err->what(), "no active RDMA device/port found")) << err->what();
  EXPECT_TRUE(Contains(err->what(), "no usable GID at index 99, set by gid_index")) << err->what();
  {
    ScopedEnv env("MORI_RDMA_GID_INDEX", "99");
    err = testing_util::CatchError([&] { e.CreateBackend(BackendType::RDMA, {}); });
    ASSERT_TRUE(err);
    EXPECT_TRUE(Contains(err->what(), "no usable GID at index 99, set by MORI_RDMA_GID_INDEX")) << err->what();
  }
  {
    ScopedEnv env("MORI_RDMA_GID_INDEX", "one");
    err = testing_util::CatchError([&] { e.CreateBackend(BackendType::RDMA, {}); });
    ASSERT_TRUE(err);
    EXPECT_EQ(err->code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_TRUE(Contains(err->what(), "MORI_RDMA_GID_INDEX='one'")) << err->what();
  }
  e.CreateBackend(BackendType::RDMA, {});  // the engine is unharmed; the automatic GID works
  EXPECT_TRUE(e.HasBackend(BackendType::RDMA));
  e.Shutdown();
}

// GPU memory goes through dma-buf first and falls back to ibv_reg_mr. Here
// (no GPU, a CPU-only core) the dma-buf step always fails, so a descriptor
// that says GPU exercises the fallback: over real pages it registers, over
// unmapped memory the error names both attempts and nothing aborts.
TEST(RdmaMrCacheTest, GpuMemoryFallsBackToPlainRegistrationAndFailuresAreErrors) {
  std::string why;
  const rdma::VerbsApi* api = rdma::LoadVerbs(&why);
  ASSERT_NE(api, nullptr) << why;
  auto rails = rdma::OpenActiveDevices(api, -1);
  ASSERT_FALSE(rails.empty());
  rdma::MrCache cache(rails);
  HostBuf buf(1 << 20);
  MemoryDesc gpu;
  gpu.engine_key = "mr-test";
  gpu.id = 7;
  gpu.device_id = 0;
  gpu.loc = MemoryLocationType::GPU;
  gpu.data = reinterpret_cast<uint64_t>(buf.p);
  gpu.size = buf.size;
  ibv_mr* mr = cache.Get(0, gpu);
  ASSERT_NE(mr, nullptr);
  EXPECT_EQ(reinterpret_cast<uint64_t>(mr->addr), gpu.data);
  EXPECT_GE(mr->length, gpu.size);
  EXPECT_EQ(cache.Get(0, gpu), mr);  // cached
  cache.Drop(gpu.id);

  // Unmapped: both registrations fail; an Error, and the cache stays usable.
  void* hole = mmap(nullptr, 1 << 20, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(hole, MAP_FAILED);
  munmap(hole, 1 << 20);
  MemoryDesc gone = gpu;
  gone.id = 8;
  gone.data = reinterpret_cast<uint64_t>(hole);
  auto err = testing_util::CatchError([&] { cache.Get(0, gone); });
  ASSERT_TRUE(err);
  EXPECT_EQ(err->code(), StatusCode::ERR_RDMA_OP);
  EXPECT_TRUE(Contains(err->what(), "cannot register GPU memory 8")) << err->what();
  EXPECT_TRUE(Contains(err->what(), "ibv_reg_mr")) << err->what();
  EXPECT_TRUE(Contains(err->what(), "dma-buf")) << err->what();
  ibv_mr* again = cache.Get(0, gpu);
  ASSERT_NE(again, nullptr);
  cache.Clear();
}

}  // namespace
}  // namespace mori_torch

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);  // a dead peer's pipe must fail a write, not kill us
  if (argc > 1 && std::string(argv[1]) == "--peer") return mori_torch::rdma_test::RunPeer(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
