#include "core/frame.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
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

size_t FrameReader::Wanted() const {
  if (done_ || !error_.empty()) return 0;
  if (have_ < kFrameHeaderBytes) return kFrameHeaderBytes - have_;
  return std::min<size_t>(kChunk, hdr_.length - payload_.size());
}

FrameReader::Step FrameReader::Feed(const uint8_t* p, size_t n, size_t* consumed) {
  *consumed = 0;
  if (!error_.empty()) return Step::kError;
  if (done_) return Step::kFrame;
  if (have_ < kFrameHeaderBytes) {
    size_t take = std::min(n, kFrameHeaderBytes - have_);
    std::memcpy(hdr_bytes_ + have_, p, take);
    have_ += take;
    *consumed += take;
    p += take;
    n -= take;
    if (have_ < kFrameHeaderBytes) return Step::kNeedMore;
    error_ = ParseFrameHeader(hdr_bytes_, &hdr_);
    if (!error_.empty()) return Step::kError;
  }
  size_t take = std::min<size_t>(n, hdr_.length - payload_.size());
  payload_.insert(payload_.end(), p, p + take);  // grows with what arrived
  have_ += take;
  *consumed += take;
  if (payload_.size() < hdr_.length) return Step::kNeedMore;
  done_ = true;
  return Step::kFrame;
}

FrameReader::Step FrameReader::ReadSome(int fd) {
  uint8_t buf[kChunk];
  while (true) {
    const size_t want = Wanted();
    if (want == 0) return error_.empty() ? Step::kFrame : Step::kError;
    ssize_t n = ::recv(fd, buf, want, MSG_DONTWAIT);
    if (n == 0) {
      error_ = "peer closed the connection";
      return Step::kClosed;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return Step::kNeedMore;
      error_ = std::string("recv: ") + std::strerror(errno);
      return Step::kError;
    }
    size_t used = 0;
    Step s = Feed(buf, static_cast<size_t>(n), &used);
    if (s != Step::kNeedMore) return s;
  }
}

Frame FrameReader::Take() {
  Frame f;
  f.type = static_cast<FrameType>(hdr_.type);
  f.payload.swap(payload_);
  *this = FrameReader();
  return f;
}

IoResult ReadFrame(int fd, Frame* out, int idle_timeout_ms, int frame_timeout_ms) {
  if (!WaitReadable(fd, idle_timeout_ms)) return IoResult::Fail("idle timeout", true);
  return ReadFrameBy(fd, out, DeadlineAfterMs(frame_timeout_ms));
}

IoResult ReadFrameBy(int fd, Frame* out, Deadline deadline) {
  FrameReader rd;
  while (true) {
    switch (rd.ReadSome(fd)) {
      case FrameReader::Step::kFrame:
        *out = rd.Take();
        return IoResult::Ok();
      case FrameReader::Step::kClosed:
        if (!rd.Started()) return IoResult::Fail(rd.error());
        return IoResult::Fail("peer closed the connection mid-frame");
      case FrameReader::Step::kError:
        return IoResult::Fail(rd.error());
      case FrameReader::Step::kNeedMore: {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (left <= 0 || !WaitReadable(fd, static_cast<int>(std::min<int64_t>(left, 1 << 30)))) {
          if (!rd.Started()) return IoResult::Fail("timed out waiting for a frame", true);
          return IoResult::Fail(std::string("peer stalled mid-frame (") + (rd.InPayload() ? "payload" : "header") + ")",
                                true);
        }
        break;
      }
    }
  }
}

IoResult WriteFrame(int fd, FrameType type, const std::vector<uint8_t>& payload, int timeout_ms) {
  auto bytes = EncodeFrame(type, payload);
  return WriteFull(fd, bytes.data(), bytes.size(), DeadlineAfterMs(timeout_ms));
}

}  // namespace mori_torch
