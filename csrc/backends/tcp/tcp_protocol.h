// Wire format of TCP data connections (after the control-plane Hello).
// Initiator -> target: RequestHeader, num_segs x WireSegment, zero padding to
// a multiple of kWireAlign, then for WRITE the payload and zero padding to a
// multiple of kWireAlign. Target -> initiator: ResponseHeader, message, zero
// padding to kWireAlign, then for a successful READ the payload and zero
// padding to kWireAlign. NOTICE requests (a read's data arrived) get no
// response. Requests on one connection are answered in order.
//
// Fence: an initiator that gives up on a connection (a timeout, an error,
// shutdown) resets it (RST) before it reports its requests failed, and the
// target checks that the connection is intact before each receive into
// registered memory: a write reported failed never lands later, even from
// bytes that sat in the target's socket buffer while it was stopped.
//
// Why the padding: every message is a multiple of 64 bytes, so a payload
// starts 64-byte aligned in the socket buffer's pages, like the registered
// memory it is copied to or from. Unaligned, the receiver's kernel copy
// (copy_to_iter) runs up to 4x slower per byte on x86 (measured on AMD EPYC:
// a 4096 x 16 KiB write batch at 0.6 of a plain socket stream).
#pragma once

#include <cstdint>

namespace mori_torch {
namespace tcp {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "wire structs are little-endian");

constexpr uint32_t kRequestMagic = 0x5152544d;   // "MTRQ"
constexpr uint32_t kResponseMagic = 0x5352544d;  // "MTRS"
constexpr uint32_t kMaxSegmentsPerRequest = 1u << 22;
constexpr uint32_t kMaxMessageBytes = 4096;

enum class Op : uint8_t { Write = 1, Read = 2, Notice = 3 };
constexpr uint8_t kFlagNotify = 1;

struct RequestHeader {
  uint32_t magic;
  uint8_t op;
  uint8_t flags;
  uint16_t attempt;  // 0 first; > 0 a retry of the transfer (core/retry_driver.h)
  uint64_t req_id;
  uint64_t uid;
  uint64_t mem_id;       // target memory id
  uint64_t total_bytes;  // sum of segment sizes
  uint32_t num_segs;
  uint32_t parts_total;  // requests that make up transfer `uid`
  uint64_t incarnation;  // of the target engine, from the memory's descriptor
  uint8_t token[16];     // the target memory's token (MemoryDesc::token)
  uint64_t part_index;   // which of the parts_total requests: notices count each once
};
static_assert(sizeof(RequestHeader) == 80, "RequestHeader layout");

constexpr uint64_t kWireAlign = 64;
// Zero bytes that bring `n` up to a multiple of kWireAlign.
inline uint64_t WirePad(uint64_t n) { return (kWireAlign - n % kWireAlign) % kWireAlign; }
inline uint64_t WireRound(uint64_t n) { return n + WirePad(n); }
// kWireAlign zero bytes, the source of every padding.
inline const char* WireZeros() {
  alignas(64) static const char zeros[kWireAlign] = {};
  return zeros;
}

struct WireSegment {
  uint64_t offset;  // into the target memory
  uint64_t size;
};

struct ResponseHeader {
  uint32_t magic;
  uint16_t code;  // StatusCode
  uint16_t msg_len;
  uint64_t req_id;
  uint64_t payload_bytes;
};
static_assert(sizeof(ResponseHeader) == 24, "ResponseHeader layout");
static_assert(sizeof(ResponseHeader) <= kWireAlign, "a response's first kWireAlign bytes hold its header");

}  // namespace tcp
}  // namespace mori_torch
