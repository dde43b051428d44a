// Stream-ordered transfers over RDMA on real verbs (Soft-RoCE in the test
// VM): the same EnqueueOnStream protocol as the GPU ops, with a host thread
// standing in for the stream (host_stream.h). Host pages move straight from
// and into their registration; "device" pages (bytes that are not the
// registration) go through the slot's staging, whose NIC registration the
// backend makes on first use. A target engine runs in a child process.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cstring>
#include <memory>
#include <vector>

#include "core/engine.h"
#include "host_stream.h"
#include "rdma_vm_peer.h"
#include "stream/doorbell.h"
#include "stream/enqueue.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using rdma_test::FillPattern;
using rdma_test::HashBytes;
using rdma_test::PeerProcess;
using testing_util::Contains;
using testing_util::HostStream;

constexpr int64_t kPage = 4096;
constexpr int64_t kPages = 256;

class RdmaStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    peer_ = std::make_unique<PeerProcess>("rdma-stream-target", kPage * kPages, "");
    EngineConfig ec;
    ec.host = rdma_test::TestHost();
    engine_ = std::make_unique<Engine>("rdma-stream-init", ec);
    engine_->CreateBackend(BackendType::RDMA, {{"qp_per_transfer", 2}});
    engine_->RegisterRemoteEngine(peer_->engine());
    registered_ = Map();
    device_ = Map();
    local_ =
        engine_->RegisterMemory(reinterpret_cast<uint64_t>(registered_), kPage * kPages, -1, MemoryLocationType::CPU);
    session_ = engine_->CreateSession(local_, peer_->memory());
    ASSERT_TRUE(session_);
    errors_ = std::make_shared<StreamErrors>();
    ASSERT_EQ(peer_->Command("fill 5"), "OK");
    remote_.resize(kPage * kPages);
    FillPattern(remote_.data(), 0, remote_.size(), 5);
  }
  void TearDown() override {
    stream_.reset();
    session_.reset();
    engine_->Shutdown();
    munmap(registered_, kPage * kPages);
    munmap(device_, kPage * kPages);
  }
  static uint8_t* Map() {
    void* p = mmap(nullptr, kPage * kPages, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    std::memset(p, 0, kPage * kPages);
    return static_cast<uint8_t*>(p);
  }
  StreamTransfer Pages(bool is_read, uint8_t* local, const int64_t* lp, const int64_t* rp, int64_t n) {
    StreamTransfer t;
    t.session = session_;
    t.errors = errors_;
    t.is_read = is_read;
    t.local_base = reinterpret_cast<uint64_t>(local);
    t.local_size = kPage * kPages;
    t.local_on_device = local == device_;
    t.segs.count = n;
    t.segs.offset_scale = kPage;
    t.segs.uniform_size = kPage;
    t.lists = {{lp, rp, nullptr}};
    t.list_on_device = {{true, true, false}};
    t.list_names = {{"local_pages", "remote_pages", ""}};
    return t;
  }
  bool PageIs(const uint8_t* local, int64_t lp, int64_t rp) {
    return std::memcmp(local + lp * kPage, remote_.data() + rp * kPage, kPage) == 0;
  }

  std::unique_ptr<PeerProcess> peer_;
  std::unique_ptr<Engine> engine_;
  uint8_t* registered_ = nullptr;
  uint8_t* device_ = nullptr;
  MemoryDesc local_;
  std::shared_ptr<Session> session_;
  std::shared_ptr<StreamErrors> errors_;
  std::vector<uint8_t> remote_;
  std::unique_ptr<HostStream> stream_ = std::make_unique<HostStream>();
};

TEST_F(RdmaStreamTest, HostAndStagedPagesEagerAndCapturedWithErrors) {
  // Host pages, eager: the registration itself.
  std::vector<int64_t> lp = {1, 7, 200}, rp = {3, 255, 0};
  EnqueueOnStream(Pages(true, registered_, lp.data(), rp.data(), 3), *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  for (size_t i = 0; i < lp.size(); ++i) EXPECT_TRUE(PageIs(registered_, lp[i], rp[i])) << "host page " << i;
  // Staged pages, eager read then write-back on the same stream, no sync.
  EnqueueOnStream(Pages(true, device_, lp.data(), rp.data(), 3), *stream_);
  std::vector<int64_t> wl = {7}, wr = {100};
  EnqueueOnStream(Pages(false, device_, wl.data(), wr.data(), 1), *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  for (size_t i = 0; i < lp.size(); ++i) EXPECT_TRUE(PageIs(device_, lp[i], rp[i])) << "staged page " << i;
  EXPECT_EQ(peer_->Hash(100 * kPage, kPage), HashBytes(device_ + 7 * kPage, kPage));
  std::memcpy(remote_.data() + 100 * kPage, device_ + 7 * kPage, kPage);  // the peer's page 100 now
  // Captured, replayed with a new block table each time.
  std::vector<int64_t> gl(16), gr(16);
  stream_->BeginCapture();
  EnqueueOnStream(Pages(true, device_, gl.data(), gr.data(), 16), *stream_);
  auto graph = stream_->EndCapture();
  for (int64_t r = 0; r < 20; ++r) {
    for (int64_t i = 0; i < 16; ++i) {
      gl[i] = (r * 16 + i) % kPages;
      gr[i] = (r * 37 + i * 11) % kPages;
    }
    stream_->Replay(*graph);
    ASSERT_TRUE(stream_->Synchronize()) << "replay " << r;
    for (int64_t i = 0; i < 16; ++i) ASSERT_TRUE(PageIs(device_, gl[i], gr[i])) << "replay " << r << " page " << i;
  }
  StatusCode code;
  EXPECT_EQ(errors_->Take(&code), "");
  stream_->Destroy(std::move(graph));
  // Errors release the stream: a bad local page, and a dead peer.
  std::vector<int64_t> bad = {kPages}, one = {0};
  EnqueueOnStream(Pages(true, device_, bad.data(), one.data(), 1), *stream_);
  ASSERT_TRUE(stream_->Synchronize());
  std::string msg = errors_->Take(&code);
  EXPECT_EQ(code, StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(msg, "local page 256")) << msg;
  peer_->Kill();
  EnqueueOnStream(Pages(true, device_, one.data(), one.data(), 1), *stream_);
  ASSERT_TRUE(stream_->Synchronize(120000)) << "the stream was left waiting on a dead peer";
  msg = errors_->Take(&code);
  EXPECT_NE(code, StatusCode::SUCCESS);
  EXPECT_TRUE(Contains(msg, "rdma-stream-target")) << msg;
}

}  // namespace
}  // namespace mori_torch
