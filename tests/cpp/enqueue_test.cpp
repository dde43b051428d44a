// EnqueueOnStream against a host thread standing in for the GPU stream
// (host_stream.h), with real TCP engines: the staged path that moves "GPU"
// pages through a slot's pinned staging (pack before the doorbell, unpack
// after it), lists read when the stream gets there, graph capture replayed
// with new block tables, the error path (the stream is always released,
// a failed read unpacks nothing) and slot reuse. local_on_device marks the
// local bytes as the stream's own, which is what makes the path staged.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "core/engine.h"
#include "host_stream.h"
#include "stream/doorbell.h"
#include "stream/enqueue.h"
#include "tcp_session_pair.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::Contains;
using testing_util::FillRandom;
using testing_util::HostStream;
using testing_util::PollUntil;

constexpr int64_t kPage = 4096;
constexpr int64_t kPages = 64;
constexpr int kWaitMs = 20000;

class EnqueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pair_ = std::make_unique<testing_util::TcpSessionPair>("E", kPage * kPages, 11);
    session_ = pair_->session;
    ASSERT_TRUE(session_);
    device_.assign(kPage * kPages, 0);
    errors_ = std::make_shared<StreamErrors>();
  }
  void TearDown() override {
    stream_.reset();
    session_.reset();
    pair_.reset();
  }

  // A transfer between the stream's own bytes (device_, not the
  // registration: only the staged path can reach them) and the remote;
  // lists "on device".
  StreamTransfer Transfer(bool is_read, int64_t count) {
    StreamTransfer t;
    t.session = session_;
    t.errors = errors_;
    t.is_read = is_read;
    t.local_base = reinterpret_cast<uint64_t>(device_.data());
    t.local_size = device_.size();
    t.local_on_device = true;
    t.segs.count = count;
    return t;
  }

  StreamTransfer Pages(bool is_read, const int64_t* lp, const int64_t* rp, int64_t n) {
    StreamTransfer t = Transfer(is_read, n);
    t.segs.offset_scale = kPage;
    t.segs.uniform_size = kPage;
    t.lists = {{lp, rp, nullptr}};
    t.list_on_device = {{true, true, false}};
    t.list_names = {{"local_pages", "remote_pages", ""}};
    return t;
  }

  bool PageEquals(int64_t lp, int64_t rp) {
    return std::memcmp(device_.data() + lp * kPage, pair_->remote.data() + rp * kPage, kPage) == 0;
  }

  std::string TakeError(StatusCode* code) { return errors_->Take(code); }

  std::unique_ptr<testing_util::TcpSessionPair> pair_;
  std::vector<uint8_t> device_;
  std::shared_ptr<Session> session_;
  std::shared_ptr<StreamErrors> errors_;
  std::unique_ptr<HostStream> stream_ = std::make_unique<HostStream>();
};

TEST_F(EnqueueTest, StagedPageReadUnpacksIntoTheStreamsBytes) {
  auto& service = DoorbellService::Instance();
  const size_t watched = service.Watched();
  std::vector<int64_t> lp = {3, 9, 4, 60}, rp = {40, 2, 63, 0};
  EnqueueOnStream(Pages(true, lp.data(), rp.data(), 4), *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  for (size_t i = 0; i < lp.size(); ++i) EXPECT_TRUE(PageEquals(lp[i], rp[i])) << "page " << i;
  EXPECT_TRUE(std::all_of(pair_->local.begin(), pair_->local.end(), [](uint8_t v) { return v == 0; }))
      << "bytes went to the registration, not through the staging slot";
  EXPECT_TRUE(PollUntil([&] { return service.Watched() == watched; }, kWaitMs)) << "slot not recycled";
  StatusCode code;
  EXPECT_EQ(TakeError(&code), "");
}

TEST_F(EnqueueTest, StagedBatchWriteWithVariableSizesPacksAtPrefixSums) {
  FillRandom(device_, 5);
  std::vector<int64_t> lo = {100, 7000, 0, 20000}, ro = {50000, 0, 9000, 120000}, sz = {1000, 3, 4096, 7777};
  StreamTransfer t = Transfer(false, 4);
  t.lists = {{lo.data(), ro.data(), sz.data()}};
  t.list_on_device = {{true, true, true}};
  EnqueueOnStream(t, *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  for (size_t i = 0; i < lo.size(); ++i) {
    EXPECT_EQ(std::memcmp(pair_->remote.data() + ro[i], device_.data() + lo[i], sz[i]), 0) << "segment " << i;
  }
  StatusCode code;
  EXPECT_EQ(TakeError(&code), "");
}

TEST_F(EnqueueTest, CapturedReadReplaysWithEachReplaysBlockTable) {
  auto& service = DoorbellService::Instance();
  const size_t watched = service.Watched(), leased = service.Leased();
  std::vector<int64_t> lp(8), rp(8);  // the "device" block table, updated before every replay
  stream_->BeginCapture();
  EnqueueOnStream(Pages(true, lp.data(), rp.data(), 8), *stream_);
  auto graph = stream_->EndCapture();
  EXPECT_EQ(service.Leased(), leased + 1);
  for (int64_t r = 0; r < 100; ++r) {
    for (int64_t i = 0; i < 8; ++i) {
      lp[i] = (r * 8 + i) % kPages;
      rp[i] = (r * 13 + i * 5 + 1) % kPages;
    }
    stream_->Replay(*graph);
    ASSERT_TRUE(stream_->Synchronize()) << "replay " << r;
    for (int64_t i = 0; i < 8; ++i) ASSERT_TRUE(PageEquals(lp[i], rp[i])) << "replay " << r << " page " << i;
  }
  StatusCode code;
  EXPECT_EQ(TakeError(&code), "");
  stream_->Destroy(std::move(graph));
  // (Slots of earlier tests may still drain: poll both counts.)
  EXPECT_TRUE(PollUntil([&] { return service.Watched() <= watched && service.Leased() == leased; }, kWaitMs))
      << "captured slot not freed";
}

TEST_F(EnqueueTest, HostListsAreRefusedUnderCapture) {
  std::vector<int64_t> lp = {1}, rp = {2};
  StreamTransfer t = Pages(true, lp.data(), rp.data(), 1);
  t.list_on_device = {{false, true, false}};
  stream_->BeginCapture();
  try {
    EnqueueOnStream(t, *stream_);
    FAIL() << "a host list under capture was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_TRUE(Contains(e.what(), "local_pages is host memory")) << e.what();
  }
  EXPECT_TRUE(stream_->EndCapture()->items.empty()) << "something was enqueued before the refusal";
}

TEST_F(EnqueueTest, OutOfRangeLocalPageReleasesTheStreamAndMovesNothing) {
  std::vector<int64_t> lp = {2, kPages}, rp = {1, 1};  // the second local page is one past the end
  EnqueueOnStream(Pages(true, lp.data(), rp.data(), 2), *stream_);
  ASSERT_TRUE(stream_->Synchronize()) << "the stream was left waiting";
  StatusCode code;
  const std::string msg = TakeError(&code);
  EXPECT_EQ(code, StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(msg, "segment 1 (local page 64")) << msg;
  EXPECT_TRUE(Contains(msg, "engine 'EB'")) << msg;
  EXPECT_EQ(stream_->skipped_copies.load(), 1);  // the unpack of the failed read
  EXPECT_TRUE(std::all_of(device_.begin(), device_.end(), [](uint8_t v) { return v == 0; }));
}

TEST_F(EnqueueTest, OutOfRangeRemotePageFailsAtTheTargetAndUnpacksNothing) {
  std::vector<int64_t> lp = {2}, rp = {kPages + 5};
  EnqueueOnStream(Pages(true, lp.data(), rp.data(), 1), *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  StatusCode code;
  const std::string msg = TakeError(&code);
  EXPECT_EQ(code, StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(msg, "remote range out of bounds")) << msg;
  EXPECT_EQ(stream_->skipped_copies.load(), 1);
  EXPECT_TRUE(std::all_of(device_.begin(), device_.end(), [](uint8_t v) { return v == 0; }));
}

TEST_F(EnqueueTest, PeerGoneReleasesTheStreamWithAnError) {
  pair_->b->Shutdown();
  std::vector<int64_t> lp = {0}, rp = {0};
  EnqueueOnStream(Pages(true, lp.data(), rp.data(), 1), *stream_);
  ASSERT_TRUE(stream_->Synchronize()) << "the stream was left waiting on a dead peer";
  StatusCode code;
  const std::string msg = TakeError(&code);
  EXPECT_NE(code, StatusCode::SUCCESS);
  EXPECT_TRUE(Contains(msg, "stream-ordered read from engine 'EB' failed")) << msg;
}

TEST_F(EnqueueTest, EagerSlotsAreReused) {
  auto& service = DoorbellService::Instance();
  std::vector<int64_t> lp = {0, 1}, rp = {0, 1};
  EnqueueOnStream(Pages(true, lp.data(), rp.data(), 2), *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  ASSERT_TRUE(PollUntil([&] { return service.Watched() == 0 || service.PooledBytes() > 0; }, kWaitMs));
  const size_t pooled = service.PooledBytes();
  for (int64_t r = 0; r < 200; ++r) {
    lp = {r % kPages, (r + 1) % kPages};
    rp = {(r * 3) % kPages, (r * 5) % kPages};
    EnqueueOnStream(Pages(r % 2 == 0, lp.data(), rp.data(), 2), *stream_);
    ASSERT_TRUE(stream_->Synchronize());
    ASSERT_TRUE(PollUntil([&] { return service.PooledBytes() >= pooled; }, kWaitMs));
  }
  // One op at a time: no more slot memory than the pool had (plus one slot
  // still draining when sampled).
  EXPECT_LE(service.PooledBytes(), pooled + 4 * 1024 * 1024);
  StatusCode code;
  EXPECT_EQ(TakeError(&code), "");
}

TEST_F(EnqueueTest, WriteThenReadOnOneStreamAreOrdered) {
  FillRandom(device_, 3);
  std::vector<uint8_t> page(device_.begin() + 5 * kPage, device_.begin() + 6 * kPage);
  std::vector<int64_t> wl = {5}, wr = {30}, rl = {7}, rr = {30};
  EnqueueOnStream(Pages(false, wl.data(), wr.data(), 1), *stream_);
  EnqueueOnStream(Pages(true, rl.data(), rr.data(), 1), *stream_);  // no sync between
  ASSERT_TRUE(stream_->Synchronize());
  EXPECT_EQ(std::memcmp(device_.data() + 7 * kPage, page.data(), kPage), 0);
}

TEST_F(EnqueueTest, EmptyTransferOnlyOrders) {
  std::vector<int64_t> none;
  EnqueueOnStream(Pages(true, none.data(), none.data(), 0), *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  StatusCode code;
  EXPECT_EQ(TakeError(&code), "");
}

TEST_F(EnqueueTest, HostRegistrationMovesWithoutStaging) {
  std::vector<int64_t> lp = {6}, rp = {16};
  StreamTransfer t = Pages(true, lp.data(), rp.data(), 1);
  t.local_base = reinterpret_cast<uint64_t>(pair_->local.data());
  t.local_on_device = false;  // registered host memory: the engine writes it directly
  EnqueueOnStream(t, *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  EXPECT_EQ(std::memcmp(pair_->local.data() + 6 * kPage, pair_->remote.data() + 16 * kPage, kPage), 0);
}

}  // namespace
}  // namespace mori_torch
