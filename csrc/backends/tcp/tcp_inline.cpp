#include "backends/tcp/tcp_inline.h"

#include <sys/socket.h>

#include "core/net.h"

namespace mori_torch {
namespace tcp {

int SendBufferBytes(int fd) {
  int v = 0;
  socklen_t len = sizeof(v);
  return ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &len) == 0 ? v : 0;
}

bool SendFitsNow(int fd, uint64_t bytes, int sndbuf) {
  return BytesUnsent(fd) + bytes <= static_cast<uint64_t>(sndbuf) / 2;
}

uint64_t RequestWireBytes(Op op, uint64_t num_segs, uint64_t total_bytes) {
  uint64_t n = WireRound(sizeof(RequestHeader) + num_segs * sizeof(WireSegment));
  if (op == Op::Write) n += WireRound(total_bytes);
  return n;
}

}  // namespace tcp
}  // namespace mori_torch
