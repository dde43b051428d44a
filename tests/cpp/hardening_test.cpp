// Regression tests for the resource bounds and contract fixes of issue #18,
// each against a real engine over real sockets: threads that do not grow with
// connections, connection caps and idle timeouts, recovery from file
// descriptor exhaustion, allocation that follows arriving bytes, logging that
// never blocks on a stalled stderr, create_session bounded by one connect
// timeout, and the inactivity timeout beside the whole-operation one.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <thread>

#include "backends/tcp/tcp_protocol.h"
#include "core/byte_io.h"
#include "core/control_plane.h"
#include "core/engine.h"
#include "core/logging.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::ClosedWithin;
using testing_util::Contains;
using testing_util::MsSince;
using testing_util::PollUntil;
using testing_util::RawConnect;

int ThreadCount() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/task");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

int64_t RssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

bool SendAll(int fd, const void* p, size_t n) {
  const char* b = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t k = ::send(fd, b, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    b += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool SendAll(int fd, const std::vector<uint8_t>& v) { return SendAll(fd, v.data(), v.size()); }

// True once the peer closed fd (EOF or reset) within ms.
EngineDesc RawDesc(const std::string& key) {
  EngineDesc d;
  d.key = key;
  d.node_id = "n";
  d.hostname = "h";
  d.host = "127.0.0.1";
  d.port = 1;
  d.pid = 1;
  return d;
}

// A raw connection that completed a Hello of `kind` (a raw peer named `key`).
int RawHello(int port, ConnectionKind kind, const std::string& key, uint8_t backend = 0) {
  int fd = RawConnect(port);
  if (fd < 0) return -1;
  Frame ack;
  if (!SendAll(fd, EncodeFrame(FrameType::Hello, EncodeHello(kind, backend, RawDesc(key)))) ||
      !ReadFrame(fd, &ack, 3000, 3000).ok || ack.type != FrameType::HelloAck) {
    ::close(fd);
    return -1;
  }
  return fd;
}

struct Fds {
  std::vector<int> v;
  ~Fds() { CloseAll(); }
  void CloseAll() {
    for (int fd : v) ::close(fd);
    v.clear();
  }
};

class HardeningTest : public ::testing::Test {
 protected:
  void SetUp() override { SetLogLevel("critical"); }
  void TearDown() override { SetLogLevel("warning"); }

  static EngineConfig Config() {
    EngineConfig c{"127.0.0.1", 0};
    c.control.frame_timeout_ms = 300;
    c.control.hello_timeout_ms = 300;
    return c;
  }

  // A fresh engine writes into `target`'s memory and reads it back.
  static void ExpectServes(Engine& target) {
    std::vector<uint8_t> there(8192, 0), src(8192), back(8192, 0);
    testing_util::FillRandom(src, 3);
    MemoryDesc td = target.RegisterMemory(reinterpret_cast<uint64_t>(there.data()), 8192, -1, MemoryLocationType::CPU);
    Engine peer("probe", EngineConfig{"127.0.0.1", 0});
    peer.CreateBackend(BackendType::TCP, {{"num_data_conns", 2}});
    peer.RegisterRemoteEngine(target.Desc());
    MemoryDesc sm = peer.RegisterMemory(reinterpret_cast<uint64_t>(src.data()), 8192, -1, MemoryLocationType::CPU);
    MemoryDesc bm = peer.RegisterMemory(reinterpret_cast<uint64_t>(back.data()), 8192, -1, MemoryLocationType::CPU);
    auto w = peer.Write(sm, 0, td, 0, 8192, peer.AllocateTransferUid());
    ASSERT_EQ(w->WaitFor(10000), StatusCode::SUCCESS) << w->Message();
    auto r = peer.Read(bm, 0, td, 0, 8192, peer.AllocateTransferUid());
    ASSERT_EQ(r->WaitFor(10000), StatusCode::SUCCESS) << r->Message();
    EXPECT_EQ(back, src);
    peer.Shutdown();
    target.DeregisterMemory(td);
  }
};

// Was: one thread per inbound connection (500 connections, 500 threads).
TEST_F(HardeningTest, ThreadCountDoesNotGrowWithConnections) {
  EngineConfig cfg = Config();
  cfg.control.hello_timeout_ms = 10000;
  cfg.control.caps.max_connections_per_peer = 1000;
  cfg.control.caps.max_handshaking_per_ip = 1000;
  Engine e("server", cfg);
  e.CreateBackend(BackendType::TCP, {});
  LogLine(LogLevel::Info, "");  // the log writer thread, started before counting
  const int before = ThreadCount();
  Fds fds;
  for (int i = 0; i < 200; ++i) fds.v.push_back(RawHello(e.Desc().port, ConnectionKind::Control, "c"));
  for (int i = 0; i < 200; ++i) {
    fds.v.push_back(RawHello(e.Desc().port, ConnectionKind::Data, "d", static_cast<uint8_t>(BackendType::TCP)));
  }
  for (int i = 0; i < 100; ++i) fds.v.push_back(RawConnect(e.Desc().port));  // no Hello yet
  for (int fd : fds.v) ASSERT_GE(fd, 0);
  EXPECT_TRUE(PollUntil([&] { return e.InboundConnections() == 500; }, 5000)) << e.InboundConnections();
  EXPECT_EQ(ThreadCount(), before);
  ExpectServes(e);
  fds.CloseAll();
  EXPECT_TRUE(PollUntil([&] { return e.InboundConnections() == 0; }, 5000)) << e.InboundConnections();
}

// Was: no cap and no idle timeout.
TEST_F(HardeningTest, ConnectionCapsRefuseTheExcessAndUnfinishedHandshakesTimeOut) {
  EngineConfig cfg = Config();
  cfg.control.caps.max_handshaking_per_ip = 10;
  cfg.control.caps.max_connections_per_peer = 5;
  cfg.control.caps.max_connections = 40;
  cfg.control.hello_timeout_ms = 1000;
  Engine e("server", cfg);
  e.CreateBackend(BackendType::TCP, {});
  Fds silent;
  for (int i = 0; i < 20; ++i) silent.v.push_back(RawConnect(e.Desc().port));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // less than hello_timeout_ms
  int closed_at_once = 0;
  for (int fd : silent.v) closed_at_once += ClosedWithin(fd, 1);
  EXPECT_EQ(closed_at_once, 10);  // beyond 10 handshaking per address
  // The rest never say Hello: closed after hello_timeout_ms.
  for (int fd : silent.v) EXPECT_TRUE(ClosedWithin(fd, 3000));
  // Per peer: the sixth connection of one engine key is refused with a reason.
  Fds named;
  for (int i = 0; i < 5; ++i) named.v.push_back(RawHello(e.Desc().port, ConnectionKind::Control, "greedy"));
  for (int fd : named.v) ASSERT_GE(fd, 0);
  int fd = RawConnect(e.Desc().port);
  named.v.push_back(fd);
  ASSERT_TRUE(SendAll(fd, EncodeFrame(FrameType::Hello, EncodeHello(ConnectionKind::Control, 0, RawDesc("greedy")))));
  Frame reply;
  ASSERT_TRUE(ReadFrame(fd, &reply, 2000, 2000).ok);
  ASSERT_EQ(reply.type, FrameType::Error);
  EXPECT_TRUE(Contains(DecodeErrorPayload(reply, "").what(), "max_connections_per_peer"))
      << DecodeErrorPayload(reply, "").what();
  EXPECT_GE(e.RefusedConnections(), 11u);
  // The engine cap: 40 in all.
  Fds many;
  for (int i = 0; i < 45; ++i)
    many.v.push_back(RawHello(e.Desc().port, ConnectionKind::Control, "k" + std::to_string(i)));
  int refused = 0;
  for (int f : many.v) refused += f < 0;
  EXPECT_EQ(refused, 45 - (40 - 5));
  many.CloseAll();
  named.CloseAll();
  silent.CloseAll();
  // Closed on our side; the server notices on its loop, then has room again.
  EXPECT_TRUE(PollUntil([&] { return e.InboundConnections() == 0; }, 5000)) << e.InboundConnections();
  ExpectServes(e);
}

TEST_F(HardeningTest, IdleEstablishedConnectionsAreClosedAndClientsReconnect) {
  EngineConfig cfg = Config();
  cfg.control.idle_timeout_ms = 300;
  Engine e("server", cfg);
  e.CreateBackend(BackendType::TCP, {});
  int c = RawHello(e.Desc().port, ConnectionKind::Control, "idle");
  int d = RawHello(e.Desc().port, ConnectionKind::Data, "idle", static_cast<uint8_t>(BackendType::TCP));
  ASSERT_GE(c, 0);
  ASSERT_GE(d, 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(ClosedWithin(c, 3000));
  EXPECT_TRUE(ClosedWithin(d, 3000));
  EXPECT_GE(MsSince(t0), 200);
  ::close(c);
  ::close(d);
  // An initiator whose connections were closed while idle goes on.
  ControlClient client(RawDesc("idle2"), e.Desc(), 2000);
  EXPECT_EQ(client.Call(FrameType::Ping, {}).type, FrameType::Pong);
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  EXPECT_EQ(client.Call(FrameType::Ping, {}).type, FrameType::Pong);
  ExpectServes(e);
}

// Was: out of file descriptors, accept() failed in a loop and legitimate
// connects still failed long after the attacker left.
TEST_F(HardeningTest, RecoversByItselfFromFileDescriptorExhaustion) {
  Engine e("server", Config());
  e.CreateBackend(BackendType::TCP, {});
  // The clients live in a child process: their sockets must not take the
  // descriptors this (server) process runs out of.
  int go[2];
  ASSERT_EQ(::pipe(go), 0);
  const int port = e.Desc().port;
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    char c;
    if (::read(go[0], &c, 1) != 1) _exit(90);
    int dropped = 0;
    for (int i = 0; i < 3; ++i) {
      int fd = RawConnect(port);
      if (fd < 0) _exit(91);
      dropped += ClosedWithin(fd, 3000);
      ::close(fd);
    }
    _exit(dropped);  // 3: each one closed by the server, none left hanging
  }
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &old), 0);
  rlimit low = old;
  low.rlim_cur = 256;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  Fds filler;
  while (true) {
    int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) break;
    filler.v.push_back(fd);
  }
  ASSERT_EQ(errno, EMFILE);
  ASSERT_EQ(::write(go[1], "g", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  const uint64_t refused = e.RefusedConnections();
  filler.CloseAll();  // descriptors free again
  ::setrlimit(RLIMIT_NOFILE, &old);
  ::close(go[0]);
  ::close(go[1]);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3);
  EXPECT_GE(refused, 3u);
  const auto t0 = std::chrono::steady_clock::now();
  ControlClient client(RawDesc("after"), e.Desc(), 2000);
  EXPECT_EQ(client.Call(FrameType::Ping, {}).type, FrameType::Pong);
  EXPECT_LT(MsSince(t0), 2000);
  ExpectServes(e);
}

// Was: 768 bytes sent made the target allocate 509 MiB (claimed lengths).
TEST_F(HardeningTest, ClaimedLengthsAllocateNothingAheadOfTheBytes) {
  EngineConfig cfg = Config();
  cfg.control.frame_timeout_ms = 5000;
  cfg.control.caps.max_connections_per_peer = 1000;
  Engine e("server", cfg);
  e.CreateBackend(BackendType::TCP, {});
  std::vector<uint8_t> warm(1 << 20);  // fault in what the probe transfer itself uses
  ExpectServes(e);
  const int64_t rss0 = RssKiB();
  Fds fds;
  for (int i = 0; i < 64; ++i) {
    // A data request claiming the largest segment table, then silence.
    int fd = RawHello(e.Desc().port, ConnectionKind::Data, "claims", static_cast<uint8_t>(BackendType::TCP));
    ASSERT_GE(fd, 0);
    tcp::RequestHeader h{};
    h.magic = tcp::kRequestMagic;
    h.op = 1;
    h.req_id = 1;
    h.num_segs = tcp::kMaxSegmentsPerRequest;  // 64 MiB of table
    h.total_bytes = 1;
    ASSERT_TRUE(SendAll(fd, &h, sizeof h));
    fds.v.push_back(fd);
    // A control frame claiming the largest payload, then silence.
    int c = RawHello(e.Desc().port, ConnectionKind::Control, "claims");
    ASSERT_GE(c, 0);
    ByteWriter w;
    w.Put<uint32_t>(kFrameMagic);
    w.Put<uint16_t>(kProtocolVersion);
    w.Put<uint16_t>(static_cast<uint16_t>(FrameType::MemLookup));
    w.Put<uint32_t>(kMaxFramePayload);
    w.Put<uint32_t>(7);
    ASSERT_TRUE(SendAll(c, w.bytes()));
    fds.v.push_back(c);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const int64_t grown_kib = RssKiB() - rss0;
  // The claims add up to 64 x (64 MiB + 1 MiB); what arrived is 64 x 68 bytes.
  EXPECT_LT(grown_kib, 16 << 10) << grown_kib << " KiB";
  fds.CloseAll();
  ExpectServes(e);
}

// Was: with stderr a pipe nobody reads, connection threads blocked in
// logging and shutdown() did not return.
TEST_F(HardeningTest, LoggingNeverBlocksOnAStalledStderrNorHoldsShutdown) {
  SetLogLevel("info");
  int pipefd[2];
  ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
  const int saved = ::dup(STDERR_FILENO);
  ASSERT_EQ(::dup2(pipefd[1], STDERR_FILENO), STDERR_FILENO);  // nobody reads pipefd[0]
  const uint64_t dropped0 = LogLinesDropped(), suppressed0 = LogLinesSuppressed();
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) {
    ts.emplace_back([] {
      for (int i = 0; i < 20000; ++i) LogLine(LogLevel::Warning, std::string(200, 'x'));
      for (int i = 0; i < 1000; ++i) MORI_LOG(Warning, "one site, many lines " << i);
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_LT(MsSince(t0), 5000);
  EXPECT_GT(LogLinesDropped(), dropped0);        // the pipe filled: lines dropped, not waited for
  EXPECT_GT(LogLinesSuppressed(), suppressed0);  // one site: rate-limited
  {
    Engine e("server", Config());
    e.CreateBackend(BackendType::TCP, {});
    Fds bad;  // every one of these makes the engine log
    for (int i = 0; i < 200; ++i) {
      int fd = RawConnect(e.Desc().port);
      ASSERT_GE(fd, 0);
      SendAll(fd, std::vector<uint8_t>(64, 0xee));
      bad.v.push_back(fd);
    }
    for (int fd : bad.v) EXPECT_TRUE(ClosedWithin(fd, 3000));
    ExpectServes(e);
    t0 = std::chrono::steady_clock::now();
    e.Shutdown();
    EXPECT_LT(MsSince(t0), 3000);
  }
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  ::close(pipefd[1]);
  ::close(pipefd[0]);  // the writer's blocked write fails now; later lines reach stderr
}

// A listener that completes TCP handshakes (backlog) and never answers.
struct HungPeer {
  Socket listener;
  int port = 0;
  HungPeer() { listener = Listen("127.0.0.1", 0, &port); }
  EngineDesc Desc() const {
    EngineDesc d = RawDesc("hung");
    d.port = port;
    return d;
  }
};

// Was: 2 x connect_timeout_ms against a hung peer.
TEST_F(HardeningTest, CreateSessionIsBoundedByOneConnectTimeout) {
  EngineConfig cfg = Config();
  cfg.connect_timeout_ms = 600;
  Engine e("initiator", cfg);
  e.CreateBackend(BackendType::TCP, {});
  HungPeer hung;
  e.RegisterRemoteEngine(hung.Desc());
  std::vector<uint8_t> buf(4096);
  MemoryDesc local = e.RegisterMemory(reinterpret_cast<uint64_t>(buf.data()), 4096, -1, MemoryLocationType::CPU);
  MemoryDesc remote;
  remote.engine_key = "hung";
  remote.id = 0;
  remote.data = 0x10000;
  remote.size = 4096;
  remote.loc = MemoryLocationType::CPU;
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  try {
    e.CreateSession(local, remote);
  } catch (const Error& err) {
    msg = err.what();
  }
  const int64_t took = MsSince(t0);
  EXPECT_FALSE(msg.empty());
  EXPECT_GE(took, 500);
  EXPECT_LT(took, 900) << msg;  // one connect timeout (600 ms), not two
}

// A fake target engine: completes the Hello of one data connection, then
// consumes one write request at `bytes_per_50ms` (0: never) and answers it.
class FakeTarget {
 public:
  explicit FakeTarget(size_t bytes_per_50ms) : rate_(bytes_per_50ms) {
    listener_ = Listen("127.0.0.1", 0, &port_);
    thread_ = std::thread([this] { Run(); });
  }
  ~FakeTarget() {
    stop_ = true;
    listener_.Shutdown();
    conn_.Shutdown();
    thread_.join();
  }
  EngineDesc Desc() const {
    EngineDesc d = RawDesc("fake");
    d.port = port_;
    return d;
  }

 private:
  void Run() {
    if (!WaitReadable(listener_.fd(), 10000) || stop_) return;
    conn_ = Socket(::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC));
    Frame hello;
    if (!ReadFrame(conn_.fd(), &hello, 5000, 5000).ok) return;
    if (!WriteFrame(conn_.fd(), FrameType::HelloAck, Desc().Pack(), 5000).ok) return;
    tcp::RequestHeader h{};
    if (!ReadFull(conn_.fd(), &h, sizeof h, DeadlineAfterMs(10000)).ok) return;
    std::vector<char> rest(tcp::WireRound(sizeof h + h.num_segs * sizeof(tcp::WireSegment)) - sizeof h +
                           tcp::WireRound(h.total_bytes));
    if (rate_ == 0) {
      while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
      return;
    }
    for (size_t off = 0; off < rest.size() && !stop_;) {
      size_t n = std::min(rate_, rest.size() - off);
      if (!ReadFull(conn_.fd(), rest.data() + off, n, DeadlineAfterMs(10000)).ok) return;
      off += n;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    tcp::ResponseHeader rh{tcp::kResponseMagic, 0, 0, h.req_id, 0};
    char out[tcp::kWireAlign] = {};
    std::memcpy(out, &rh, sizeof rh);
    WriteFull(conn_.fd(), out, sizeof out, DeadlineAfterMs(5000));
    while (!stop_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  const size_t rate_;
  Socket listener_, conn_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

StatusPtr WriteTo(Engine& e, const FakeTarget& t, std::vector<uint8_t>& buf) {
  e.RegisterRemoteEngine(t.Desc());
  MemoryDesc local = e.RegisterMemory(reinterpret_cast<uint64_t>(buf.data()), static_cast<int64_t>(buf.size()), -1,
                                      MemoryLocationType::CPU);
  MemoryDesc remote;
  remote.engine_key = "fake";
  remote.data = 0x10000;
  remote.size = buf.size();
  remote.loc = MemoryLocationType::CPU;
  return e.Write(local, 0, remote, 0, static_cast<int64_t>(buf.size()), e.AllocateTransferUid());
}

// Was: only the whole-operation timeout, so a live but slow transfer and a
// dead one looked alike.
TEST_F(HardeningTest, InactivityTimeoutEndsAStalledTransferLongBeforeTheOpTimeout) {
  Engine e("initiator", Config());
  e.CreateBackend(BackendType::TCP, {{"num_data_conns", 1}, {"op_timeout_ms", 60000}, {"inactivity_timeout_ms", 400}});
  FakeTarget stalled(0);
  std::vector<uint8_t> buf(64 << 10);
  const auto t0 = std::chrono::steady_clock::now();
  auto st = WriteTo(e, stalled, buf);
  EXPECT_EQ(st->WaitFor(10000), StatusCode::ERR_BAD_STATE);
  EXPECT_TRUE(Contains(st->Message(), "inactivity_timeout_ms")) << st->Message();
  EXPECT_LT(MsSince(t0), 3000);
}

TEST_F(HardeningTest, ASlowButLiveTransferOutlastsTheInactivityTimeout) {
  Engine e("initiator", Config());
  e.CreateBackend(BackendType::TCP, {{"num_data_conns", 1}, {"op_timeout_ms", 60000}, {"inactivity_timeout_ms", 400}});
  FakeTarget slow(64 << 10);  // 2 MiB at 64 KiB / 50 ms: about 1.6 s, 4 x the inactivity timeout
  std::vector<uint8_t> buf(2 << 20);
  const auto t0 = std::chrono::steady_clock::now();
  auto st = WriteTo(e, slow, buf);
  EXPECT_EQ(st->WaitFor(20000), StatusCode::SUCCESS) << st->Message();
  EXPECT_GT(MsSince(t0), 1200);
}

TEST_F(HardeningTest, EveryNonTransferCallAfterShutdownThrows) {
  Engine e("done", Config());
  e.CreateBackend(BackendType::TCP, {});
  std::vector<uint8_t> buf(4096);
  MemoryDesc m = e.RegisterMemory(reinterpret_cast<uint64_t>(buf.data()), 4096, -1, MemoryLocationType::CPU);
  e.Shutdown();
  auto throws_bad_state = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& err) {
      return err.code() == StatusCode::ERR_BAD_STATE && Contains(err.what(), "shut down");
    }
    return false;
  };
  EXPECT_TRUE(throws_bad_state(
      [&] { e.RegisterMemory(reinterpret_cast<uint64_t>(buf.data()), 4096, -1, MemoryLocationType::CPU); }));
  EXPECT_TRUE(throws_bad_state([&] { e.CreateBackend(BackendType::TCP, {}); }));
  EXPECT_TRUE(throws_bad_state([&] { e.RegisterRemoteEngine(RawDesc("x")); }));
  EXPECT_TRUE(throws_bad_state([&] { e.CreateSession(m, m); }));
  EXPECT_TRUE(throws_bad_state([&] { e.DeregisterMemory(m); }));
  EXPECT_TRUE(throws_bad_state([&] { e.DeregisterRemoteEngine(RawDesc("x")); }));
  EXPECT_TRUE(throws_bad_state([&] { e.RemoveBackend(BackendType::TCP); }));
  EXPECT_TRUE(throws_bad_state([&] { e.PopInboundTransferStatus("x", 1); }));
  // Transfers keep the core's contract (errors are statuses; threads that
  // race with shutdown() get one): failed at once.
  EXPECT_EQ(e.Write(m, 0, m, 0, 8, 1)->PeekCode(), StatusCode::ERR_BAD_STATE);
  EXPECT_EQ(e.Read(m, 0, m, 0, 8, 1)->PeekCode(), StatusCode::ERR_BAD_STATE);
  EXPECT_EQ(e.BatchTransfer(false, {m}, {{0}}, {m}, {{0}}, {{8}}, {1})[0]->PeekCode(), StatusCode::ERR_BAD_STATE);
}

}  // namespace
}  // namespace mori_torch
