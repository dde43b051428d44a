// The control-plane listener under abuse from raw POSIX sockets: garbage,
// oversized and unknown frames, stalled frames and bad handshakes each close
// only that connection; valid requests get answers (errors as Error frames);
// TCP data connections reject malformed or out-of-range requests. After all
// of it, a normal transfer between two engines still works.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>

#include "backends/tcp/tcp_protocol.h"
#include "core/byte_io.h"
#include "core/control_plane.h"
#include "core/engine.h"
#include "core/logging.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::CatchError;
using testing_util::Contains;
using testing_util::MsSince;
using testing_util::RawConnect;
using testing_util::ScopedEnv;

constexpr int kFrameTimeoutMs = 300;

// Sends everything; false if the peer already closed on us.
bool SendAll(int fd, const std::vector<uint8_t>& b) {
  size_t off = 0;
  while (off < b.size()) {
    ssize_t n = ::send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// True once the server has closed the connection (recv gives 0 or
// ECONNRESET) within `ms`; whatever it sent before is appended to *got.
bool WaitClosed(int fd, int ms, std::vector<uint8_t>* got = nullptr) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  uint8_t buf[4096];
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(left));
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) {
      if (errno == ECONNRESET) return true;
      if (errno == EAGAIN || errno == EINTR) continue;
      return false;
    }
    if (got) got->insert(got->end(), buf, buf + n);
  }
}

std::vector<uint8_t> HelloPayload(ConnectionKind kind, uint8_t backend, const EngineDesc& self) {
  return EncodeHello(kind, backend, self);
}

std::vector<uint8_t> RawHeader(uint32_t magic, uint16_t version, uint16_t type, uint32_t length) {
  ByteWriter w;
  w.Put<uint32_t>(magic);
  w.Put<uint16_t>(version);
  w.Put<uint16_t>(type);
  w.Put<uint32_t>(length);
  return std::move(w.bytes());
}

// `d` with another id (its token and incarnation kept).
MemoryDesc WithId(MemoryDesc d, uint64_t id) {
  d.id = id;
  return d;
}

// The MemLookup / MemWatch payload naming `d`: id, incarnation, token.
std::vector<uint8_t> Ref(const MemoryDesc& d) {
  ByteWriter w;
  w.Put<uint64_t>(d.id);
  w.Put<uint64_t>(d.incarnation);
  w.PutBytes(d.token.data(), d.token.size());
  return std::move(w.bytes());
}

struct ErrorReply {
  StatusCode code;
  std::string message;
};

ErrorReply DecodeError(const Frame& f) {
  ByteReader r(f.payload.data(), f.payload.size(), "test error frame");
  ErrorReply e;
  e.code = static_cast<StatusCode>(r.Get<uint32_t>("code"));
  e.message = r.GetString("message");
  r.ExpectEnd();
  return e;
}

class ControlPlaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Before the engine exists: it reads the variable in its constructor.
    env_ = std::make_unique<ScopedEnv>("MORI_TORCH_FRAME_TIMEOUT_MS", std::to_string(kFrameTimeoutMs).c_str());
    SetLogLevel("critical");  // the abuse below logs a warning per connection
    server_ = std::make_unique<Engine>("server", EngineConfig{"127.0.0.1", 0});
    server_->CreateBackend(BackendType::TCP, {{"num_data_conns", 2}});
    mem_.resize(64 << 10);
    testing_util::FillRandom(mem_, 5);
    memd_ = server_->RegisterMemory(reinterpret_cast<uint64_t>(mem_.data()), static_cast<int64_t>(mem_.size()), -1,
                                    MemoryLocationType::CPU);
    self_.key = "raw-client";
    self_.node_id = "n";
    self_.hostname = "h";
    self_.host = "127.0.0.1";
    self_.port = 1;
    self_.pid = 1;
  }

  void TearDown() override {
    for (int fd : fds_) ::close(fd);
    server_.reset();
    SetLogLevel("warning");
    env_.reset();
  }

  int Connect() {
    int fd = RawConnect(server_->Desc().port);
    EXPECT_GE(fd, 0) << std::strerror(errno);
    if (fd >= 0) fds_.push_back(fd);
    return fd;
  }

  // A raw connection that completed a valid Hello of `kind`.
  int Handshake(ConnectionKind kind = ConnectionKind::Control, uint8_t backend = 0) {
    int fd = Connect();
    EXPECT_TRUE(SendAll(fd, EncodeFrame(FrameType::Hello, HelloPayload(kind, backend, self_))));
    Frame ack;
    IoResult r = ReadFrame(fd, &ack, 2000, 2000);
    EXPECT_TRUE(r.ok) << r.error;
    EXPECT_EQ(ack.type, FrameType::HelloAck);
    if (ack.type == FrameType::HelloAck) {
      EXPECT_EQ(EngineDesc::Unpack(ack.payload.data(), ack.payload.size()), server_->Desc());
    }
    return fd;
  }

  // A real engine pair transfer through the abused server engine still works:
  // a fresh engine writes into the server's memory and reads it back.
  void ExpectServerStillServes() {
    Engine peer("peer-after-abuse", EngineConfig{"127.0.0.1", 0});
    peer.CreateBackend(BackendType::TCP, {});
    peer.RegisterRemoteEngine(server_->Desc());
    server_->RegisterRemoteEngine(peer.Desc());
    std::vector<uint8_t> src(8192), back(8192, 0);
    testing_util::FillRandom(src, 99);
    MemoryDesc sm = peer.RegisterMemory(reinterpret_cast<uint64_t>(src.data()), 8192, -1, MemoryLocationType::CPU);
    MemoryDesc bm = peer.RegisterMemory(reinterpret_cast<uint64_t>(back.data()), 8192, -1, MemoryLocationType::CPU);
    ASSERT_NE(0, std::memcmp(mem_.data() + 1000, src.data(), 8192));
    auto w = peer.Write(sm, 0, memd_, 1000, 8192, peer.AllocateTransferUid());
    ASSERT_EQ(w->WaitFor(10000), StatusCode::SUCCESS) << w->Message();
    EXPECT_EQ(0, std::memcmp(mem_.data() + 1000, src.data(), 8192));
    auto r = peer.Read(bm, 0, memd_, 1000, 8192, peer.AllocateTransferUid());
    ASSERT_EQ(r->WaitFor(10000), StatusCode::SUCCESS) << r->Message();
    EXPECT_EQ(back, src);
    auto sess = peer.CreateSession(sm, memd_);
    ASSERT_NE(sess, nullptr);
    ASSERT_EQ(sess->Write(0, 0, 64, 1)->WaitFor(10000), StatusCode::SUCCESS);
    EXPECT_EQ(0, std::memcmp(mem_.data(), src.data(), 64));
  }

  std::unique_ptr<ScopedEnv> env_;
  std::unique_ptr<Engine> server_;
  std::vector<uint8_t> mem_;
  MemoryDesc memd_;
  EngineDesc self_;
  std::vector<int> fds_;
};

TEST_F(ControlPlaneTest, GarbageBytesCloseTheConnection) {
  int fd = Connect();
  const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_TRUE(SendAll(fd, std::vector<uint8_t>(http.begin(), http.end())));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(WaitClosed(fd, 2000));
  EXPECT_LT(MsSince(t0), 2000);

  std::mt19937_64 rng(1);
  std::vector<uint8_t> junk(5000);
  for (auto& b : junk) b = static_cast<uint8_t>(rng());
  int fd2 = Connect();
  SendAll(fd2, junk);  // may fail part-way once the server has closed
  EXPECT_TRUE(WaitClosed(fd2, 2000));
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, TwoGiBLengthIsRefusedWithoutAllocating) {
  for (uint16_t type : {uint16_t{1}, uint16_t{4}}) {
    int fd = Connect();
    ASSERT_TRUE(SendAll(fd, RawHeader(kFrameMagic, kProtocolVersion, type, 0x80000000u)));
    EXPECT_TRUE(WaitClosed(fd, 2000)) << "type " << type;
  }
  // Also after a valid Hello.
  int fd = Handshake();
  ASSERT_TRUE(SendAll(fd, RawHeader(kFrameMagic, kProtocolVersion, 4, 0x80000000u)));
  EXPECT_TRUE(WaitClosed(fd, 2000));
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, UnknownFrameTypeClosesTheConnection) {
  int fd = Connect();
  ASSERT_TRUE(SendAll(fd, RawHeader(kFrameMagic, kProtocolVersion, 99, 0)));
  EXPECT_TRUE(WaitClosed(fd, 2000));
  // Bad version and bad magic likewise.
  fd = Connect();
  ASSERT_TRUE(SendAll(fd, RawHeader(kFrameMagic, 7, 1, 0)));
  EXPECT_TRUE(WaitClosed(fd, 2000));
  // After a Hello: an unknown type, and a known type the server never
  // accepts as a request (HelloAck).
  fd = Handshake();
  ASSERT_TRUE(SendAll(fd, RawHeader(kFrameMagic, kProtocolVersion, 0xffff, 4)));
  EXPECT_TRUE(WaitClosed(fd, 2000));
  fd = Handshake();
  ASSERT_TRUE(SendAll(fd, EncodeFrame(FrameType::HelloAck, self_.Pack())));
  EXPECT_TRUE(WaitClosed(fd, 2000));
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, StalledFrameAfterHelloIsClosedAfterTheFrameTimeout) {
  int fd = Handshake();
  auto req = EncodeFrame(FrameType::MemLookup, Ref(WithId(memd_, 0)));
  req.resize(kFrameHeaderBytes + 3);  // header and part of the payload, then silence
  ASSERT_TRUE(SendAll(fd, req));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(WaitClosed(fd, 2000));
  const auto ms = MsSince(t0);
  EXPECT_GE(ms, kFrameTimeoutMs - 100);  // it did wait for the rest of the frame
  EXPECT_LT(ms, 2000);

  // A header cut in the middle behaves the same.
  fd = Handshake();
  req = EncodeFrame(FrameType::Ping, {});
  req.resize(5);
  ASSERT_TRUE(SendAll(fd, req));
  EXPECT_TRUE(WaitClosed(fd, 2000));
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, SilentOrPartialHelloIsClosed) {
  int silent = Connect();
  auto hello = EncodeFrame(FrameType::Hello, HelloPayload(ConnectionKind::Control, 0, self_));
  int partial = Connect();
  hello.resize(hello.size() / 2);
  ASSERT_TRUE(SendAll(partial, hello));
  EXPECT_TRUE(WaitClosed(silent, 2000));
  EXPECT_TRUE(WaitClosed(partial, 2000));
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, BadHellosGetAnErrorFrameAndAClose) {
  struct Case {
    std::vector<uint8_t> frame;
    std::string needle;
  };
  std::vector<Case> cases;
  cases.push_back({EncodeFrame(FrameType::Ping, {}), "expected Hello"});
  cases.push_back({EncodeFrame(FrameType::Hello, {}), "truncated"});
  cases.push_back({EncodeFrame(FrameType::Hello, HelloPayload(static_cast<ConnectionKind>(9), 0, self_)),
                   "unknown connection kind 9"});
  {
    auto p = HelloPayload(ConnectionKind::Control, 0, self_);
    p[2] = 0xff;  // descriptor length far past the end
    p[3] = 0xff;
    cases.push_back({EncodeFrame(FrameType::Hello, p), "truncated"});
  }
  {
    auto p = HelloPayload(ConnectionKind::Control, 0, self_);
    p[6] ^= 0xff;  // descriptor magic
    cases.push_back({EncodeFrame(FrameType::Hello, p), "bad magic"});
  }
  {
    auto p = HelloPayload(ConnectionKind::Control, 0, self_);
    p.push_back(0);  // trailing byte after the authentication field
    cases.push_back({EncodeFrame(FrameType::Hello, p), "trailing"});
  }
  cases.push_back({EncodeFrame(FrameType::Hello, {1, 0, 0, 0, 0, 0}), "truncated"});  // empty descriptor
  cases.push_back({EncodeFrame(FrameType::Hello, HelloPayload(ConnectionKind::Data, 2, self_)), "no RDMA backend"});
  cases.push_back(
      {EncodeFrame(FrameType::Hello, HelloPayload(ConnectionKind::Data, 200, self_)), "unknown backend type 200"});
  for (const auto& c : cases) {
    SCOPED_TRACE(c.needle);
    int fd = Connect();
    ASSERT_TRUE(SendAll(fd, c.frame));
    Frame reply;
    IoResult r = ReadFrame(fd, &reply, 2000, 2000);
    ASSERT_TRUE(r.ok) << r.error;
    ASSERT_EQ(reply.type, FrameType::Error);
    ErrorReply e = DecodeError(reply);
    EXPECT_TRUE(IsError(e.code));
    EXPECT_TRUE(Contains(e.message, c.needle)) << e.message;
    EXPECT_TRUE(WaitClosed(fd, 2000));
  }
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, MemLookupAnswersWithErrorOrDescriptor) {
  int fd = Handshake();
  // Unknown id: an Error frame, and the connection stays usable.
  ASSERT_TRUE(SendAll(fd, EncodeFrame(FrameType::MemLookup, Ref(WithId(memd_, 12345)))));
  Frame reply;
  IoResult r = ReadFrame(fd, &reply, 2000, 2000);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(reply.type, FrameType::Error);
  ErrorReply e = DecodeError(reply);
  EXPECT_EQ(e.code, StatusCode::ERR_NOT_FOUND);
  EXPECT_TRUE(Contains(e.message, "memory 12345")) << e.message;

  // Malformed request payload: an Error frame too.
  ASSERT_TRUE(SendAll(fd, EncodeFrame(FrameType::MemLookup, {1, 2, 3})));
  r = ReadFrame(fd, &reply, 2000, 2000);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(reply.type, FrameType::Error);
  EXPECT_EQ(DecodeError(reply).code, StatusCode::ERR_INVALID_ARGS);
  ASSERT_TRUE(SendAll(fd, EncodeFrame(FrameType::MemLookup, std::vector<uint8_t>(33, 0))));
  r = ReadFrame(fd, &reply, 2000, 2000);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(reply.type, FrameType::Error);
  EXPECT_TRUE(Contains(DecodeError(reply).message, "trailing"));

  // Known id: the registered descriptor, byte for byte.
  ASSERT_TRUE(SendAll(fd, EncodeFrame(FrameType::MemLookup, Ref(memd_))));
  r = ReadFrame(fd, &reply, 2000, 2000);
  ASSERT_TRUE(r.ok) << r.error;
  ASSERT_EQ(reply.type, FrameType::MemLookupReply);
  MemoryDesc got = MemoryDesc::Unpack(reply.payload.data(), reply.payload.size());
  EXPECT_EQ(got, memd_);
  EXPECT_EQ(got.data, reinterpret_cast<uint64_t>(mem_.data()));
  EXPECT_EQ(got.size, mem_.size());

  // Ping / Pong on the same connection.
  ASSERT_TRUE(SendAll(fd, EncodeFrame(FrameType::Ping, {})));
  r = ReadFrame(fd, &reply, 2000, 2000);
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(reply.type, FrameType::Pong);
  ExpectServerStillServes();
}

// A watcher speaking the protocol from raw sockets: it accepts the owner's
// connection, answers the Hello and hands back each request frame.
class RawWatcher {
 public:
  explicit RawWatcher(EngineDesc* desc) {
    int port = 0;
    listener_ = Listen("127.0.0.1", 0, &port);
    desc->port = port;
    desc_ = *desc;
  }
  // Accepts one connection and completes its Hello; false on timeout.
  bool Accept(int ms) {
    if (!WaitReadable(listener_.fd(), ms)) return false;
    conn_ = Socket(::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    Frame hello;
    if (!ReadFrame(conn_.fd(), &hello, ms, ms).ok || hello.type != FrameType::Hello) return false;
    return WriteFrame(conn_.fd(), FrameType::HelloAck, desc_.Pack(), ms).ok;
  }
  bool Next(Frame* f, int ms) { return ReadFrame(conn_.fd(), f, ms, ms).ok; }
  bool Reply(FrameType t) { return WriteFrame(conn_.fd(), t, {}, 2000).ok; }

 private:
  EngineDesc desc_;
  Socket listener_, conn_;
};

TEST_F(ControlPlaneTest, MemWatchAndMemRevokeRequestsAreChecked) {
  int fd = Handshake();
  Frame reply;
  auto ask = [&](FrameType t, const std::vector<uint8_t>& payload) {
    ASSERT_TRUE(SendAll(fd, EncodeFrame(t, payload)));
    IoResult r = ReadFrame(fd, &reply, 2000, 2000);
    ASSERT_TRUE(r.ok) << r.error;
  };
  ask(FrameType::MemWatch, Ref(WithId(memd_, 4242)));
  ASSERT_EQ(reply.type, FrameType::Error);
  EXPECT_EQ(DecodeError(reply).code, StatusCode::ERR_NOT_FOUND);
  EXPECT_TRUE(Contains(DecodeError(reply).message, "memory 4242")) << DecodeError(reply).message;
  ask(FrameType::MemWatch, {1, 2});
  ASSERT_EQ(reply.type, FrameType::Error);
  EXPECT_EQ(DecodeError(reply).code, StatusCode::ERR_INVALID_ARGS);
  ask(FrameType::MemWatch, Ref(memd_));
  ASSERT_EQ(reply.type, FrameType::MemLookupReply);
  EXPECT_EQ(MemoryDesc::Unpack(reply.payload.data(), reply.payload.size()), memd_);
  // A revoke from an engine this one does not know as a remote is refused:
  // only an owner may take back its memory.
  ByteWriter one;
  one.Put<uint32_t>(1);
  one.Put<uint64_t>(7);
  ask(FrameType::MemRevoke, one.bytes());
  ASSERT_EQ(reply.type, FrameType::Error);
  EXPECT_EQ(DecodeError(reply).code, StatusCode::ERR_INVALID_ARGS);
  EXPECT_TRUE(Contains(DecodeError(reply).message, "not a registered remote engine")) << DecodeError(reply).message;
  server_->RegisterRemoteEngine(self_);
  // A revoke whose count disagrees with its length, or is cut short.
  ByteWriter bad;
  bad.Put<uint32_t>(3);
  bad.Put<uint64_t>(1);
  ask(FrameType::MemRevoke, bad.bytes());
  ASSERT_EQ(reply.type, FrameType::Error);
  EXPECT_TRUE(Contains(DecodeError(reply).message, "count 3")) << DecodeError(reply).message;
  ask(FrameType::MemRevoke, {1, 0});
  ASSERT_EQ(reply.type, FrameType::Error);
  ByteWriter huge;
  huge.Put<uint32_t>(0xffffffffu);
  ask(FrameType::MemRevoke, huge.bytes());
  ASSERT_EQ(reply.type, FrameType::Error);
  // A well-formed revoke of memory nobody here mapped: acknowledged.
  ByteWriter ok;
  ok.Put<uint32_t>(2);
  ok.Put<uint64_t>(7);
  ok.Put<uint64_t>(8);
  ask(FrameType::MemRevoke, ok.bytes());
  EXPECT_EQ(reply.type, FrameType::MemRevokeAck);
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, DeregisterMemoryReturnsOnlyAfterEveryWatcherAcknowledged) {
  EngineDesc watcher_desc = self_;
  RawWatcher watcher(&watcher_desc);
  ControlClient client(watcher_desc, server_->Desc(), 2000);
  Frame f = client.Call(FrameType::MemWatch, Ref(memd_));
  ASSERT_EQ(f.type, FrameType::MemLookupReply);

  std::atomic<bool> returned{false};
  std::thread dereg([&] {
    server_->DeregisterMemory(memd_);
    returned = true;
  });
  ASSERT_TRUE(watcher.Accept(5000)) << "the owner never called the watcher";
  Frame revoke;
  ASSERT_TRUE(watcher.Next(&revoke, 5000));
  ASSERT_EQ(revoke.type, FrameType::MemRevoke);
  ByteReader r(revoke.payload.data(), revoke.payload.size(), "test revoke");
  EXPECT_EQ(r.Get<uint32_t>("count"), 1u);
  EXPECT_EQ(r.Get<uint64_t>("id"), memd_.id);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(returned.load()) << "deregister_memory returned before the watcher acknowledged";
  ASSERT_TRUE(watcher.Reply(FrameType::MemRevokeAck));
  dereg.join();
  EXPECT_TRUE(returned.load());
  // Gone for good: a late watch is refused.
  auto e = CatchError([&] { client.Call(FrameType::MemWatch, Ref(memd_)); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);
}

TEST_F(ControlPlaneTest, AWatcherThatNeverAnswersDelaysDeregistrationOnlyByTheTimeout) {
  EngineConfig cfg{"127.0.0.1", 0};
  cfg.connect_timeout_ms = 300;
  Engine owner("owner-short-timeout", cfg);
  std::vector<uint8_t> buf(4096);
  MemoryDesc d = owner.RegisterMemory(reinterpret_cast<uint64_t>(buf.data()), 4096, -1, MemoryLocationType::CPU);
  EngineDesc hung = self_;
  RawWatcher watcher(&hung);  // listens, never accepts: the Hello times out
  EngineDesc gone = self_;
  gone.key = "gone-watcher";
  gone.port = 1;  // nothing listens there
  for (const EngineDesc& w : {hung, gone}) {
    ControlClient c(w, owner.Desc(), 2000);
    ASSERT_EQ(c.Call(FrameType::MemWatch, Ref(d)).type, FrameType::MemLookupReply);
  }
  const auto t0 = std::chrono::steady_clock::now();
  owner.DeregisterMemory(d);
  const int64_t ms = MsSince(t0);
  EXPECT_LT(ms, 3000) << "watchers are told in parallel, each bounded by connect_timeout_ms";
  auto e = CatchError([&] { owner.DeregisterMemory(d); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);
}

TEST_F(ControlPlaneTest, ControlClientAndOpenEngineConnection) {
  ControlClient client(self_, server_->Desc(), 2000);
  auto e = CatchError([&] { client.Call(FrameType::MemLookup, Ref(WithId(memd_, 777))); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_TRUE(Contains(e->what(), "memory 777")) << e->what();
  Frame f = client.Call(FrameType::MemLookup, Ref(memd_));
  ASSERT_EQ(f.type, FrameType::MemLookupReply);
  EXPECT_EQ(MemoryDesc::Unpack(f.payload.data(), f.payload.size()), memd_);
  EXPECT_EQ(client.Call(FrameType::Ping, {}).type, FrameType::Pong);
  client.Close();
  EXPECT_EQ(client.Call(FrameType::Ping, {}).type, FrameType::Pong);  // reconnects

  // The server's key is checked against the descriptor we dialled.
  EngineDesc wrong = server_->Desc();
  wrong.key = "someone-else";
  auto e2 = CatchError([&] { OpenEngineConnection(self_, wrong, ConnectionKind::Control, 0, 2000); });
  ASSERT_TRUE(e2.has_value());
  EXPECT_TRUE(Contains(e2->what(), "'server'")) << e2->what();

  // Nobody listening: a clear error, not a hang.
  EngineDesc gone = server_->Desc();
  {
    Engine tmp("tmp", EngineConfig{"127.0.0.1", 0});
    gone = tmp.Desc();
  }
  auto e3 = CatchError([&] { OpenEngineConnection(self_, gone, ConnectionKind::Control, 0, 2000); });
  ASSERT_TRUE(e3.has_value());
  // Refused; or, if another test process grabbed the port meanwhile, the
  // wrong engine answers and is caught by the key check. Either way the
  // error says why in fields, not only in words.
  EXPECT_TRUE(e3->code() == StatusCode::ERR_BAD_STATE || e3->code() == StatusCode::ERR_NOT_FOUND) << e3->what();
  EXPECT_TRUE(e3->sys_errno() == ECONNREFUSED || e3->cause() == ErrorCause::kWrongPeer) << e3->what();
  // The engine there is a later incarnation than the descriptor names.
  EngineDesc earlier = server_->Desc();
  earlier.incarnation ^= 1;
  auto e4 = CatchError([&] { OpenEngineConnection(self_, earlier, ConnectionKind::Control, 0, 2000); });
  ASSERT_TRUE(e4.has_value());
  EXPECT_EQ(e4->code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_EQ(e4->cause(), ErrorCause::kPeerRestarted) << e4->what();
  EXPECT_EQ(e4->sys_errno(), 0);
}

TEST_F(ControlPlaneTest, ManyAbusiveConnectionsAtOnce) {
  std::vector<int> fds;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 64; ++i) {
    int fd = Connect();
    ASSERT_GE(fd, 0);
    std::vector<uint8_t> junk(1 + rng() % 64);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    if (i % 3 == 0) junk = RawHeader(kFrameMagic, kProtocolVersion, 1, 0xffffffffu);
    SendAll(fd, junk);
    fds.push_back(fd);
  }
  for (int fd : fds) EXPECT_TRUE(WaitClosed(fd, 3000));
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, FuzzedFramesOverTheWire) {
  // Valid traffic, mutated: after a real Hello, a few frames with random
  // damage, then end-of-stream. Whatever happens, only that connection is
  // affected and the server closes it promptly.
  std::mt19937_64 rng(123);
  const std::vector<std::vector<uint8_t>> seeds = {
      EncodeFrame(FrameType::MemLookup, Ref(memd_)), EncodeFrame(FrameType::MemLookup, Ref(WithId(memd_, 5))),
      EncodeFrame(FrameType::Ping, {}), EncodeFrame(FrameType::Hello, HelloPayload(ConnectionKind::Control, 0, self_)),
      EncodeFrame(FrameType::Error, EncodeErrorPayload(StatusCode::ERR_BAD_STATE, "x"))};
  for (int iter = 0; iter < 300; ++iter) {
    const bool hello_first = iter % 4 != 0;  // sometimes the damage hits the Hello itself
    int fd = hello_first ? Handshake() : Connect();
    std::vector<uint8_t> bytes;
    for (int k = 0, n = 1 + rng() % 3; k < n; ++k) {
      auto f = hello_first ? seeds[rng() % seeds.size()] : seeds[3];
      for (int m = 0, flips = rng() % 4; m < flips; ++m) f[rng() % f.size()] ^= 1u << (rng() % 8);
      if (rng() % 4 == 0) f.resize(rng() % (f.size() + 1));
      bytes.insert(bytes.end(), f.begin(), f.end());
    }
    SendAll(fd, bytes);
    ::shutdown(fd, SHUT_WR);
    ASSERT_TRUE(WaitClosed(fd, 3000)) << "iteration " << iter;
    ::close(fd);
    fds_.pop_back();
  }
  ExpectServerStillServes();
}

// --- TCP data connections ------------------------------------------------------

struct WriteRequest {
  tcp::RequestHeader h{};
  std::vector<tcp::WireSegment> segs;
  std::vector<uint8_t> payload;
  // Header, table, zero padding to tcp::kWireAlign, payload, zero padding.
  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> b(tcp::WireRound(sizeof h + segs.size() * sizeof(tcp::WireSegment)));
    std::memcpy(b.data(), &h, sizeof h);
    if (!segs.empty()) std::memcpy(b.data() + sizeof h, segs.data(), segs.size() * sizeof(tcp::WireSegment));
    b.insert(b.end(), payload.begin(), payload.end());
    b.resize(b.size() + tcp::WirePad(payload.size()));
    return b;
  }
};

WriteRequest MakeWrite(uint64_t req_id, const MemoryDesc& mem, std::vector<tcp::WireSegment> segs, uint8_t fill) {
  WriteRequest w;
  w.h.magic = tcp::kRequestMagic;
  w.h.op = static_cast<uint8_t>(tcp::Op::Write);
  w.h.flags = tcp::kFlagNotify;
  w.h.req_id = req_id;
  w.h.uid = req_id;
  w.h.mem_id = mem.id;
  w.h.incarnation = mem.incarnation;
  std::memcpy(w.h.token, mem.token.data(), sizeof w.h.token);
  w.h.num_segs = static_cast<uint32_t>(segs.size());
  w.h.parts_total = 1;
  uint64_t total = 0;
  for (auto& s : segs) total += s.size;
  w.h.total_bytes = total;
  w.segs = std::move(segs);
  w.payload.assign(total, fill);
  return w;
}

bool ReadResponse(int fd, tcp::ResponseHeader* rh, std::string* msg) {
  if (!ReadFull(fd, rh, sizeof *rh, DeadlineAfterMs(2000)).ok) return false;
  msg->resize(tcp::WireRound(sizeof *rh + rh->msg_len) - sizeof *rh);  // message and padding
  if (!ReadFull(fd, &(*msg)[0], msg->size(), DeadlineAfterMs(2000)).ok) return false;
  msg->resize(rh->msg_len);
  return true;
}

TEST_F(ControlPlaneTest, DataConnectionRejectsOutOfRangeAndMalformedRequests) {
  const std::vector<uint8_t> orig = mem_;
  const int fd = Handshake(ConnectionKind::Data, static_cast<uint8_t>(BackendType::TCP));
  const uint64_t kMax = UINT64_MAX;
  // Out of range, in several ways; the payload is drained and the stream
  // stays in step, so each gets its own error response.
  const std::vector<std::vector<tcp::WireSegment>> bad = {
      {{mem_.size() - 4, 8}}, {{0, 16}, {mem_.size(), 1}}, {{kMax - 3, 8}},  // offset + size wraps around
  };
  uint64_t id = 1;
  for (const auto& segs : bad) {
    auto w = MakeWrite(id, memd_, segs, 0xee);
    ASSERT_TRUE(SendAll(fd, w.Bytes()));
    tcp::ResponseHeader rh{};
    std::string msg;
    ASSERT_TRUE(ReadResponse(fd, &rh, &msg)) << "request " << id;
    EXPECT_EQ(rh.magic, tcp::kResponseMagic);
    EXPECT_EQ(rh.req_id, id);
    EXPECT_EQ(rh.code, static_cast<uint16_t>(StatusCode::ERR_INVALID_ARGS)) << msg;
    EXPECT_TRUE(Contains(msg, "rejected by target")) << msg;
    EXPECT_EQ(rh.payload_bytes, 0u);
    EXPECT_EQ(mem_, orig) << "request " << id << " touched memory";
    ++id;
  }
  // Unknown memory id.
  {
    auto w = MakeWrite(id, WithId(memd_, 999), {{0, 8}}, 0xee);
    ASSERT_TRUE(SendAll(fd, w.Bytes()));
    tcp::ResponseHeader rh{};
    std::string msg;
    ASSERT_TRUE(ReadResponse(fd, &rh, &msg));
    EXPECT_EQ(rh.code, static_cast<uint16_t>(StatusCode::ERR_NOT_FOUND)) << msg;
    ++id;
  }
  // A read beyond the end returns an error and no payload.
  {
    auto w = MakeWrite(id, memd_, {{mem_.size() - 1, 2}}, 0);
    w.h.op = static_cast<uint8_t>(tcp::Op::Read);
    w.payload.clear();
    ASSERT_TRUE(SendAll(fd, w.Bytes()));
    tcp::ResponseHeader rh{};
    std::string msg;
    ASSERT_TRUE(ReadResponse(fd, &rh, &msg));
    EXPECT_EQ(rh.code, static_cast<uint16_t>(StatusCode::ERR_INVALID_ARGS)) << msg;
    EXPECT_EQ(rh.payload_bytes, 0u);
    ++id;
  }
  // A good write on the same connection lands exactly where asked.
  {
    auto w = MakeWrite(id, memd_, {{100, 8}, {200, 4}}, 0xab);
    ASSERT_TRUE(SendAll(fd, w.Bytes()));
    tcp::ResponseHeader rh{};
    std::string msg;
    ASSERT_TRUE(ReadResponse(fd, &rh, &msg));
    EXPECT_EQ(rh.code, static_cast<uint16_t>(StatusCode::SUCCESS)) << msg;
    std::vector<uint8_t> want = orig;
    std::memset(&want[100], 0xab, 8);
    std::memset(&want[200], 0xab, 4);
    EXPECT_EQ(mem_, want);
    EXPECT_TRUE(testing_util::PollUntil([&] { return server_->PopInboundTransferStatus("raw-client", id); }, 2000));
    ++id;
  }
  // Segment sizes that do not add up to total_bytes: closed.
  {
    auto w = MakeWrite(id, memd_, {{0, 8}}, 0);
    w.h.total_bytes = 4;
    w.payload.resize(4);
    ASSERT_TRUE(SendAll(fd, w.Bytes()));
    EXPECT_TRUE(WaitClosed(fd, 2000));
  }
  // Bad magic, bad op, absurd segment count: each closes its connection.
  for (int k = 0; k < 3; ++k) {
    const int dfd = Handshake(ConnectionKind::Data, static_cast<uint8_t>(BackendType::TCP));
    auto w = MakeWrite(1, memd_, {{0, 8}}, 0);
    if (k == 0) w.h.magic = 0x12345678;
    if (k == 1) w.h.op = 9;
    if (k == 2) w.h.num_segs = 0xffffffffu;
    SendAll(dfd, w.Bytes());
    EXPECT_TRUE(WaitClosed(dfd, 2000)) << "case " << k;
  }
  EXPECT_EQ(0, std::memcmp(mem_.data(), orig.data(), 100));
  ExpectServerStillServes();
}

TEST_F(ControlPlaneTest, FuzzedDataRequestsNeverTouchMemoryOutsideTheRegistration) {
  // Register the middle third of a buffer; random (often invalid) requests
  // may change the middle, never the guards around it.
  constexpr size_t kPart = 16 << 10;
  std::vector<uint8_t> whole(3 * kPart);
  testing_util::FillRandom(whole, 77);
  const std::vector<uint8_t> orig = whole;
  MemoryDesc mid =
      server_->RegisterMemory(reinterpret_cast<uint64_t>(whole.data() + kPart), kPart, -1, MemoryLocationType::CPU);
  std::mt19937_64 rng(321);
  auto pick_offset = [&]() -> uint64_t {
    switch (rng() % 5) {
      case 0:
        return rng() % kPart;
      case 1:
        return kPart - rng() % 16;
      case 2:
        return kPart + rng() % 64;
      case 3:
        return UINT64_MAX - rng() % 64;
      default:
        return rng();
    }
  };
  for (int iter = 0; iter < 300; ++iter) {
    const int fd = Handshake(ConnectionKind::Data, static_cast<uint8_t>(BackendType::TCP));
    std::vector<uint8_t> bytes;
    for (int k = 0, n = 1 + rng() % 3; k < n; ++k) {
      std::vector<tcp::WireSegment> segs(rng() % 4);
      for (auto& sg : segs) {
        sg.offset = pick_offset();
        sg.size = rng() % 3 == 0 ? rng() : rng() % 64;
      }
      auto w = MakeWrite(iter * 8 + k, rng() % 4 == 0 ? WithId(mid, rng() % 4) : mid, {}, 0);
      w.segs = segs;
      w.h.num_segs = static_cast<uint32_t>(segs.size());
      uint64_t total = 0;
      for (auto& sg : segs) total += sg.size;
      w.h.total_bytes = rng() % 8 == 0 ? rng() : total;
      if (rng() % 5 == 0) w.h.op = static_cast<uint8_t>(rng() % 5);
      w.payload.resize(std::min<uint64_t>(w.h.total_bytes, 4096));
      for (auto& b : w.payload) b = static_cast<uint8_t>(rng());
      auto b = w.Bytes();
      if (rng() % 4 == 0) b[rng() % b.size()] ^= 1u << (rng() % 8);
      bytes.insert(bytes.end(), b.begin(), b.end());
    }
    SendAll(fd, bytes);
    ::shutdown(fd, SHUT_WR);
    ASSERT_TRUE(WaitClosed(fd, 3000)) << "iteration " << iter;
    ::close(fd);
    fds_.pop_back();
  }
  EXPECT_EQ(0, std::memcmp(whole.data(), orig.data(), kPart)) << "guard before the registration was written";
  EXPECT_EQ(0, std::memcmp(whole.data() + 2 * kPart, orig.data() + 2 * kPart, kPart))
      << "guard after the registration was written";
  // Each fuzzed stream ends in a half-close, and the target's fence drops a
  // write whose payload it had not begun receiving when it saw it (the
  // initiator left), so whether any fuzzed write lands is a race. That the
  // path writes the registration at all is checked on a connection kept open.
  {
    const int fd = Handshake(ConnectionKind::Data, static_cast<uint8_t>(BackendType::TCP));
    auto w = MakeWrite(1 << 20, mid, {{0, 64}}, 0x5a);
    ASSERT_TRUE(SendAll(fd, w.Bytes()));
    tcp::ResponseHeader rh{};
    std::string msg;
    ASSERT_TRUE(ReadResponse(fd, &rh, &msg));
    EXPECT_EQ(rh.code, static_cast<uint16_t>(StatusCode::SUCCESS)) << msg;
    EXPECT_EQ(std::vector<uint8_t>(whole.begin() + kPart, whole.begin() + kPart + 64), std::vector<uint8_t>(64, 0x5a));
  }
  EXPECT_EQ(0, std::memcmp(whole.data(), orig.data(), kPart)) << "guard before the registration was written";
  EXPECT_EQ(0, std::memcmp(whole.data() + 2 * kPart, orig.data() + 2 * kPart, kPart))
      << "guard after the registration was written";
  server_->DeregisterMemory(mid);
  ExpectServerStillServes();
}

}  // namespace
}  // namespace mori_torch
