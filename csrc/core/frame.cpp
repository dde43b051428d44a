#include "core/frame.h"

#include <cstring>

#include "core/byte_io.h"

namespace mori_torch {

std::string ParseFrameHeader(const uint8_t* bytes, FrameHeader* out) {
  ByteReader r(bytes, kFrameHeaderBytes, "frame header");
  out->magic = r.Get<uint32_t>("magic");
  out->version = r.Get<uint16_t>("version");
  out->type = r.Get<uint16_t>("type");
  out->length = r.Get<uint32_t>("length");
  if (out->magic != kFrameMagic) {
    char b[64];
    snprintf(b, sizeof b, "bad frame magic 0x%08x", out->magic);
    return b;
  }
  if (out->version != kProtocolVersion) {
    return "unsupported protocol version " + std::to_string(out->version) + " (expected " +
           std::to_string(kProtocolVersion) + ")";
  }
  if (out->type == 0 || out->type > static_cast<uint16_t>(FrameType::kMaxKnown)) {
    return "unknown frame type " + std::to_string(out->type);
  }
  if (out->length > kMaxFramePayload) {
    return "frame payload of " + std::to_string(out->length) + " bytes exceeds the limit of " +
           std::to_string(kMaxFramePayload);
  }
  return "";
}

std::vector<uint8_t> EncodeFrame(FrameType type, const std::vector<uint8_t>& payload) {
  ByteWriter w;
  w.Put<uint32_t>(kFrameMagic);
  w.Put<uint16_t>(kProtocolVersion);
  w.Put<uint16_t>(static_cast<uint16_t>(type));
  w.Put<uint32_t>(static_cast<uint32_t>(payload.size()));
  w.PutBytes(payload.data(), payload.size());
  return std::move(w.bytes());
}

IoResult ReadFrame(int fd, Frame* out, int idle_timeout_ms, int frame_timeout_ms) {
  if (!WaitReadable(fd, idle_timeout_ms)) return IoResult::Fail("idle timeout", true);
  const Deadline deadline = DeadlineAfterMs(frame_timeout_ms);
  uint8_t hdr_bytes[kFrameHeaderBytes];
  IoResult r = ReadFull(fd, hdr_bytes, sizeof hdr_bytes, deadline);
  if (!r.ok) return r.timed_out ? IoResult::Fail("peer stalled mid-frame (header)", true) : r;
  FrameHeader hdr;
  std::string why = ParseFrameHeader(hdr_bytes, &hdr);
  if (!why.empty()) return IoResult::Fail(why);
  out->type = static_cast<FrameType>(hdr.type);
  out->payload.resize(hdr.length);
  r = ReadFull(fd, out->payload.data(), hdr.length, deadline);
  if (!r.ok) return r.timed_out ? IoResult::Fail("peer stalled mid-frame (payload)", true) : r;
  return IoResult::Ok();
}

IoResult WriteFrame(int fd, FrameType type, const std::vector<uint8_t>& payload, int timeout_ms) {
  auto bytes = EncodeFrame(type, payload);
  return WriteFull(fd, bytes.data(), bytes.size(), DeadlineAfterMs(timeout_ms));
}

}  // namespace mori_torch
