// Reads a socket through a small read-ahead buffer. One non-blocking recv
// takes whatever is queued, up to the capacity, so a small message (a
// request's header and table, a response's header and a small payload)
// costs one system call instead of a peek, a FIONREAD and one recv per part:
// on the VMs we measure, each of those costs 0.5-0.7 us, on the path of
// every small transfer. The reads below take buffered bytes first and then
// go to the socket directly, so the bulk of a large payload still lands in
// place. One thread at a time (its owner arbitrates: the event loop's
// one-shot watch, and for TCP data connections DataConn::reading_).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/net.h"

namespace mori_torch {

class SocketReader {
 public:
  explicit SocketReader(size_t capacity) : cap_(capacity) {}
  // Reads `fd` from now on; anything buffered from before is dropped.
  void Attach(int fd);
  int fd() const { return fd_; }
  size_t buffered() const { return end_ - pos_; }
  // The buffered bytes (valid until the next call).
  const char* data() const { return buf_.get() + pos_; }
  // One non-blocking recv into the free space: the bytes added, 0 if none
  // were queued (or the buffer is full), -1 if the peer closed the
  // connection or it failed. Bytes count as progress on `progress`.
  ssize_t FillNow(std::atomic<int64_t>* progress = nullptr);
  // True once the last FillNow found nothing queued, nothing is buffered and
  // the socket was not read since: it was drained just now (no poll needed
  // to know it). Only for the event that called FillNow: a new readiness
  // report means more may have come (NewEvent forgets it).
  bool drained() const { return drained_ && buffered() == 0; }
  void NewEvent() { drained_ = false; }
  // True if a message may be read now: bytes are buffered, or the socket
  // has some (asked with a poll, unless FillNow just found it empty).
  bool MoreNow() const { return buffered() > 0 || (!drained_ && ReadableNow(fd_)); }
  // True if `n` bytes can be read now without waiting: buffered already, or
  // after one FillNow, or queued in the socket beyond the buffer (FIONREAD).
  bool Ready(size_t n, std::atomic<int64_t>* progress = nullptr);
  // As the free functions of net.h, buffered bytes first.
  IoResult ReadFull(void* dst, size_t n, const IoDeadline& deadline);
  IoResult ReadVFull(std::vector<iovec>& iov, const IoDeadline& deadline);
  // Buffered bytes are copied only after the same check the socket's
  // receives get (PeerAbandoned): nothing lands once the peer gave up.
  IoResult ReadVFullFenced(std::vector<iovec>& iov, const IoDeadline& deadline);
  IoResult Discard(uint64_t n, const IoDeadline& deadline);

 private:
  // Copies buffered bytes into the front of `iov`, advancing its entries in
  // place.
  void Drain(std::vector<iovec>& iov);
  // Before a read goes to the socket itself (`wanted`: it reads anything):
  // forgets "drained", and true if a FillNow already took the socket's error,
  // which the read then reports (Failed).
  bool SocketFailed(bool wanted);
  IoResult Failed() const;

  const size_t cap_;
  std::unique_ptr<char[]> buf_;  // made on first use
  size_t pos_ = 0, end_ = 0;
  int fd_ = -1;
  bool drained_ = false;
  // The error a FillNow's recv took from the socket (ECONNRESET clears it
  // there): the next read reports it instead of a plain close.
  int failed_errno_ = 0;
};

}  // namespace mori_torch
