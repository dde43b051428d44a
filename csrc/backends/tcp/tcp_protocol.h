// Wire format of TCP data connections (after the control-plane Hello).
// Initiator -> target: RequestHeader, num_segs x WireSegment, then for WRITE
// the payload. Target -> initiator: ResponseHeader, message, then for a
// successful READ the payload. NOTICE requests (a read's data arrived) get no
// response. Requests on one connection are answered in order.
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
  uint16_t reserved;
  uint64_t req_id;
  uint64_t uid;
  uint64_t mem_id;       // target memory id
  uint64_t total_bytes;  // sum of segment sizes
  uint32_t num_segs;
  uint32_t parts_total;  // requests that make up transfer `uid`
};
static_assert(sizeof(RequestHeader) == 48, "RequestHeader layout");

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

}  // namespace tcp
}  // namespace mori_torch
