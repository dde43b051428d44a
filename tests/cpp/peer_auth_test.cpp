// Trust on the wire, over real sockets: the HMAC-SHA256 handshake on its own
// (both sides, wrong secrets, tampering, reflection), engines with and
// without secrets (a wrong or missing secret on either side is refused and
// nothing is served), raw unauthenticated clients, forged and enumerated
// memory handles, and descriptors of a restarted engine.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>

#include "core/byte_io.h"
#include "core/control_plane.h"
#include "core/engine.h"
#include "core/logging.h"
#include "core/peer_auth.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::CatchError;
using testing_util::ClosedWithin;
using testing_util::Contains;
using testing_util::FillRandom;
using testing_util::RawConnect;

constexpr int kWaitMs = 20000;

EngineConfig Config(const std::string& secret, int port = 0) {
  EngineConfig c;
  c.host = "127.0.0.1";
  c.port = port;
  c.secret = secret;
  return c;
}

std::vector<uint8_t> SomeHello(const std::string& key, const auth::HelloAuth& a) {
  EngineDesc d;
  d.key = key;
  d.host = "127.0.0.1";
  d.incarnation = 5;
  return EncodeHello(ConnectionKind::Control, 0, d, a);
}

// --- the handshake alone -------------------------------------------------------

TEST(PeerAuthHandshake, SameSecretProvesBothWays) {
  auth::ClientHandshake client("s3cret", "server");
  const auto hello = SomeHello("client", client.Offer());
  auth::ServerHandshake server("s3cret", hello, "server");
  const auto challenge = server.Challenge();
  EXPECT_EQ(client.VerifyChallenge(hello, challenge.data(), challenge.size()), "");
  const auto proof = client.Proof();
  EXPECT_EQ(server.VerifyProof(proof.data(), proof.size()), "");
}

TEST(PeerAuthHandshake, WrongSecretFailsOnBothSides) {
  auth::ClientHandshake client("right", "server");
  const auto hello = SomeHello("client", client.Offer());
  auth::ServerHandshake server("wrong", hello, "server");
  const auto challenge = server.Challenge();
  EXPECT_TRUE(Contains(client.VerifyChallenge(hello, challenge.data(), challenge.size()), "does not match"));
  EXPECT_THROW(client.Proof(), Error);  // no proof without a verified challenge
  // A proof made on another connection (other nonces), even with the right
  // secret, is refused here.
  auth::ClientHandshake other("right", "server");
  const auto h2 = SomeHello("client", other.Offer());
  auth::ServerHandshake s2("right", h2, "server");
  const auto c2 = s2.Challenge();
  ASSERT_EQ(other.VerifyChallenge(h2, c2.data(), c2.size()), "");
  const auto replayed = other.Proof();
  auth::ClientHandshake fresh("right", "server");
  auth::ServerHandshake s3("right", SomeHello("client", fresh.Offer()), "server");
  EXPECT_TRUE(Contains(s3.VerifyProof(replayed.data(), replayed.size()), "does not match"));
  EXPECT_EQ(s2.VerifyProof(replayed.data(), replayed.size()), "");
}

TEST(PeerAuthHandshake, TranscriptTamperingAndReflectionAreRefused) {
  auth::ClientHandshake client("k", "server");
  const auto hello = SomeHello("client", client.Offer());
  // The server saw a Hello naming another engine key: proofs do not carry over.
  auth::ServerHandshake server("k", SomeHello("mallory", client.Offer()), "server");
  auto challenge = server.Challenge();
  EXPECT_NE(client.VerifyChallenge(hello, challenge.data(), challenge.size()), "");
  // Meant for another engine key.
  auth::ClientHandshake client2("k", "someone-else");
  const auto hello2 = SomeHello("client", client2.Offer());
  auth::ServerHandshake server2("k", hello2, "server");
  challenge = server2.Challenge();
  EXPECT_NE(client2.VerifyChallenge(hello2, challenge.data(), challenge.size()), "");
  // Reflection: the server's own proof sent back as the client's.
  std::vector<uint8_t> reflected(challenge.begin(), challenge.begin() + 1);
  reflected.insert(reflected.end(), challenge.end() - crypto::kHmacBytes, challenge.end());
  EXPECT_TRUE(Contains(server2.VerifyProof(reflected.data(), reflected.size()), "does not match"));
  // A flipped bit anywhere in a proof.
  auth::ClientHandshake c3("k", "server");
  const auto h3 = SomeHello("client", c3.Offer());
  auth::ServerHandshake s3("k", h3, "server");
  challenge = s3.Challenge();
  ASSERT_EQ(c3.VerifyChallenge(h3, challenge.data(), challenge.size()), "");
  auto proof = c3.Proof();
  for (size_t i = 1; i < proof.size(); ++i) {
    auto bad = proof;
    bad[i] ^= 0x10;
    EXPECT_NE(s3.VerifyProof(bad.data(), bad.size()), "") << "byte " << i;
  }
  EXPECT_EQ(s3.VerifyProof(proof.data(), proof.size()), "");
}

TEST(PeerAuthHandshake, ParsersNameWhatIsWrong) {
  auth::Nonce n;
  crypto::Mac m;
  std::vector<uint8_t> b(65, 0);
  EXPECT_TRUE(Contains(auth::ParseChallenge(b.data(), 64, &n, &m), "64 bytes (expected 65)"));
  b[0] = 9;
  EXPECT_TRUE(Contains(auth::ParseChallenge(b.data(), 65, &n, &m), "authentication version 9"));
  EXPECT_TRUE(Contains(auth::ParseProof(b.data(), 0, &m), "0 bytes (expected 33)"));
  b[0] = 1;
  EXPECT_EQ(auth::ParseProof(b.data(), 33, &m), "");
  // A Hello with an unknown authentication version.
  auto hello = SomeHello("c", {});
  hello.back() = 7;
  Frame f;
  f.type = FrameType::Hello;
  f.payload = hello;
  auto e = CatchError([&] { DecodeHello(f); });
  ASSERT_TRUE(e);
  EXPECT_TRUE(Contains(e->what(), "authentication version 7")) << e->what();
}

TEST(PeerAuthHandshake, SecretComesFromConfigOrEnvironmentAndIsBounded) {
  testing_util::ScopedEnv env("MORI_TORCH_SECRET", "from-env");
  EXPECT_EQ(auth::ResolveSecret(""), "from-env");
  EXPECT_EQ(auth::ResolveSecret("from-config"), "from-config");
  auto e = CatchError([] { auth::ResolveSecret(std::string(5000, 'x')); });
  ASSERT_TRUE(e);
  EXPECT_TRUE(Contains(e->what(), "5000 bytes")) << e->what();
}

// --- engines ------------------------------------------------------------------

struct Buffer {
  explicit Buffer(size_t n, uint64_t seed) : bytes(n) { FillRandom(bytes, seed); }
  uint64_t ptr() { return reinterpret_cast<uint64_t>(bytes.data()); }
  std::vector<uint8_t> bytes;
};

class EngineAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetLogLevel("critical");  // refusals log a warning each
    target_ = std::make_unique<Engine>("target", Config("team secret"));
    target_->CreateBackend(BackendType::TCP, {});
    tmem_ = target_->RegisterMemory(target_buf_.ptr(), static_cast<int64_t>(target_buf_.bytes.size()), -1,
                                    MemoryLocationType::CPU);
  }
  void TearDown() override { SetLogLevel("warning"); }

  // A write of 4 KiB from a fresh engine with `secret` into the target.
  StatusPtr WriteFrom(const std::string& key, const std::string& secret, Engine** keep = nullptr) {
    initiators_.push_back(std::make_unique<Engine>(key, Config(secret)));
    Engine& e = *initiators_.back();
    e.CreateBackend(BackendType::TCP, {});
    e.RegisterRemoteEngine(target_->Desc());
    MemoryDesc local = e.RegisterMemory(src_.ptr(), 4096, -1, MemoryLocationType::CPU);
    if (keep) *keep = &e;
    auto s = e.Write(local, 0, tmem_, 0, 4096, e.AllocateTransferUid());
    s->WaitFor(kWaitMs);
    return s;
  }

  Buffer target_buf_{1 << 16, 1};
  Buffer src_{4096, 2};
  std::unique_ptr<Engine> target_;
  MemoryDesc tmem_;
  std::vector<std::unique_ptr<Engine>> initiators_;
};

TEST_F(EngineAuthTest, PeersWithTheSecretTransferAndOthersAreRefused) {
  const std::vector<uint8_t> orig = target_buf_.bytes;
  auto wrong = WriteFrom("wrong-secret", "not the team secret");
  EXPECT_EQ(wrong->Code(), StatusCode::ERR_BAD_STATE);
  EXPECT_TRUE(Contains(wrong->Message(), "authentication failed")) << wrong->Message();
  auto none = WriteFrom("no-secret", "");
  EXPECT_EQ(none->Code(), StatusCode::ERR_BAD_STATE);
  EXPECT_TRUE(Contains(none->Message(), "requires authentication")) << none->Message();
  EXPECT_TRUE(Contains(none->Message(), "has no secret")) << none->Message();
  EXPECT_EQ(target_buf_.bytes, orig) << "a refused peer changed the target's memory";

  auto ok = WriteFrom("teammate", "team secret");
  ASSERT_EQ(ok->Code(), StatusCode::SUCCESS) << ok->Message();
  EXPECT_EQ(0, std::memcmp(target_buf_.bytes.data(), src_.bytes.data(), 4096));
}

TEST_F(EngineAuthTest, AnEngineWithASecretRefusesAnOpenServer) {
  Engine open_server("open", Config(""));
  open_server.CreateBackend(BackendType::TCP, {});
  Buffer b(4096, 3);
  MemoryDesc m = open_server.RegisterMemory(b.ptr(), 4096, -1, MemoryLocationType::CPU);
  Engine client("client", Config("team secret"));
  client.CreateBackend(BackendType::TCP, {});
  client.RegisterRemoteEngine(open_server.Desc());
  MemoryDesc local = client.RegisterMemory(src_.ptr(), 4096, -1, MemoryLocationType::CPU);
  auto s = client.Read(local, 0, m, 0, 4096, 1);
  EXPECT_EQ(s->WaitFor(kWaitMs), StatusCode::ERR_BAD_STATE);
  EXPECT_TRUE(Contains(s->Message(), "has no secret configured")) << s->Message();
  auto e = CatchError([&] { client.ValidateRemoteMemory(m); });
  ASSERT_TRUE(e);
  EXPECT_TRUE(Contains(e->what(), "has no secret configured")) << e->what();
}

std::string ErrorMessage(const Frame& f) {
  ByteReader r(f.payload.data(), f.payload.size(), "error");
  r.Get<uint32_t>("code");
  return r.GetString("message");
}

TEST_F(EngineAuthTest, RawUnauthenticatedClientsAreServedNothing) {
  const std::vector<uint8_t> packed_desc = target_->Desc().Pack();
  for (auto kind : {ConnectionKind::Control, ConnectionKind::Data}) {
    // A Hello without authentication (a made-up key).
    int fd = RawConnect(target_->Desc().port);
    EngineDesc me;
    me.key = "made-up";
    me.host = "127.0.0.1";
    ASSERT_TRUE(WriteFrame(fd, FrameType::Hello, EncodeHello(kind, 3, me), 2000).ok);
    Frame f;
    ASSERT_TRUE(ReadFrame(fd, &f, 2000, 2000).ok);
    ASSERT_EQ(f.type, FrameType::Error);
    EXPECT_TRUE(Contains(ErrorMessage(f), "requires authentication")) << ErrorMessage(f);
    EXPECT_FALSE(ReadFrame(fd, &f, 2000, 2000).ok);  // and closed
    ::close(fd);

    // Claims to authenticate, then sends a made-up proof.
    fd = RawConnect(target_->Desc().port);
    auth::HelloAuth a;
    a.version = auth::kAuthVersion;
    ASSERT_TRUE(WriteFrame(fd, FrameType::Hello, EncodeHello(kind, 3, me, a), 2000).ok);
    ASSERT_TRUE(ReadFrame(fd, &f, 2000, 2000).ok);
    ASSERT_EQ(f.type, FrameType::AuthChallenge);
    EXPECT_EQ(f.payload.size(), 65u);  // a nonce and a MAC: no descriptor
    std::vector<uint8_t> proof(33, 0);
    proof[0] = auth::kAuthVersion;
    ASSERT_TRUE(WriteFrame(fd, FrameType::AuthProof, proof, 2000).ok);
    ASSERT_TRUE(ReadFrame(fd, &f, 2000, 2000).ok);
    ASSERT_EQ(f.type, FrameType::Error);
    EXPECT_TRUE(Contains(ErrorMessage(f), "authentication failed")) << ErrorMessage(f);
    ::close(fd);

    // Skips the handshake: straight to a lookup.
    fd = RawConnect(target_->Desc().port);
    ByteWriter w;
    w.Put<uint64_t>(tmem_.id);
    w.Put<uint64_t>(tmem_.incarnation);
    w.PutBytes(tmem_.token.data(), tmem_.token.size());
    ASSERT_TRUE(WriteFrame(fd, FrameType::MemLookup, w.bytes(), 2000).ok);
    IoResult r = ReadFrame(fd, &f, 2000, 2000);
    EXPECT_TRUE(!r.ok || f.type == FrameType::Error);
    ::close(fd);
  }
}

// A peer that asks to authenticate, takes the challenge and then never sends
// its proof holds a handshake slot only until hello_timeout_ms: the target
// closes it then (not at once, and not never), and keeps serving others.
TEST(EngineAuthTimeouts, APeerStallingBeforeItsProofIsClosedAtTheHelloTimeout) {
  SetLogLevel("critical");
  EngineConfig cfg = Config("team secret");
  cfg.control.hello_timeout_ms = 600;
  Engine target("target", cfg);
  target.CreateBackend(BackendType::TCP, {});
  for (auto kind : {ConnectionKind::Control, ConnectionKind::Data}) {
    int fd = RawConnect(target.Desc().port);
    ASSERT_GE(fd, 0);
    EngineDesc me;
    me.key = "stalls";
    me.host = "127.0.0.1";
    auth::HelloAuth a;
    a.version = auth::kAuthVersion;
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(WriteFrame(fd, FrameType::Hello, EncodeHello(kind, 3, me, a), 2000).ok);
    Frame f;
    ASSERT_TRUE(ReadFrame(fd, &f, 2000, 2000).ok);
    ASSERT_EQ(f.type, FrameType::AuthChallenge);
    // ... and no proof follows.
    EXPECT_FALSE(ClosedWithin(fd, 300)) << "closed long before hello_timeout_ms";
    EXPECT_TRUE(ClosedWithin(fd, 3000)) << "a stalled handshake was kept past hello_timeout_ms";
    const int64_t ms = testing_util::MsSince(t0);
    EXPECT_GE(ms, 500) << ms;
    EXPECT_LE(ms, 3000) << ms;
    ::close(fd);
  }
  // The target still serves a peer that proves the secret.
  Buffer tbuf(4096, 1), src(4096, 2);
  MemoryDesc tmem = target.RegisterMemory(tbuf.ptr(), 4096, -1, MemoryLocationType::CPU);
  Engine peer("teammate", Config("team secret"));
  peer.CreateBackend(BackendType::TCP, {});
  peer.RegisterRemoteEngine(target.Desc());
  MemoryDesc local = peer.RegisterMemory(src.ptr(), 4096, -1, MemoryLocationType::CPU);
  auto s = peer.Write(local, 0, tmem, 0, 4096, peer.AllocateTransferUid());
  ASSERT_EQ(s->WaitFor(kWaitMs), StatusCode::SUCCESS) << s->Message();
  EXPECT_EQ(0, std::memcmp(tbuf.bytes.data(), src.bytes.data(), 4096));
  SetLogLevel("warning");
}

TEST(EngineTokens, ForgedAndEnumeratedHandlesAreRefusedWithoutASecretToo) {
  SetLogLevel("critical");
  Engine target("target", Config(""));
  Engine peer("peer", Config(""));
  target.CreateBackend(BackendType::TCP, {});
  peer.CreateBackend(BackendType::TCP, {});
  peer.RegisterRemoteEngine(target.Desc());
  Buffer tb(1 << 16, 4), pb(1 << 16, 5);
  const std::vector<uint8_t> orig = tb.bytes;
  MemoryDesc real = target.RegisterMemory(tb.ptr(), 1 << 16, -1, MemoryLocationType::CPU);
  MemoryDesc local = peer.RegisterMemory(pb.ptr(), 1 << 16, -1, MemoryLocationType::CPU);
  // Every id of the target, with a guessed (zero) token, and a forged 1 TiB range.
  for (MemoryId id = 0; id < 64; ++id) {
    MemoryDesc forged = real;
    forged.id = id;
    forged.token = {};
    if (id == 1) forged.size = 1ull << 40;
    auto e = CatchError([&] { peer.ValidateRemoteMemory(forged); });
    ASSERT_TRUE(e) << "lookup of id " << id << " with a guessed token succeeded";
    EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);
    EXPECT_TRUE(Contains(e->what(), "memory " + std::to_string(id) + " is not registered")) << e->what();
    auto w = peer.Write(local, 0, forged, 0, 4096, id);
    EXPECT_EQ(w->WaitFor(kWaitMs), StatusCode::ERR_NOT_FOUND) << w->Message();
    auto r = peer.Read(local, 0, forged, 0, 4096, id);
    EXPECT_EQ(r->WaitFor(kWaitMs), StatusCode::ERR_NOT_FOUND) << r->Message();
  }
  EXPECT_EQ(tb.bytes, orig);
  // The real descriptor works, and its token is random per registration.
  auto ok = peer.Write(local, 0, real, 0, 4096, 99);
  ASSERT_EQ(ok->WaitFor(kWaitMs), StatusCode::SUCCESS) << ok->Message();
  MemoryDesc again = target.RegisterMemory(tb.ptr(), 4096, -1, MemoryLocationType::CPU);
  EXPECT_NE(again.token, real.token);
  EXPECT_NE(again.token, MemoryToken{});
  SetLogLevel("warning");
}

TEST(EngineIncarnations, DescriptorsOfARestartedEngineFailWithEngineRestarted) {
  SetLogLevel("critical");
  Buffer tb(1 << 16, 6), pb(1 << 16, 7);
  Engine peer("peer", Config("s"));
  peer.CreateBackend(BackendType::TCP, {});
  MemoryDesc local = peer.RegisterMemory(pb.ptr(), 1 << 16, -1, MemoryLocationType::CPU);
  EngineDesc old_engine;
  MemoryDesc old_mem;
  int port = 0;
  {
    Engine first("restarting", Config("s"));
    first.CreateBackend(BackendType::TCP, {});
    old_engine = first.Desc();
    port = old_engine.port;
    old_mem = first.RegisterMemory(tb.ptr(), 1 << 16, -1, MemoryLocationType::CPU);
    peer.RegisterRemoteEngine(old_engine);
    auto s = peer.Write(local, 0, old_mem, 0, 4096, 1);
    ASSERT_EQ(s->WaitFor(kWaitMs), StatusCode::SUCCESS) << s->Message();
  }
  FillRandom(tb.bytes, 8);
  const std::vector<uint8_t> orig = tb.bytes;
  Engine second("restarting", Config("s", port));  // same key, same port, same buffer address
  second.CreateBackend(BackendType::TCP, {});
  MemoryDesc new_mem = second.RegisterMemory(tb.ptr(), 1 << 16, -1, MemoryLocationType::CPU);
  ASSERT_EQ(new_mem.id, old_mem.id);  // ids restart: only the incarnation tells them apart
  ASSERT_NE(second.Desc().incarnation, old_engine.incarnation);

  // The stale engine descriptor: connections to the new process are refused.
  auto w = peer.Write(local, 0, old_mem, 0, 4096, 2);
  EXPECT_EQ(w->WaitFor(kWaitMs), StatusCode::ERR_NOT_FOUND);
  EXPECT_TRUE(Contains(w->Message(), "engine restarted")) << w->Message();
  // The new engine descriptor but a stale memory descriptor: refused by the target.
  peer.RegisterRemoteEngine(second.Desc());
  w = peer.Write(local, 0, old_mem, 0, 4096, 3);
  EXPECT_EQ(w->WaitFor(kWaitMs), StatusCode::ERR_NOT_FOUND);
  EXPECT_TRUE(Contains(w->Message(), "engine restarted")) << w->Message();
  auto e = CatchError([&] { peer.ValidateRemoteMemory(old_mem); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_TRUE(Contains(e->what(), "engine restarted")) << e->what();
  EXPECT_EQ(tb.bytes, orig) << "a stale descriptor touched the new process's memory";
  // Fresh descriptors work.
  w = peer.Write(local, 0, new_mem, 0, 4096, 4);
  ASSERT_EQ(w->WaitFor(kWaitMs), StatusCode::SUCCESS) << w->Message();
  SetLogLevel("warning");
}

TEST(EngineSecrets, PublishedDescriptorsNeverContainTheSecret) {
  const std::string secret = "a-very-distinctive-secret-string";
  Engine e("keeper", Config(secret));
  Buffer b(4096, 9);
  MemoryDesc m = e.RegisterMemory(b.ptr(), 4096, -1, MemoryLocationType::CPU);
  for (const auto& bytes : {e.Desc().Pack(), m.Pack()}) {
    std::string s(bytes.begin(), bytes.end());
    EXPECT_EQ(s.find(secret), std::string::npos);
    EXPECT_EQ(s.find("distinctive"), std::string::npos);
  }
}

TEST(EngineSecrets, VersionOneDescriptorsAreRefusedClearly) {
  Engine e("v1", Config(""));
  auto bytes = e.Desc().Pack();
  bytes[4] = 1;
  bytes[5] = 0;
  auto err = CatchError([&] { EngineDesc::Unpack(bytes.data(), bytes.size()); });
  ASSERT_TRUE(err);
  EXPECT_TRUE(Contains(err->what(), "format version 1 is not supported")) << err->what();
  EXPECT_TRUE(Contains(err->what(), "memory token")) << err->what();
}

}  // namespace
}  // namespace mori_torch
