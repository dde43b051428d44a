// The doorbell's progress thread with real TCP engines, no GPU: the test
// thread plays the stream (writes ring, waits for done, re-arms done), as
// the stream memory operations do on a GPU. Covers a one-shot slot going
// back to the pool, a persistent (graph) slot answering every ring with the
// lists staged for that ring, a persistent slot freed once its lease is
// retired (what a destroyed CUDA graph's user object does), and errors
// reaching StreamErrors without holding the "stream".
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "core/engine.h"
#include "stream/doorbell.h"
#include "tcp_session_pair.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::Contains;
using testing_util::FillRandom;
using testing_util::PollUntil;

constexpr int64_t kPage = 4096;
constexpr int64_t kPages = 64;
constexpr int kWaitMs = 20000;

uint32_t Load(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void Store(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

class DoorbellTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pair_ = std::make_unique<testing_util::TcpSessionPair>("D", kPage * kPages, 7);
    session_ = pair_->session;
    ASSERT_TRUE(session_);
    errors_ = std::make_shared<StreamErrors>();
  }
  void TearDown() override {
    session_.reset();
    pair_.reset();
  }

  // A page read: local page `lp` <- remote page `rp`, lists in the slot.
  std::shared_ptr<DoorbellSlot> PageRead(bool persistent) {
    auto slot = DoorbellService::Instance().Acquire(1);
    slot->session = session_;
    slot->errors = errors_;
    slot->is_read = true;
    slot->persistent = persistent;
    slot->segs = gpu::StreamCopyArgs{};
    slot->segs.local_offsets = slot->list(0);
    slot->segs.remote_offsets = slot->list(1);
    slot->segs.count = 1;
    slot->segs.offset_scale = kPage;
    slot->segs.uniform_size = kPage;
    return slot;
  }

  // What the stream does: ring, wait until done, re-arm.
  static bool RingAndWait(DoorbellSlot& slot) {
    Store(slot.ring(), 1);
    if (!PollUntil([&] { return Load(slot.done()) == 1; }, kWaitMs)) return false;
    Store(slot.done(), 0);
    return true;
  }

  bool PageEquals(int64_t lp, int64_t rp) {
    return std::memcmp(pair_->local.data() + lp * kPage, pair_->remote.data() + rp * kPage, kPage) == 0;
  }

  std::unique_ptr<testing_util::TcpSessionPair> pair_;
  std::shared_ptr<Session> session_;
  std::shared_ptr<StreamErrors> errors_;
};

TEST_F(DoorbellTest, OneShotSlotMovesBytesAndReturnsToThePool) {
  auto& service = DoorbellService::Instance();
  const size_t before = service.Watched();
  auto slot = PageRead(false);
  slot->list(0)[0] = 3;
  slot->list(1)[0] = 40;
  DoorbellSlot* raw = slot.get();
  service.Watch(std::move(slot));
  ASSERT_TRUE(RingAndWait(*raw));
  EXPECT_TRUE(PageEquals(3, 40));
  EXPECT_TRUE(PollUntil([&] { return service.Watched() == before; }, kWaitMs)) << "slot not recycled";
  StatusCode code;
  EXPECT_EQ(errors_->Take(&code), "");
  EXPECT_EQ(code, StatusCode::SUCCESS);
}

TEST_F(DoorbellTest, PersistentSlotAnswersEveryRingWithThatRingsLists) {
  auto& service = DoorbellService::Instance();
  auto slot = PageRead(true);
  DoorbellSlot* raw = slot.get();
  const size_t before = service.Watched();
  service.Watch(slot);
  for (int64_t i = 0; i < 20; ++i) {
    raw->list(0)[0] = i % kPages;  // the "stream" stages this replay's block table
    raw->list(1)[0] = (i * 7) % kPages;
    ASSERT_TRUE(RingAndWait(*raw)) << "ring " << i;
    EXPECT_TRUE(PageEquals(i % kPages, (i * 7) % kPages)) << "ring " << i;
  }
  EXPECT_EQ(service.Watched(), before + 1);  // still watched: a graph may replay
}

TEST_F(DoorbellTest, RetiredLeaseFreesAPersistentSlot) {
  auto& service = DoorbellService::Instance();
  const size_t watched_before = service.Watched();
  const size_t leased_before = service.Leased();
  const long session_refs = session_.use_count();
  auto slot = PageRead(true);
  auto lease = std::make_shared<SlotLease>();
  slot->lease = lease;
  DoorbellSlot* raw = slot.get();
  service.Watch(std::move(slot));
  EXPECT_EQ(service.Leased(), leased_before + 1);
  EXPECT_EQ(session_.use_count(), session_refs + 1);  // the slot holds the session
  for (int64_t i = 0; i < 3; ++i) {                   // "replays"
    raw->list(0)[0] = i + 1;
    raw->list(1)[0] = i + 30;
    ASSERT_TRUE(RingAndWait(*raw)) << "ring " << i;
    EXPECT_TRUE(PageEquals(i + 1, i + 30)) << "ring " << i;
  }
  EXPECT_EQ(service.Watched(), watched_before + 1);  // still watched while the "graph" lives
  // The graph's user object destructor: a driver thread, this callback only.
  SlotLease::ReleaseCallback(new std::shared_ptr<SlotLease>(lease));
  EXPECT_TRUE(lease->retired());
  EXPECT_TRUE(PollUntil([&] { return service.Watched() == watched_before; }, kWaitMs)) << "slot still watched";
  EXPECT_EQ(service.Leased(), leased_before);
  EXPECT_TRUE(PollUntil([&] { return session_.use_count() == session_refs; }, kWaitMs)) << "session still held";
  EXPECT_EQ(lease.use_count(), 1);  // the slot let go of its lease too
  // Back in the pool, clean: the next Acquire may hand it out again.
  bool pooled = false;
  std::vector<std::shared_ptr<DoorbellSlot>> taken;
  for (int k = 0; k < 64 && !pooled; ++k) {
    taken.push_back(service.Acquire(1));
    if (taken.back().get() == raw) {
      pooled = true;
      EXPECT_FALSE(raw->session);
      EXPECT_FALSE(raw->lease);
      EXPECT_FALSE(raw->persistent);
      EXPECT_EQ(Load(raw->done()), 0u);
    }
  }
  EXPECT_TRUE(pooled) << "the retired slot did not return to the pool";
}

TEST_F(DoorbellTest, LeaseRetiredDuringATransferWaitsForIt) {
  auto& service = DoorbellService::Instance();
  const size_t watched_before = service.Watched();
  auto slot = PageRead(true);
  auto lease = std::make_shared<SlotLease>();
  slot->lease = lease;
  slot->list(0)[0] = 5;
  slot->list(1)[0] = 50;
  DoorbellSlot* raw = slot.get();
  service.Watch(std::move(slot));
  // Ring and retire at once (a driver releasing early): the transfer still
  // completes and releases the "stream" before the slot is freed.
  Store(raw->ring(), 1);
  lease->Retire();
  ASSERT_TRUE(PollUntil([&] { return Load(raw->done()) == 1 || service.Watched() == watched_before; }, kWaitMs));
  if (Load(raw->done()) == 1) Store(raw->done(), 0);
  EXPECT_TRUE(PollUntil([&] { return service.Watched() == watched_before; }, kWaitMs));
  EXPECT_TRUE(PageEquals(5, 50));  // the ring pending at retirement was answered
}

TEST_F(DoorbellTest, OutOfRangeEntryReleasesTheStreamAndIsReported) {
  auto slot = PageRead(false);
  slot->list(0)[0] = 0;
  slot->list(1)[0] = kPages;  // one past the end
  DoorbellSlot* raw = slot.get();
  DoorbellService::Instance().Watch(std::move(slot));
  ASSERT_TRUE(RingAndWait(*raw));
  StatusCode code;
  const std::string msg = errors_->Take(&code);
  EXPECT_EQ(code, StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(msg, "remote range out of bounds")) << msg;
  EXPECT_EQ(errors_->Take(&code), "");  // taken once
}

TEST_F(DoorbellTest, NegativeEntryIsRefusedBeforeTheEngine) {
  auto slot = PageRead(false);
  slot->list(0)[0] = -1;
  slot->list(1)[0] = 0;
  DoorbellSlot* raw = slot.get();
  DoorbellService::Instance().Watch(std::move(slot));
  ASSERT_TRUE(RingAndWait(*raw));
  StatusCode code;
  const std::string msg = errors_->Take(&code);
  EXPECT_EQ(code, StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(msg, "negative or overflowing")) << msg;
}

TEST(StreamSegments, ExpandScalesPagesAndRejectsOverflow) {
  const int64_t lo[] = {0, 2}, ro[] = {5, 1}, sz[] = {100};
  gpu::StreamCopyArgs a;
  a.local_offsets = lo;
  a.remote_offsets = ro;
  a.sizes = sz;
  a.size_stride = 0;
  a.count = 2;
  a.offset_scale = 4096;
  std::vector<int64_t> l, r, s;
  std::string msg;
  ASSERT_EQ(ExpandSegments(a, &l, &r, &s, &msg), StatusCode::SUCCESS) << msg;
  EXPECT_EQ(l, (std::vector<int64_t>{0, 8192}));
  EXPECT_EQ(r, (std::vector<int64_t>{20480, 4096}));
  EXPECT_EQ(s, (std::vector<int64_t>{100, 100}));
  const int64_t huge[] = {INT64_MAX / 2, 0};
  a.local_offsets = huge;
  EXPECT_EQ(ExpandSegments(a, &l, &r, &s, &msg), StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(msg, "segment 0")) << msg;
}

}  // namespace
}  // namespace mori_torch
