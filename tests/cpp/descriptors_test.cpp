// EngineDesc / MemoryDesc: pack/unpack round trips, and every kind of
// malformed input is rejected with ERR_INVALID_ARGS and a message that says
// what is wrong.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "core/descriptors.h"
#include "test_util.h"

namespace mori_torch {
namespace {

using testing_util::CatchError;
using testing_util::Contains;
using testing_util::ScopedEnv;

EngineDesc SampleEngine() {
  EngineDesc d;
  d.key = std::string("prefill-0\0\xff-key", 15);  // embedded NUL and high bytes survive
  d.node_id = "2b8e0c7a-31f1-4a4e-9d0b-0e6f8b1c3d57";
  d.hostname = "node-17.cluster";
  d.host = "10.1.2.3";
  d.port = 65535;
  d.pid = -42;
  d.incarnation = 0x8877665544332211ull;
  return d;
}

MemoryDesc SampleMemory() {
  MemoryDesc d;
  d.engine_key = "decode-3";
  d.id = 0x0123456789abcdefULL;
  d.device_id = 7;
  d.device_bus_id = "0000:c1:00.0";
  d.data = 0x7f0000001000ULL;
  d.size = 0x40000000ULL;
  d.loc = MemoryLocationType::GPU;
  for (size_t i = 0; i < d.ipc_handle.size(); ++i) d.ipc_handle[i] = static_cast<uint8_t>(0xA0 ^ (i * 7));
  d.ipc_offset = (1ULL << 40) + 123;
  d.numa_node = 3;
  d.incarnation = 0xfedcba9876543210ull;
  for (size_t i = 0; i < d.token.size(); ++i) d.token[i] = static_cast<uint8_t>(0xa0 + i);
  return d;
}

// Offsets inside a packed MemoryDesc, computed from the documented layout:
// u32 magic, u16 version, string engine_key, u64 id, i32 device_id, string
// bus id, u64 data, u64 size, i32 loc, 64 B ipc handle, u64 ipc_offset, i32 numa,
// u64 incarnation, 16 B token.
size_t MemoryLocOffset(const MemoryDesc& d) {
  return 6 + 4 + d.engine_key.size() + 8 + 4 + 4 + d.device_bus_id.size() + 8 + 8;
}

void PutU32(std::vector<uint8_t>& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

TEST(EngineDescTest, RoundTripKeepsEveryField) {
  const EngineDesc d = SampleEngine();
  const auto bytes = d.Pack();
  const EngineDesc u = EngineDesc::Unpack(bytes.data(), bytes.size());
  EXPECT_EQ(u.key, d.key);
  EXPECT_EQ(u.key.size(), 15u);
  EXPECT_EQ(u.node_id, d.node_id);
  EXPECT_EQ(u.hostname, d.hostname);
  EXPECT_EQ(u.host, d.host);
  EXPECT_EQ(u.port, 65535);
  EXPECT_EQ(u.pid, -42);
  EXPECT_TRUE(u == d);
  EXPECT_EQ(u.Pack(), bytes);  // canonical encoding
}

TEST(EngineDescTest, RoundTripEmptyStrings) {
  EngineDesc d;  // all strings empty, port 0
  const auto bytes = d.Pack();
  EXPECT_EQ(EngineDesc::Unpack(bytes.data(), bytes.size()), d);
}

TEST(EngineDescTest, EqualityComparesEveryField) {
  const EngineDesc base = SampleEngine();
  std::vector<std::function<void(EngineDesc&)>> changes = {
      [](EngineDesc& d) { d.key += "x"; },      [](EngineDesc& d) { d.node_id += "x"; },
      [](EngineDesc& d) { d.hostname += "x"; }, [](EngineDesc& d) { d.host += "x"; },
      [](EngineDesc& d) { d.port -= 1; },       [](EngineDesc& d) { d.pid += 1; },
  };
  for (size_t i = 0; i < changes.size(); ++i) {
    EngineDesc c = base;
    changes[i](c);
    EXPECT_NE(c, base) << "change " << i;
    const auto bytes = c.Pack();
    EXPECT_EQ(EngineDesc::Unpack(bytes.data(), bytes.size()), c) << "change " << i;
  }
}

TEST(MemoryDescTest, RoundTripKeepsEveryField) {
  const MemoryDesc d = SampleMemory();
  const auto bytes = d.Pack();
  const MemoryDesc u = MemoryDesc::Unpack(bytes.data(), bytes.size());
  EXPECT_EQ(u.engine_key, "decode-3");
  EXPECT_EQ(u.id, 0x0123456789abcdefULL);
  EXPECT_EQ(u.device_id, 7);
  EXPECT_EQ(u.device_bus_id, "0000:c1:00.0");
  EXPECT_EQ(u.data, 0x7f0000001000ULL);
  EXPECT_EQ(u.size, 0x40000000ULL);
  EXPECT_EQ(u.loc, MemoryLocationType::GPU);
  EXPECT_EQ(0, std::memcmp(u.ipc_handle.data(), d.ipc_handle.data(), kIpcHandleBytes));
  EXPECT_EQ(u.ipc_handle[0], 0xA0);
  EXPECT_EQ(u.ipc_handle[63], static_cast<uint8_t>(0xA0 ^ (63 * 7)));
  EXPECT_EQ(u.ipc_offset, (1ULL << 40) + 123);
  EXPECT_EQ(u.numa_node, 3);
  EXPECT_TRUE(u == d);
  EXPECT_EQ(u.Pack(), bytes);
}

TEST(MemoryDescTest, RoundTripCpuDefaults) {
  MemoryDesc d;
  d.engine_key = "e";
  d.loc = MemoryLocationType::CPU;
  d.data = 4096;
  d.size = 1;
  const auto bytes = d.Pack();
  const MemoryDesc u = MemoryDesc::Unpack(bytes.data(), bytes.size());
  EXPECT_EQ(u, d);
  EXPECT_EQ(u.device_id, -1);
  EXPECT_EQ(u.numa_node, -1);
  EXPECT_EQ(u.device_bus_id, "");
  for (uint8_t b : u.ipc_handle) EXPECT_EQ(b, 0);
}

TEST(MemoryDescTest, EqualityComparesEveryField) {
  const MemoryDesc base = SampleMemory();
  std::vector<std::function<void(MemoryDesc&)>> changes = {
      [](MemoryDesc& d) { d.engine_key += "x"; },
      [](MemoryDesc& d) { d.id += 1; },
      [](MemoryDesc& d) { d.device_id += 1; },
      [](MemoryDesc& d) { d.device_bus_id = "0000:c2:00.0"; },
      [](MemoryDesc& d) { d.data += 1; },
      [](MemoryDesc& d) { d.size -= 1; },
      [](MemoryDesc& d) { d.loc = MemoryLocationType::CPU; },
      [](MemoryDesc& d) { d.ipc_handle[63] ^= 1; },
      [](MemoryDesc& d) { d.ipc_offset += 1; },
      [](MemoryDesc& d) { d.numa_node = 0; },
  };
  for (size_t i = 0; i < changes.size(); ++i) {
    MemoryDesc c = base;
    changes[i](c);
    EXPECT_NE(c, base) << "change " << i;
    const auto bytes = c.Pack();
    EXPECT_EQ(MemoryDesc::Unpack(bytes.data(), bytes.size()), c) << "change " << i;
  }
}

// --- malformed input -------------------------------------------------------

template <typename Desc>
void ExpectRejected(const std::vector<uint8_t>& bytes, size_t len, const std::string& needle, const std::string& ctx) {
  auto e = CatchError([&] { Desc::Unpack(bytes.data(), len); });
  ASSERT_TRUE(e.has_value()) << ctx;
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS) << ctx;
  EXPECT_TRUE(Contains(e->what(), needle)) << ctx << ": message '" << e->what() << "' lacks '" << needle << "'";
}

TEST(EngineDescTest, RejectsEveryTruncation) {
  const auto bytes = SampleEngine().Pack();
  ASSERT_GT(bytes.size(), 20u);
  for (size_t len = 0; len < bytes.size(); ++len) {
    // A fresh copy of exactly `len` bytes, so that reading past it is caught
    // by the sanitizer-free build too (heap end), not just by the checks.
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + len);
    auto e = CatchError([&] { EngineDesc::Unpack(cut.data(), cut.size()); });
    ASSERT_TRUE(e.has_value()) << "length " << len;
    EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS) << "length " << len;
    EXPECT_TRUE(Contains(e->what(), "EngineDesc.unpack")) << e->what();
    EXPECT_TRUE(Contains(e->what(), "truncated")) << "length " << len << ": " << e->what();
  }
  EXPECT_NO_THROW(EngineDesc::Unpack(bytes.data(), bytes.size()));
}

TEST(MemoryDescTest, RejectsEveryTruncation) {
  const auto bytes = SampleMemory().Pack();
  ASSERT_GT(bytes.size(), 100u);
  for (size_t len = 0; len < bytes.size(); ++len) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + len);
    auto e = CatchError([&] { MemoryDesc::Unpack(cut.data(), cut.size()); });
    ASSERT_TRUE(e.has_value()) << "length " << len;
    EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS) << "length " << len;
    EXPECT_TRUE(Contains(e->what(), "MemoryDesc.unpack")) << e->what();
    EXPECT_TRUE(Contains(e->what(), "truncated")) << "length " << len << ": " << e->what();
  }
  EXPECT_NO_THROW(MemoryDesc::Unpack(bytes.data(), bytes.size()));
}

TEST(DescriptorTest, TruncationMessageNamesTheField) {
  const auto eb = SampleEngine().Pack();
  ExpectRejected<EngineDesc>(eb, 2, "'magic'", "engine magic");
  ExpectRejected<EngineDesc>(eb, 5, "'version'", "engine version");
  ExpectRejected<EngineDesc>(eb, eb.size() - 8 - 1, "'pid'", "engine pid");
  ExpectRejected<EngineDesc>(eb, eb.size() - 1, "'incarnation'", "engine incarnation");
  const auto mb = SampleMemory().Pack();
  ExpectRejected<MemoryDesc>(mb, mb.size() - 1, "'token'", "memory token");
  ExpectRejected<MemoryDesc>(mb, mb.size() - 16 - 1, "'incarnation'", "memory incarnation");
  ExpectRejected<MemoryDesc>(mb, mb.size() - 16 - 8 - 1, "'numa_node'", "memory numa");
  ExpectRejected<MemoryDesc>(mb, mb.size() - 16 - 8 - 4 - 8 - 1, "'ipc_handle'", "memory ipc handle");
}

TEST(DescriptorTest, RejectsTrailingBytes) {
  for (size_t extra : {1, 7, 1000}) {
    auto eb = SampleEngine().Pack();
    eb.resize(eb.size() + extra, 0);
    ExpectRejected<EngineDesc>(eb, eb.size(), "trailing", "engine +" + std::to_string(extra));
    ExpectRejected<EngineDesc>(eb, eb.size(), std::to_string(extra), "engine +" + std::to_string(extra));
    auto mb = SampleMemory().Pack();
    mb.resize(mb.size() + extra, 0xff);
    ExpectRejected<MemoryDesc>(mb, mb.size(), "trailing", "memory +" + std::to_string(extra));
  }
}

TEST(DescriptorTest, RejectsWrongMagic) {
  for (size_t byte = 0; byte < 4; ++byte) {
    auto eb = SampleEngine().Pack();
    eb[byte] ^= 0x20;
    ExpectRejected<EngineDesc>(eb, eb.size(), "bad magic", "engine byte " + std::to_string(byte));
    auto mb = SampleMemory().Pack();
    mb[byte] ^= 0x01;
    ExpectRejected<MemoryDesc>(mb, mb.size(), "bad magic", "memory byte " + std::to_string(byte));
  }
  // One kind of descriptor is never accepted as the other.
  const auto eb = SampleEngine().Pack();
  const auto mb = SampleMemory().Pack();
  ExpectRejected<MemoryDesc>(eb, eb.size(), "bad magic", "engine bytes as memory");
  ExpectRejected<EngineDesc>(mb, mb.size(), "bad magic", "memory bytes as engine");
}

TEST(DescriptorTest, RejectsWrongVersion) {
  for (uint16_t v : {uint16_t{0}, uint16_t{1}, uint16_t{3}, uint16_t{0x0100}, uint16_t{0xffff}}) {
    const std::string ctx = "version " + std::to_string(v);
    auto eb = SampleEngine().Pack();
    eb[4] = static_cast<uint8_t>(v);
    eb[5] = static_cast<uint8_t>(v >> 8);
    ExpectRejected<EngineDesc>(eb, eb.size(), "format version " + std::to_string(v), ctx);
    ExpectRejected<EngineDesc>(eb, eb.size(), "not supported", ctx);
    auto mb = SampleMemory().Pack();
    mb[4] = static_cast<uint8_t>(v);
    mb[5] = static_cast<uint8_t>(v >> 8);
    ExpectRejected<MemoryDesc>(mb, mb.size(), "format version " + std::to_string(v), ctx);
  }
  // The current version (2: incarnations and tokens), little-endian, right after the magic.
  const auto eb = SampleEngine().Pack();
  EXPECT_EQ(eb[4], kDescriptorFormatVersion & 0xff);
  EXPECT_EQ(eb[5], kDescriptorFormatVersion >> 8);
}

TEST(DescriptorTest, RejectsStringLengthPastTheEnd) {
  const EngineDesc ed = SampleEngine();
  auto eb = ed.Pack();
  // The key's u32 length sits right after the 6-byte header.
  PutU32(eb, 6, static_cast<uint32_t>(eb.size()));  // plausible but past the end
  ExpectRejected<EngineDesc>(eb, eb.size(), "truncated while reading 'key'", "key length past end");
  PutU32(eb, 6, 0xffffffffu);  // absurd: caught before any allocation
  ExpectRejected<EngineDesc>(eb, eb.size(), "exceeds limit", "key length 4 GiB");
  ExpectRejected<EngineDesc>(eb, eb.size(), "'key'", "key length 4 GiB");

  // The node id's length field follows the key.
  eb = ed.Pack();
  PutU32(eb, 6 + 4 + ed.key.size(), 4000);
  ExpectRejected<EngineDesc>(eb, eb.size(), "'node_id'", "node_id length");

  const MemoryDesc md = SampleMemory();
  auto mb = md.Pack();
  const size_t bus_len_at = 6 + 4 + md.engine_key.size() + 8 + 4;
  PutU32(mb, bus_len_at, 65);  // the bus id is limited to 64 bytes
  ExpectRejected<MemoryDesc>(mb, mb.size(), "'device_bus_id' length 65 exceeds limit 64", "bus id 65");
  PutU32(mb, bus_len_at, 64);  // within the limit but past the real string: misparses, then hits the end
  auto e = CatchError([&] { MemoryDesc::Unpack(mb.data(), mb.size()); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
  mb = md.Pack();
  PutU32(mb, 6, static_cast<uint32_t>(mb.size()));
  ExpectRejected<MemoryDesc>(mb, mb.size(), "truncated while reading 'engine_key'", "engine_key past end");
}

TEST(DescriptorTest, RejectsOutOfRangeLoc) {
  const MemoryDesc md = SampleMemory();
  const size_t at = MemoryLocOffset(md);
  {
    // Sanity: the offset points at the loc field.
    auto mb = md.Pack();
    PutU32(mb, at, 1);
    EXPECT_EQ(MemoryDesc::Unpack(mb.data(), mb.size()).loc, MemoryLocationType::CPU);
  }
  for (int32_t loc : {3, -1, 100, std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()}) {
    auto mb = md.Pack();
    PutU32(mb, at, static_cast<uint32_t>(loc));
    ExpectRejected<MemoryDesc>(mb, mb.size(), "memory location " + std::to_string(loc), "loc " + std::to_string(loc));
  }
}

TEST(DescriptorTest, RejectsOutOfRangePortAndOverflowingRange) {
  EngineDesc ed = SampleEngine();
  auto eb = ed.Pack();
  PutU32(eb, eb.size() - 16, 70000);
  ExpectRejected<EngineDesc>(eb, eb.size(), "port 70000", "port");
  PutU32(eb, eb.size() - 16, static_cast<uint32_t>(-1));
  ExpectRejected<EngineDesc>(eb, eb.size(), "port -1", "port");

  MemoryDesc md = SampleMemory();
  md.data = std::numeric_limits<uint64_t>::max() - 10;
  md.size = 100;
  const auto mb = md.Pack();
  ExpectRejected<MemoryDesc>(mb, mb.size(), "overflows", "data+size");
}

TEST(DescriptorTest, NullAndEmptyInput) {
  ExpectRejected<EngineDesc>({}, 0, "truncated", "empty engine");
  ExpectRejected<MemoryDesc>({}, 0, "truncated", "empty memory");
  auto e = CatchError([] { EngineDesc::Unpack(nullptr, 0); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code(), StatusCode::ERR_INVALID_ARGS);
}

// --- node id ---------------------------------------------------------------

TEST(DefaultNodeIdTest, HonoursEnvironmentOverride) {
  ScopedEnv io("MORI_IO_NODE_ID", nullptr);
  std::string fallback;
  {
    ScopedEnv t("MORI_TORCH_NODE_ID", nullptr);
    fallback = DefaultNodeId();
    EXPECT_FALSE(fallback.empty());
    EXPECT_EQ(DefaultNodeId(), fallback);  // stable
  }
  {
    ScopedEnv t("MORI_TORCH_NODE_ID", "node-override-42");
    EXPECT_EQ(DefaultNodeId(), "node-override-42");
  }
  {
    ScopedEnv t("MORI_TORCH_NODE_ID", "");  // empty means unset
    EXPECT_EQ(DefaultNodeId(), fallback);
  }
  {
    ScopedEnv t("MORI_TORCH_NODE_ID", nullptr);
    ScopedEnv i("MORI_IO_NODE_ID", "mori-io-node");
    EXPECT_EQ(DefaultNodeId(), "mori-io-node");
    ScopedEnv t2("MORI_TORCH_NODE_ID", "torch-wins");
    EXPECT_EQ(DefaultNodeId(), "torch-wins");
  }
  EXPECT_EQ(DefaultNodeId(), fallback);
  EXPECT_FALSE(LocalHostname().empty());
}

}  // namespace
}  // namespace mori_torch
