// When a TCP request skips the worker threads. Handing a small request to a
// worker costs a thread wake-up on each side of the round trip, several
// times the request's own cost on a small machine. So a small request of
// host memory is sent by the thread that submits it, and its response
// received, and on the target the request served, by the event-loop thread
// that sees it ready; where that thread sleeps between events (no loop
// spin), a thread polling the transfer's status receives the response
// itself when it finds it here (DataConn::ReceiveForCaller), saving the
// loop's wake-up. These threads must never wait on the network (the loop
// serves every connection), so they take only what cannot wait: every byte
// of the message is already here (read ahead, or in the socket's receive
// buffer), and what they write fits in its send buffer now. Anything else
// goes to the workers as before (TcpBackendConfig.inline_max_bytes: the
// size bound, 0: never). Each end reads its connections through a
// read-ahead buffer (core/socket_reader.h), so that a small message costs
// one recv, and asks the kernel for send-buffer room only when it may be
// short (SendRoom).
#pragma once

#include <cstddef>
#include <cstdint>

#include "backends/tcp/tcp_protocol.h"

namespace mori_torch {
namespace tcp {

// Segments of one request that the loop thread handles itself (the table
// is copied and checked segment by segment).
constexpr uint32_t kInlineMaxSegments = 64;
// Read-ahead of each data connection, at both ends (core/socket_reader.h):
// a request's header and table, or a response's header with a payload of a
// few pages, come in one recv.
constexpr size_t kReadAheadBytes = 16 << 10;
// Messages the loop thread handles per event of one connection, so that a
// busy connection cannot keep the loop from the others: more go to a worker.
constexpr int kInlineMaxPerEvent = 32;

// Whether more bytes can be written to a socket now without waiting: the
// bytes not yet acknowledged plus these fit in half its send buffer
// (SO_SNDBUF as the kernel reports it; the other half is the kernel's
// bookkeeping). The kernel is asked (TIOCOUTQ, a system call) only when an
// upper bound kept here says they might not fit: what it reported at the
// last ask plus every byte written since. So a conversation of small
// messages asks once per many of them, not once per message. Used by the
// holder of the connection's send turn (one thread at a time).
class SendRoom {
 public:
  void Attach(int fd);
  bool Fits(uint64_t bytes);
  void Wrote(uint64_t bytes) { bound_ += bytes; }

 private:
  int fd_ = -1;
  uint64_t half_ = 0;   // half of SO_SNDBUF
  uint64_t bound_ = 0;  // >= the bytes not yet acknowledged
};
// The bytes a request takes on the wire: header, table, padding, and for a
// write its payload.
uint64_t RequestWireBytes(Op op, uint64_t num_segs, uint64_t total_bytes);

}  // namespace tcp
}  // namespace mori_torch
