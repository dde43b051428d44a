// Transfer counters (core/transfer_stats.h), the status that ends them once,
// per-subsystem log levels, the structured log lines and thread names.
#include <gtest/gtest.h>

#include <pthread.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "core/logging.h"
#include "core/thread_name.h"
#include "core/transfer_stats.h"
#include "core/transfer_status.h"

namespace mori_torch {
namespace {

TEST(TransferStatsTest, LatencyBucketsArePowersOfTwoMicroseconds) {
  EXPECT_EQ(TransferCounters::LatencyBucket(0), 0);
  EXPECT_EQ(TransferCounters::LatencyBucket(999), 0);   // under 1 us
  EXPECT_EQ(TransferCounters::LatencyBucket(1000), 1);  // [1, 2) us
  EXPECT_EQ(TransferCounters::LatencyBucket(1999), 1);
  EXPECT_EQ(TransferCounters::LatencyBucket(2000), 2);         // [2, 4) us
  EXPECT_EQ(TransferCounters::LatencyBucket(1000000000), 20);  // 1 s = 2^19.9 us: [2^19, 2^20) us
  EXPECT_EQ(TransferCounters::LatencyBucket(-5), 0);
  EXPECT_EQ(TransferCounters::LatencyBucket(INT64_MAX), kLatencyBuckets - 1);
}

TEST(TransferStatsTest, CountsStartEndAndRejected) {
  TransferCounters c;
  c.Start(true);
  c.Start(false);
  c.Start(false);
  c.Rejected(true, StatusCode::ERR_INVALID_ARGS);
  TransferCountsSnapshot s = c.Snapshot();
  EXPECT_EQ(s.reads, 2u);
  EXPECT_EQ(s.writes, 2u);
  EXPECT_EQ(s.in_flight, 3);
  EXPECT_EQ(s.errors[static_cast<int>(StatusCode::ERR_INVALID_ARGS)], 1u);

  c.End(true, 100, StatusCode::SUCCESS, 1500);     // 1.5 us
  c.End(false, 4096, StatusCode::SUCCESS, 3000);   // 3 us
  c.End(false, 7, StatusCode::ERR_NOT_FOUND, 10);  // failed: its bytes do not count
  s = c.Snapshot();
  EXPECT_EQ(s.in_flight, 0);
  EXPECT_EQ(s.succeeded, 2u);
  EXPECT_EQ(s.bytes_read, 100u);
  EXPECT_EQ(s.bytes_written, 4096u);
  EXPECT_EQ(s.errors[static_cast<int>(StatusCode::ERR_NOT_FOUND)], 1u);
  EXPECT_EQ(s.Errors(), 2u);
  EXPECT_EQ(s.latency[0], 1u);
  EXPECT_EQ(s.latency[1], 1u);
  EXPECT_EQ(s.latency[2], 1u);
  EXPECT_EQ(s.latency_sum_ns, 4510u);
  // Every transfer is accounted for: succeeded, failed or in flight.
  EXPECT_EQ(s.Transfers(), s.succeeded + s.Errors() + static_cast<uint64_t>(s.in_flight));
}

TEST(TransferStatsTest, StatusEndsItsRecordOnceAtTheFirstTerminalCode) {
  auto counters = std::make_shared<TransferCounters>();
  TransferStatus st;
  st.Update(StatusCode::IN_PROGRESS);
  counters->Start(false);
  st.SetRecord(TransferRecord{counters, false, 64, StatsNowNs(), 0});
  st.Update(StatusCode::IN_PROGRESS);
  EXPECT_EQ(counters->Snapshot().in_flight, 1);
  st.Update(StatusCode::SUCCESS);
  st.Update(StatusCode::ERR_BAD_STATE, "late error");  // sticks on the status, not counted again
  const TransferCountsSnapshot s = counters->Snapshot();
  EXPECT_EQ(s.in_flight, 0);
  EXPECT_EQ(s.succeeded, 1u);
  EXPECT_EQ(s.bytes_written, 64u);
  EXPECT_EQ(s.Errors(), 0u);
  uint64_t ended = 0;
  for (uint64_t n : s.latency) ended += n;
  EXPECT_EQ(ended, 1u);
}

TEST(TransferStatsTest, ConcurrentEndsLoseNothing) {
  auto counters = std::make_shared<TransferCounters>();
  constexpr int kThreads = 4, kPer = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPer; ++i) {
        counters->Start(i % 2 == 0);
        counters->End(i % 2 == 0, 8, i % 10 == 0 ? StatusCode::ERR_BAD_STATE : StatusCode::SUCCESS, 100);
      }
    });
  }
  for (auto& t : threads) t.join();
  const TransferCountsSnapshot s = counters->Snapshot();
  EXPECT_EQ(s.Transfers(), uint64_t{kThreads} * kPer);
  EXPECT_EQ(s.errors[static_cast<int>(StatusCode::ERR_BAD_STATE)], uint64_t{kThreads} * kPer / 10);
  EXPECT_EQ(s.bytes_read + s.bytes_written, 8 * s.succeeded);
  EXPECT_EQ(s.in_flight, 0);
}

TEST(TransferStatsTest, JsonQuotesPeerKeysAndLeavesOutIdlePairs) {
  TransferStats stats;
  auto peer = stats.ForPeer("we\"ird\\key\n");
  EXPECT_EQ(stats.ForPeer("we\"ird\\key\n"), peer);  // one entry per key
  stats.ForPeer("idle");
  auto tcp = TransferStats::Of(peer, BackendType::TCP);
  tcp->Start(true);
  tcp->End(true, 10, StatusCode::SUCCESS, 5000);
  stats.Unrouted().Rejected(false, StatusCode::ERR_NOT_FOUND);
  const std::string j = stats.ToJson("eng");
  EXPECT_NE(j.find("\"we\\\"ird\\\\key\\u000a\": {\"TCP\": {\"reads\": 1"), std::string::npos) << j;
  EXPECT_EQ(j.find("idle"), std::string::npos) << j;
  EXPECT_NE(j.find("\"backends\": {\"TCP\": {\"reads\": 1"), std::string::npos) << j;
  // The total adds the refused write to the TCP read.
  EXPECT_NE(j.find("\"total\": {\"reads\": 1, \"writes\": 1, \"transfers\": 2"), std::string::npos) << j;
  EXPECT_NE(j.find("\"errors\": {\"ERR_NOT_FOUND\": 1}"), std::string::npos) << j;
  EXPECT_EQ(TransferStats::Of(peer, static_cast<BackendType>(9)), nullptr);
}

class LogLevelTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = LogLevelSpec(); }
  void TearDown() override { SetLogLevel(saved_); }
  std::string saved_;
};

TEST_F(LogLevelTest, PerSubsystemSpec) {
  SetLogLevel("error,tcp=debug,rdma=trace");
  EXPECT_EQ(GetLogLevel(LogSubsystemByName("tcp")), LogLevel::Debug);
  EXPECT_EQ(GetLogLevel(LogSubsystemByName("rdma")), LogLevel::Trace);
  EXPECT_EQ(GetLogLevel(LogSubsystemByName("ctrl")), LogLevel::Error);
  EXPECT_EQ(GetLogLevel(), LogLevel::Error);
  EXPECT_EQ(LogLevelSpec(), "error,tcp=debug,rdma=trace");
  SetLogLevel("xgmi=info");  // pairs alone leave the others as they are
  EXPECT_EQ(LogLevelSpec(), "error,tcp=debug,rdma=trace,xgmi=info");
  SetLogLevel("WARNING");  // a bare level resets every subsystem
  EXPECT_EQ(LogLevelSpec(), "warning");
}

TEST_F(LogLevelTest, BadSpecNamesThePartAndChangesNothing) {
  SetLogLevel("warning");
  try {
    SetLogLevel("info,tpc=debug");
    FAIL() << "accepted an unknown subsystem";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_NE(std::string(e.what()).find("unknown subsystem 'tpc'"), std::string::npos) << e.what();
  }
  try {
    SetLogLevel("tcp=loud");
    FAIL() << "accepted an unknown level";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown level 'loud'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(LogLevelSpec(), "warning");
}

TEST(LogOriginTest, SubsystemAndFileComeFromThePath) {
  const LogOrigin tcp("/src/x/csrc/backends/tcp/tcp_backend.cpp");
  EXPECT_STREQ(LogSubsystemName(tcp.subsystem), "tcp");
  EXPECT_STREQ(tcp.file, "backends/tcp/tcp_backend.cpp");
  EXPECT_STREQ(LogSubsystemName(LogOrigin("csrc/core/control_plane.cpp").subsystem), "ctrl");
  EXPECT_STREQ(LogSubsystemName(LogOrigin("csrc/core/event_loop.cpp").subsystem), "loop");
  EXPECT_STREQ(LogSubsystemName(LogOrigin("csrc/core/engine.cpp").subsystem), "engine");
  EXPECT_STREQ(LogSubsystemName(LogOrigin("csrc/core/memory_registry.cpp").subsystem), "core");
  EXPECT_STREQ(LogSubsystemName(LogOrigin("csrc/stream/doorbell.cpp").subsystem), "stream");
  EXPECT_STREQ(LogSubsystemName(LogOrigin("elsewhere.cpp").subsystem), "core");
}

TEST(LogRoutingTest, DrainedLinesCarryThreadFileAndLine) {
  const std::string saved = LogLevelSpec();
  SetLogLevel("warning");
  ASSERT_TRUE(FlushLog(2000));
  RouteLogToReader(true);
  int line = 0;
  std::thread t([&] {
    SetThreadName("mori-test-logger");  // 16 bytes: cut to 15
    line = __LINE__ + 1;
    MORI_LOG(Warning, "routed line " << 42);
  });
  t.join();
  std::vector<LogRecord> got;
  for (int i = 0; i < 50 && got.empty(); ++i) {
    for (auto& r : DrainLog(16, 100)) {
      if (r.msg == "routed line 42") got.push_back(std::move(r));
    }
  }
  RouteLogToReader(false);
  SetLogLevel(saved);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].level, LogLevel::Warning);
  EXPECT_EQ(got[0].thread, "mori-test-logge");
  EXPECT_EQ(got[0].line, line);
  EXPECT_NE(std::string(got[0].file).find("observability_test.cpp"), std::string::npos);
  EXPECT_STREQ(LogSubsystemName(got[0].subsystem), "core");
}

TEST(LogRoutingTest, DrainReturnsAtOnceWhenNotRouted) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(DrainLog(16, 5000).empty());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

TEST(ThreadNameTest, NamesTheKernelThreadAndTheCache) {
  std::string seen, cached;
  std::thread t([&] {
    SetThreadName("mori-unit");
    char buf[16] = "";
    pthread_getname_np(pthread_self(), buf, sizeof buf);
    seen = buf;
    cached = ThisThreadName();
  });
  t.join();
  EXPECT_EQ(seen, "mori-unit");
  EXPECT_EQ(cached, "mori-unit");
}

}  // namespace
}  // namespace mori_torch
