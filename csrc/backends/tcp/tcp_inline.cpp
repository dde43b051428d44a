#include "backends/tcp/tcp_inline.h"

#include <sys/socket.h>

#include "core/net.h"

namespace mori_torch {
namespace tcp {

void SendRoom::Attach(int fd) {
  fd_ = fd;
  int v = 0;
  socklen_t len = sizeof(v);
  half_ = ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &len) == 0 && v > 0 ? static_cast<uint64_t>(v) / 2 : 0;
  bound_ = BytesUnsent(fd);  // a handshake reply may still be queued
}

bool SendRoom::Fits(uint64_t bytes) {
  if (bound_ + bytes <= half_) return true;
  bound_ = BytesUnsent(fd_);
  return bound_ + bytes <= half_;
}

uint64_t RequestWireBytes(Op op, uint64_t num_segs, uint64_t total_bytes) {
  uint64_t n = WireRound(sizeof(RequestHeader) + num_segs * sizeof(WireSegment));
  if (op == Op::Write) n += WireRound(total_bytes);
  return n;
}

}  // namespace tcp
}  // namespace mori_torch
