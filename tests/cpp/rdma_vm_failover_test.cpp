// Failover between backends on real verbs (Soft-RoCE in the test VM): an
// initiator with RDMA and TCP talks to a target process that has both. Its
// QPs are forced into the error state mid-run (ibv_modify_qp to
// IBV_QPS_ERR through rdma::FailNextPostedQpsForTest, as a failing NIC or
// link would): the transfers caught must complete over TCP with the right
// bytes and one notice each, later ones go over TCP while RDMA is down, and
// a probe brings the peer back to RDMA once it is healthy. Run through
// tests/rdma_vm/run_ctest.sh.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <thread>

#include "backends/rdma/rdma_send_qp.h"
#include "core/engine.h"
#include "rdma_vm_peer.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using rdma_test::FillPattern;
using rdma_test::HashBytes;
using rdma_test::PeerProcess;
using testing_util::PollUntil;

constexpr uint64_t kBuf = 16ull << 20;
constexpr int kWaitMs = 60000;

class RdmaFailoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = std::make_unique<PeerProcess>("rdma-fo-target", kBuf, "enable_notification=1");
    EngineConfig ec;
    ec.host = rdma_test::TestHost();
    ec.failover.probe_ms = 300;
    engine_ = std::make_unique<Engine>("rdma-fo-init", ec);
    engine_->CreateBackend(BackendType::RDMA, {{"enable_notification", 1}});
    engine_->CreateBackend(BackendType::TCP, {});
    engine_->RegisterRemoteEngine(peer_->engine());
    buf_ = static_cast<uint8_t*>(mmap(nullptr, kBuf, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    local_ = engine_->RegisterMemory(reinterpret_cast<uint64_t>(buf_), kBuf, -1, MemoryLocationType::CPU);
  }
  void TearDown() override {
    rdma::FailNextPostedQpsForTest(0);
    engine_->Shutdown();
    munmap(buf_, kBuf);
    peer_.reset();
  }

  bool NoticedOnce(TransferUid uid) {
    if (!PollUntil([&] { return peer_->Pop("rdma-fo-init", uid); }, 10000)) return false;
    return !peer_->Pop("rdma-fo-init", uid);
  }

  // A write of fresh bytes and a read back of the target's, both verified.
  void RoundTrip(Session& s, uint64_t off, uint64_t n, uint64_t seed) {
    FillPattern(buf_ + off, 0, n, seed);
    TransferUid uid = engine_->AllocateTransferUid();
    StatusPtr st = s.Write(static_cast<int64_t>(off), static_cast<int64_t>(off), static_cast<int64_t>(n), uid);
    ASSERT_EQ(st->WaitFor(kWaitMs), StatusCode::SUCCESS) << st->Message();
    ASSERT_EQ(peer_->Hash(off, n), HashBytes(buf_ + off, n)) << "write of " << n << " bytes, seed " << seed;
    ASSERT_TRUE(NoticedOnce(uid)) << "write " << uid;
    ASSERT_EQ(peer_->Command("fill " + std::to_string(seed + 1)), "OK");
    std::memset(buf_ + off, 0, n);
    uid = engine_->AllocateTransferUid();
    st = engine_->Read(local_, static_cast<int64_t>(off), peer_->memory(), static_cast<int64_t>(off),
                       static_cast<int64_t>(n), uid);
    ASSERT_EQ(st->WaitFor(kWaitMs), StatusCode::SUCCESS) << st->Message();
    std::vector<uint8_t> want(n);
    FillPattern(want.data(), off, n, seed + 1);
    ASSERT_EQ(HashBytes(buf_ + off, n), HashBytes(want.data(), n)) << "read of " << n << " bytes";
    ASSERT_TRUE(NoticedOnce(uid)) << "read " << uid;
  }

  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<Engine> engine_;
  uint8_t* buf_ = nullptr;
  MemoryDesc local_;
};

TEST_F(RdmaFailoverTest, QpErrorFailsOverToTcpAndReturnsToRdma) {
  auto session = engine_->CreateSession(local_, peer_->memory());
  ASSERT_TRUE(session);
  ASSERT_EQ(session->backend_type(), BackendType::RDMA);
  RoundTrip(*session, 0, 1 << 20, 1);
  EXPECT_EQ(engine_->Failover().failover.failovers, 0u);
  // A 4 MiB write over healthy RDMA, timed: the baseline of the failover time.
  auto timed_write = [&](uint64_t seed) {
    FillPattern(buf_, 0, 4 << 20, seed);
    const auto t0 = std::chrono::steady_clock::now();
    StatusPtr st = session->Write(0, 0, 4 << 20, engine_->AllocateTransferUid());
    EXPECT_EQ(st->WaitFor(kWaitMs), StatusCode::SUCCESS) << st->Message();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(peer_->Hash(0, 4 << 20), HashBytes(buf_, 4 << 20));
    return ms;
  };
  const double healthy_ms = timed_write(2);

  // The QP of the next transfer goes into error as it is posted:
  // the write is caught, fails over and completes over TCP.
  rdma::FailNextPostedQpsForTest(1);
  const double failover_ms = timed_write(3);
  const auto down_at = std::chrono::steady_clock::now();
  EXPECT_EQ(engine_->Failover().failover.failovers, 1u);
  RoundTrip(*session, 4096, 4 << 20, 10);
  FailoverCounters f = engine_->Failover();
  EXPECT_EQ(f.failover.failovers, 1u);
  EXPECT_GE(f.retry.retries, 1u);
  EXPECT_GE(f.retry.recovered, 1u);
  EXPECT_EQ(f.retry.exhausted, 0u);

  // While RDMA is down (until its probe) transfers of every size go over TCP.
  for (uint64_t n : {uint64_t{1}, uint64_t{4096}, uint64_t{1} << 20, kBuf / 2}) RoundTrip(*session, 0, n, 20 + n);

  // A probe after the pause finds RDMA healthy (fresh QPs): the peer returns.
  uint64_t seed = 100;
  ASSERT_TRUE(PollUntil(
      [&] {
        RoundTrip(*session, 8192, 65536, seed += 2);
        return engine_->Failover().failover.returns == 1;
      },
      20000))
      << "no return to RDMA";
  const double return_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - down_at).count();
  // benchmarks/ and docs/BENCHMARK.md quote this line.
  std::cout << "FAILOVER_TIMES healthy_write_ms=" << healthy_ms << " failover_write_ms=" << failover_ms
            << " added_ms=" << failover_ms - healthy_ms << " return_after_ms=" << return_ms << " probe_ms=300"
            << std::endl;
  f = engine_->Failover();
  EXPECT_EQ(f.failover.paths_down, 0u);
  EXPECT_GE(f.failover.probes, 1u);
  RoundTrip(*session, 0, 1 << 20, 200);
  EXPECT_EQ(session->backend_type(), BackendType::RDMA) << "the session is pinned to RDMA again";
  EXPECT_EQ(engine_->Failover().failover.failovers, 1u) << "no flapping";
}

TEST_F(RdmaFailoverTest, FailoverOffFailsTheTransfer) {
  engine_->Shutdown();
  EngineConfig ec;
  ec.host = rdma_test::TestHost();
  ec.retry.enabled = ec.failover.enabled = false;
  engine_ = std::make_unique<Engine>("rdma-fo-init", ec);
  engine_->CreateBackend(BackendType::RDMA, {});
  engine_->CreateBackend(BackendType::TCP, {});
  engine_->RegisterRemoteEngine(peer_->engine());
  local_ = engine_->RegisterMemory(reinterpret_cast<uint64_t>(buf_), kBuf, -1, MemoryLocationType::CPU);
  rdma::FailNextPostedQpsForTest(1);
  StatusPtr st = engine_->Write(local_, 0, peer_->memory(), 0, 1 << 20, 1);
  EXPECT_EQ(st->WaitFor(kWaitMs), StatusCode::ERR_RDMA_OP) << st->Message();
  EXPECT_EQ(engine_->Failover().retry.retries, 0u);
}

}  // namespace
}  // namespace mori_torch
