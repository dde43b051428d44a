// Control-plane frame headers and descriptor parsing under valid, invalid
// and random input: only reasons or mori_torch::Error come out, never a
// crash, and whatever is accepted is exactly what a valid encoder produces.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <random>

#include "core/byte_io.h"
#include "core/descriptors.h"
#include "core/frame.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::Contains;
using testing_util::MsSince;

std::vector<uint8_t> Header(uint32_t magic, uint16_t version, uint16_t type, uint32_t length) {
  ByteWriter w;
  w.Put<uint32_t>(magic);
  w.Put<uint16_t>(version);
  w.Put<uint16_t>(type);
  w.Put<uint32_t>(length);
  return std::move(w.bytes());
}

// Independent statement of the header rules, used as the fuzz oracle.
bool HeaderValid(const std::vector<uint8_t>& b) {
  auto u32 = [&](size_t at) {
    return static_cast<uint32_t>(b[at]) | static_cast<uint32_t>(b[at + 1]) << 8 |
           static_cast<uint32_t>(b[at + 2]) << 16 | static_cast<uint32_t>(b[at + 3]) << 24;
  };
  auto u16 = [&](size_t at) { return static_cast<uint16_t>(b[at] | b[at + 1] << 8); };
  return u32(0) == 0x49524f4d && u16(4) == kProtocolVersion && u16(6) >= 1 && u16(6) <= 14 && u32(8) <= (1u << 20);
}

TEST(FrameHeaderTest, AcceptsEveryKnownType) {
  for (uint16_t t = 1; t <= static_cast<uint16_t>(FrameType::kMaxKnown); ++t) {
    std::vector<uint8_t> payload(t * 3, static_cast<uint8_t>(t));
    auto bytes = EncodeFrame(static_cast<FrameType>(t), payload);
    ASSERT_EQ(bytes.size(), kFrameHeaderBytes + payload.size());
    FrameHeader h;
    EXPECT_EQ(ParseFrameHeader(bytes.data(), &h), "") << "type " << t;
    EXPECT_EQ(h.magic, kFrameMagic);
    EXPECT_EQ(h.version, kProtocolVersion);
    EXPECT_EQ(h.type, t);
    EXPECT_EQ(h.length, payload.size());
    EXPECT_TRUE(std::equal(payload.begin(), payload.end(), bytes.begin() + kFrameHeaderBytes));
  }
  // "MORI" on the wire, little-endian fields.
  auto bytes = EncodeFrame(FrameType::Ping, {});
  EXPECT_EQ(std::string(bytes.begin(), bytes.begin() + 4), "MORI");
  // The largest allowed payload is accepted.
  auto max = Header(kFrameMagic, kProtocolVersion, 1, kMaxFramePayload);
  FrameHeader h;
  EXPECT_EQ(ParseFrameHeader(max.data(), &h), "");
  EXPECT_EQ(h.length, kMaxFramePayload);
}

TEST(FrameHeaderTest, RejectsBadFields) {
  struct Case {
    std::vector<uint8_t> bytes;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {Header(0x4d4f5249, 1, 1, 0), "bad frame magic 0x4d4f5249"},  // byte-swapped magic
      {Header(0, 1, 1, 0), "bad frame magic"},
      {Header(kFrameMagic, 0, 1, 0), "unsupported protocol version 0"},
      {Header(kFrameMagic, 1, 1, 0), "unsupported protocol version 1"},  // release 1 (unpadded TCP wire)
      {Header(kFrameMagic, 0xffff, 1, 0), "unsupported protocol version 65535"},
      {Header(kFrameMagic, kProtocolVersion, 0, 0), "unknown frame type 0"},
      {Header(kFrameMagic, kProtocolVersion, 15, 0), "unknown frame type 15"},
      {Header(kFrameMagic, kProtocolVersion, 0xffff, 0), "unknown frame type 65535"},
      {Header(kFrameMagic, kProtocolVersion, 1, kMaxFramePayload + 1), "exceeds the limit"},
      {Header(kFrameMagic, kProtocolVersion, 4, 0x80000000u), "2147483648 bytes exceeds"},
      {Header(kFrameMagic, kProtocolVersion, 4, 0xffffffffu), "exceeds the limit"},
  };
  for (const auto& c : cases) {
    FrameHeader h;
    std::string why = ParseFrameHeader(c.bytes.data(), &h);
    EXPECT_FALSE(why.empty()) << c.needle;
    EXPECT_TRUE(Contains(why, c.needle)) << "reason '" << why << "' lacks '" << c.needle << "'";
    EXPECT_FALSE(HeaderValid(c.bytes));
  }
}

TEST(FrameFuzzTest, RandomHeadersNeverCrashAndMatchTheRules) {
  std::mt19937_64 rng(0x5eed1234);
  std::vector<uint8_t> b(kFrameHeaderBytes);
  size_t accepted = 0;
  for (int iter = 0; iter < 200000; ++iter) {
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (iter % 2 == 1) {  // half the time keep a valid prefix so later checks are reached
      const size_t keep = rng() % (kFrameHeaderBytes + 1);
      auto valid = Header(kFrameMagic, kProtocolVersion, 1 + rng() % 7, static_cast<uint32_t>(rng() % (2u << 20)));
      std::copy(valid.begin(), valid.begin() + keep, b.begin());
    }
    FrameHeader h;
    const std::string why = ParseFrameHeader(b.data(), &h);
    ASSERT_EQ(why.empty(), HeaderValid(b)) << "iteration " << iter << ": '" << why << "'";
    if (why.empty()) ++accepted;
  }
  EXPECT_GT(accepted, 1000u);  // the valid-prefix half does reach acceptance
}

TEST(FrameFuzzTest, MutatedValidHeaders) {
  std::mt19937_64 rng(77);
  for (int iter = 0; iter < 100000; ++iter) {
    auto b = Header(kFrameMagic, kProtocolVersion, 1 + rng() % 7, static_cast<uint32_t>(rng() % (1u << 20)));
    const int flips = 1 + rng() % 3;
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    FrameHeader h;
    ASSERT_EQ(ParseFrameHeader(b.data(), &h).empty(), HeaderValid(b)) << "iteration " << iter;
  }
}

// Unpack must either return a descriptor whose encoding is exactly the input
// (the format has no slack) or throw mori_torch::Error(ERR_INVALID_ARGS).
template <typename Desc>
void FuzzOne(const std::vector<uint8_t>& in, size_t* accepted) {
  try {
    Desc d = Desc::Unpack(in.data(), in.size());
    ++*accepted;
    ASSERT_EQ(d.Pack(), in);
  } catch (const Error& e) {
    ASSERT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS) << e.what();
    ASSERT_NE(std::string(e.what()), "");
  }
  // Any other exception type escapes and fails the test.
}

std::vector<uint8_t> Mutate(std::vector<uint8_t> b, std::mt19937_64& rng) {
  switch (rng() % 6) {
    case 0:  // flip bits
      for (int i = 0, n = 1 + rng() % 4; i < n && !b.empty(); ++i) b[rng() % b.size()] ^= 1u << (rng() % 8);
      break;
    case 1:  // truncate
      b.resize(rng() % (b.size() + 1));
      break;
    case 2:  // extend with junk
      for (int i = 0, n = 1 + rng() % 16; i < n; ++i) b.push_back(static_cast<uint8_t>(rng()));
      break;
    case 3:  // overwrite a 32-bit word (length fields) with something large or small
      if (b.size() >= 4) {
        const size_t at = rng() % (b.size() - 3);
        const uint32_t v = (rng() % 2) ? static_cast<uint32_t>(rng()) : static_cast<uint32_t>(rng() % 80);
        for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
      }
      break;
    case 4:  // delete a run
      if (!b.empty()) {
        const size_t at = rng() % b.size();
        b.erase(b.begin() + at, b.begin() + std::min(b.size(), at + 1 + rng() % 8));
      }
      break;
    default:  // insert a run
    {
      const size_t at = rng() % (b.size() + 1);
      std::vector<uint8_t> ins(1 + rng() % 8);
      for (auto& x : ins) x = static_cast<uint8_t>(rng());
      b.insert(b.begin() + at, ins.begin(), ins.end());
    }
  }
  return b;
}

TEST(DescriptorFuzzTest, RandomBytes) {
  std::mt19937_64 rng(0xdecafbad);
  size_t accepted = 0;
  for (int iter = 0; iter < 200000; ++iter) {
    std::vector<uint8_t> b(rng() % 200);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    // Give a quarter of the inputs a valid header so the field parsers run.
    if (b.size() >= 6 && iter % 4 == 0) {
      const auto hdr = (iter % 8 == 0) ? EngineDesc{}.Pack() : MemoryDesc{}.Pack();
      std::copy(hdr.begin(), hdr.begin() + 6, b.begin());
    }
    FuzzOne<EngineDesc>(b, &accepted);
    FuzzOne<MemoryDesc>(b, &accepted);
    if (HasFatalFailure()) return;
  }
}

TEST(DescriptorFuzzTest, MutatedValidDescriptors) {
  std::mt19937_64 rng(4242);
  EngineDesc ed;
  ed.key = "engine-key";
  ed.node_id = "node";
  ed.hostname = "host";
  ed.host = "127.0.0.1";
  ed.port = 1234;
  ed.pid = 99;
  MemoryDesc md;
  md.engine_key = "engine-key";
  md.id = 5;
  md.device_bus_id = "0000:01:00.0";
  md.data = 1 << 20;
  md.size = 1 << 16;
  md.loc = MemoryLocationType::CPU;
  md.ipc_offset = 64;
  const auto eb = ed.Pack();
  const auto mb = md.Pack();
  size_t accepted_e = 0, accepted_m = 0;
  for (int iter = 0; iter < 100000; ++iter) {
    auto e = Mutate(eb, rng);
    if (rng() % 4 == 0) e = Mutate(e, rng);
    FuzzOne<EngineDesc>(e, &accepted_e);
    auto m = Mutate(mb, rng);
    if (rng() % 4 == 0) m = Mutate(m, rng);
    FuzzOne<MemoryDesc>(m, &accepted_m);
    if (HasFatalFailure()) return;
  }
  // Bit flips in string bodies and numeric fields keep some inputs valid.
  EXPECT_GT(accepted_e, 100u);
  EXPECT_GT(accepted_m, 100u);
}

TEST(ByteReaderTest, NeverReadsPastItsBuffer) {
  std::mt19937_64 rng(9);
  for (int iter = 0; iter < 50000; ++iter) {
    std::vector<uint8_t> b(rng() % 24);
    for (auto& x : b) x = static_cast<uint8_t>(rng() % 16);  // small lengths are likely
    ByteReader r(b.data(), b.size(), "fuzz");
    try {
      while (true) {
        switch (rng() % 5) {
          case 0:
            r.Get<uint8_t>("u8");
            break;
          case 1:
            r.Get<uint32_t>("u32");
            break;
          case 2:
            r.Get<uint64_t>("u64");
            break;
          case 3:
            r.GetString("s", rng() % 20);
            break;
          default: {
            uint8_t out[8];
            r.GetBytes(out, rng() % 9, "bytes");
          }
        }
        ASSERT_LE(r.remaining(), b.size());
      }
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
      ASSERT_TRUE(Contains(e.what(), "fuzz"));
    }
  }
}

// --- ReadFrame / WriteFrame over a real socket pair ------------------------

class SocketPair : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds_), 0); }
  void TearDown() override {
    close(fds_[0]);
    close(fds_[1]);
  }
  void Send(const std::vector<uint8_t>& b) { ASSERT_EQ(write(fds_[0], b.data(), b.size()), ssize_t(b.size())); }
  int fds_[2] = {-1, -1};
};

TEST_F(SocketPair, FrameRoundTrip) {
  std::vector<uint8_t> payload(100000);
  testing_util::FillRandom(payload, 3);
  std::thread writer([&] { EXPECT_TRUE(WriteFrame(fds_[0], FrameType::MemLookupReply, payload, 2000).ok); });
  Frame f;
  IoResult r = ReadFrame(fds_[1], &f, 2000, 2000);
  writer.join();
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(f.type, FrameType::MemLookupReply);
  EXPECT_EQ(f.payload, payload);
}

TEST_F(SocketPair, InvalidHeaderFailsWithTheReason) {
  Send(Header(kFrameMagic, kProtocolVersion, 1, 0x80000000u));
  Frame f;
  IoResult r = ReadFrame(fds_[1], &f, 1000, 1000);
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.timed_out);
  EXPECT_TRUE(Contains(r.error, "exceeds the limit")) << r.error;
  EXPECT_TRUE(f.payload.empty());  // nothing was allocated for the bogus length
}

TEST_F(SocketPair, StalledFrameTimesOut) {
  auto bytes = EncodeFrame(FrameType::Ping, std::vector<uint8_t>(100, 1));
  bytes.resize(kFrameHeaderBytes + 40);  // cut mid-payload, then silence
  Send(bytes);
  Frame f;
  const auto t0 = std::chrono::steady_clock::now();
  IoResult r = ReadFrame(fds_[1], &f, 1000, 200);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.timed_out);
  EXPECT_TRUE(Contains(r.error, "stalled mid-frame")) << r.error;
  EXPECT_GE(MsSince(t0), 150);
  EXPECT_LT(MsSince(t0), 2000);
}

TEST_F(SocketPair, IdleTimeoutAndClosedPeer) {
  Frame f;
  IoResult r = ReadFrame(fds_[1], &f, 50, 1000);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(r.timed_out);
  Send({1, 2, 3});
  shutdown(fds_[0], SHUT_WR);
  r = ReadFrame(fds_[1], &f, 1000, 1000);
  EXPECT_FALSE(r.ok);
  EXPECT_FALSE(r.timed_out);
}

}  // namespace
}  // namespace mori_torch
