#include "core/socket_reader.h"

#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

namespace mori_torch {
namespace {

bool Wanted(const std::vector<iovec>& iov) {
  for (const iovec& v : iov) {
    if (v.iov_len > 0) return true;
  }
  return false;
}

}  // namespace

void SocketReader::Attach(int fd) {
  fd_ = fd;
  pos_ = end_ = 0;
  drained_ = false;
  failed_errno_ = 0;
}

IoResult SocketReader::Failed() const {
  return IoResult::Fail("recvmsg: " + std::string(std::strerror(failed_errno_)));
}

ssize_t SocketReader::FillNow(std::atomic<int64_t>* progress) {
  if (!buf_) buf_.reset(new char[cap_]);
  if (pos_ == end_) {
    pos_ = end_ = 0;
  } else if (pos_ > 0) {
    std::memmove(buf_.get(), buf_.get() + pos_, end_ - pos_);
    end_ -= pos_;
    pos_ = 0;
  }
  drained_ = false;
  if (end_ == cap_) return 0;
  for (;;) {
    const ssize_t n = ::recv(fd_, buf_.get() + end_, cap_ - end_, MSG_DONTWAIT);
    if (n > 0) {
      end_ += static_cast<size_t>(n);
      if (progress) progress->store(SteadyMs(), std::memory_order_relaxed);
      return n;
    }
    if (n == 0) return -1;  // closed
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      drained_ = true;
      return 0;
    }
    failed_errno_ = errno;
    return -1;
  }
}

bool SocketReader::Ready(size_t n, std::atomic<int64_t>* progress) {
  if (buffered() >= n) return true;
  if (FillNow(progress) < 0) return false;
  if (buffered() >= n) return true;
  return !drained_ && buffered() + BytesReadable(fd_) >= n;
}

void SocketReader::Drain(std::vector<iovec>& iov) {
  for (iovec& v : iov) {
    if (buffered() == 0) break;
    const size_t take = std::min(v.iov_len, buffered());
    if (take == 0) continue;
    std::memcpy(v.iov_base, buf_.get() + pos_, take);
    pos_ += take;
    v.iov_base = static_cast<char*>(v.iov_base) + take;
    v.iov_len -= take;
  }
}

bool SocketReader::SocketFailed(bool wanted) {
  drained_ = false;  // the socket is read directly: what FillNow found is stale
  return failed_errno_ != 0 && wanted;
}

IoResult SocketReader::ReadFull(void* dst, size_t n, const IoDeadline& deadline) {
  std::vector<iovec> iov{{dst, n}};
  return ReadVFull(iov, deadline);
}

IoResult SocketReader::ReadVFull(std::vector<iovec>& iov, const IoDeadline& deadline) {
  Drain(iov);
  if (SocketFailed(Wanted(iov))) return Failed();
  return mori_torch::ReadVFull(fd_, iov, deadline);
}

IoResult SocketReader::ReadVFullFenced(std::vector<iovec>& iov, const IoDeadline& deadline) {
  if (buffered() > 0) {
    if (Wanted(iov) && PeerAbandoned(fd_)) {
      return IoResult::Fail(std::string(kFencedReceive) + ": " + std::strerror(ECONNABORTED));
    }
    Drain(iov);
  }
  if (SocketFailed(Wanted(iov))) return Failed();
  return mori_torch::ReadVFullFenced(fd_, iov, deadline);
}

IoResult SocketReader::Discard(uint64_t n, const IoDeadline& deadline) {
  const size_t take = static_cast<size_t>(std::min<uint64_t>(n, buffered()));
  pos_ += take;
  if (SocketFailed(n > take)) return Failed();
  return mori_torch::Discard(fd_, n - take, deadline);
}

}  // namespace mori_torch
