// Control-plane framing: every frame is a 12-byte header (magic, protocol
// version, type, payload length) and a bounded payload. Anything else is a
// protocol error that closes that one connection.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/net.h"

namespace mori_torch {

constexpr uint32_t kFrameMagic = 0x49524f4d;  // "MORI" little-endian
// 2: TCP data messages padded to 64 bytes; 3: memory watch/revoke;
// 4: peer authentication, memory tokens and engine incarnations
constexpr uint16_t kProtocolVersion = 4;
constexpr uint32_t kMaxFramePayload = 1u << 20;
constexpr size_t kFrameHeaderBytes = 12;

enum class FrameType : uint16_t {
  Hello = 1,           // u8 kind, u8 backend, u32 n + n bytes EngineDesc, HelloAuth (peer_auth.h)
  HelloAck = 2,        // bytes EngineDesc of the server
  Error = 3,           // u32 status code, string message
  MemLookup = 4,       // u64 memory id, u64 owner incarnation, 16-byte token
  MemLookupReply = 5,  // bytes MemoryDesc
  Ping = 6,
  Pong = 7,
  // On a data connection, after the Hello: a backend's own request/reply
  // (payload private to the backend named in the Hello).
  BackendRequest = 8,
  BackendReply = 9,
  // XGMI's memory ownership (backends/xgmi/xgmi_ownership.h owns and handles
  // them; the engine only hands them over): an importer watches a memory
  // before it maps it, and the owner revokes it from every watcher when it
  // is deregistered (acknowledged only after the importer stopped using it).
  MemWatch = 10,      // as MemLookup -> MemLookupReply; the caller becomes a watcher
  MemRevoke = 11,     // u32 count, count x u64 memory id (sent by the owner)
  MemRevokeAck = 12,  // empty
  // Peer authentication (peer_auth.h), between Hello and HelloAck when the
  // server has a secret.
  AuthChallenge = 13,
  AuthProof = 14,
  kMaxKnown = 14,
};

enum class ConnectionKind : uint8_t { Control = 1, Data = 2 };

struct Frame {
  FrameType type = FrameType::Ping;
  std::vector<uint8_t> payload;
};

struct FrameHeader {
  uint32_t magic = 0;
  uint16_t version = 0;
  uint16_t type = 0;
  uint32_t length = 0;
};

// Decodes 12 header bytes; returns "" if valid, else the reason.
std::string ParseFrameHeader(const uint8_t* bytes, FrameHeader* out);
std::vector<uint8_t> EncodeFrame(FrameType type, const std::vector<uint8_t>& payload);

// Reassembles frames from a byte stream. The payload buffer grows with the
// bytes that arrived (never to a claimed length ahead of them), and a read
// never takes bytes past the end of the current frame, so whatever follows
// the frame stays in the socket for its next reader.
class FrameReader {
 public:
  enum class Step { kNeedMore, kFrame, kClosed, kError };
  // Bytes the current frame still needs, at most kChunk at a time.
  static constexpr size_t kChunk = 64 << 10;
  size_t Wanted() const;
  // Consumes up to n bytes of the current frame; returns how many it took.
  // kFrame when a frame is complete (then Take() it), kError with error().
  Step Feed(const uint8_t* p, size_t n, size_t* consumed);
  // Reads what a non-blocking fd has (never past the current frame):
  // kNeedMore when it would block.
  Step ReadSome(int fd);
  Frame Take();
  const std::string& error() const { return error_; }
  // True once any byte of the current frame arrived.
  bool Started() const { return have_ > 0; }
  bool InPayload() const { return have_ >= kFrameHeaderBytes; }

 private:
  uint8_t hdr_bytes_[kFrameHeaderBytes];
  FrameHeader hdr_{};
  size_t have_ = 0;  // bytes of the current frame so far (header included)
  std::vector<uint8_t> payload_;
  std::string error_;
  bool done_ = false;
};

// Waits up to idle_timeout_ms (-1: forever) for a frame to start, then reads
// it whole within frame_timeout_ms. Fails with the reason on a stall, a
// closed peer or an invalid header.
IoResult ReadFrame(int fd, Frame* out, int idle_timeout_ms, int frame_timeout_ms);
// Waits for a frame and reads it whole, all before `deadline`.
IoResult ReadFrameBy(int fd, Frame* out, Deadline deadline);
IoResult WriteFrame(int fd, FrameType type, const std::vector<uint8_t>& payload, int timeout_ms);

}  // namespace mori_torch
