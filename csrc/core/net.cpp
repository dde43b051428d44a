#include "core/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "core/types.h"

namespace mori_torch {
namespace {

std::string Errno(int e) { return std::strerror(e); }

int RemainingMs(Deadline deadline) {
  if (deadline == Deadline::max()) return -1;
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left + 1, 1 << 30));
}

// Waits for `events` on fd until the deadline, or idle_ms at most. Returns
// Ok when ready, else the reason.
IoResult PollFor(int fd, short events, const IoDeadline& deadline) {
  while (true) {
    int ms = RemainingMs(deadline.at);
    if (ms == 0) return IoResult::Fail("timed out", true);
    const bool idle_first = deadline.idle_ms >= 0 && (ms < 0 || deadline.idle_ms < ms);
    if (idle_first) ms = static_cast<int>(std::min<int64_t>(deadline.idle_ms, 1 << 30));
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, ms);
    if (r > 0) return IoResult::Ok();  // errors surface in the following call
    if (r == 0 && idle_first && deadline.progress &&
        SteadyMs() - deadline.progress->load(std::memory_order_relaxed) < deadline.idle_ms) {
      continue;  // the other direction moved bytes meanwhile
    }
    if (r == 0 && idle_first) {
      return IoResult::Fail("no progress for " + std::to_string(deadline.idle_ms) + " ms (inactivity timeout)", true);
    }
    if (r == 0) return IoResult::Fail("timed out", true);
    if (errno != EINTR) return IoResult::Fail("poll: " + Errno(errno));
  }
}

addrinfo* Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "cannot resolve host '" + host + "': " + std::string(gai_strerror(rc)));
  }
  return res;
}

// Moves the iovec cursor forward by n bytes.
void Advance(std::vector<iovec>& iov, size_t& first, size_t n) {
  while (n > 0 && first < iov.size()) {
    size_t take = std::min(n, iov[first].iov_len);
    iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + take;
    iov[first].iov_len -= take;
    n -= take;
    if (iov[first].iov_len == 0) ++first;
  }
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
}

template <typename Op>
IoResult VecLoop(int fd, std::vector<iovec>& iov, const IoDeadline& deadline, short events, Op op, const char* what) {
  size_t first = 0;
  Advance(iov, first, 0);
  while (first < iov.size()) {
    size_t cnt = std::min<size_t>(iov.size() - first, IOV_MAX);
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = cnt;
    ssize_t n = op(fd, &msg);
    if (n > 0) {
      if (deadline.progress) deadline.progress->store(SteadyMs(), std::memory_order_relaxed);
      Advance(iov, first, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return IoResult::Fail("peer closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      IoResult r = PollFor(fd, events, deadline);
      if (!r.ok) return r;
      continue;
    }
    return IoResult::Fail(std::string(what) + ": " + Errno(errno));
  }
  return IoResult::Ok();
}

}  // namespace

int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

void Socket::Close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void Socket::Shutdown() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void Socket::Abort() const {
  if (fd_ < 0) return;
  // connect() to AF_UNSPEC disconnects a TCP socket: tcp_disconnect sends a
  // RST from an established connection and drops both queues.
  sockaddr unspec{};
  unspec.sa_family = AF_UNSPEC;
  ::connect(fd_, &unspec, sizeof(unspec));
  ::shutdown(fd_, SHUT_RDWR);  // wakes threads polling the socket
}

Socket Listen(const std::string& host, int port, int* bound_port) {
  if (port < 0 || port > 65535) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "port " + std::to_string(port) + " out of range 0..65535");
  }
  addrinfo* res = Resolve(host, port, true);
  Socket s(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) {
    freeaddrinfo(res);
    throw Error(StatusCode::ERR_BAD_STATE, "socket: " + Errno(errno));
  }
  int one = 1;
  setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc = ::bind(s.fd(), res->ai_addr, res->ai_addrlen);
  int err = errno;
  freeaddrinfo(res);
  if (rc != 0) {
    throw Error(StatusCode::ERR_BAD_STATE, "cannot bind " + host + ":" + std::to_string(port) + ": " + Errno(err));
  }
  if (::listen(s.fd(), 512) != 0) throw Error(StatusCode::ERR_BAD_STATE, "listen: " + Errno(errno));
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr), &len);
  *bound_port = ntohs(addr.sin_port);
  return s;
}

Socket Connect(const std::string& host, int port, int timeout_ms) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo* res = Resolve(host, port, false);
  Socket s(::socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!s.valid()) {
    freeaddrinfo(res);
    throw Error(StatusCode::ERR_BAD_STATE, "socket: " + Errno(errno));
  }
  int rc = ::connect(s.fd(), res->ai_addr, res->ai_addrlen);
  int err = errno;
  freeaddrinfo(res);
  if (rc != 0 && err != EINPROGRESS) {
    throw Error(StatusCode::ERR_BAD_STATE, "cannot connect to " + where + ": " + Errno(err), err);
  }
  if (rc != 0) {
    IoResult r = PollFor(s.fd(), POLLOUT, DeadlineAfterMs(timeout_ms));
    if (!r.ok) {
      throw Error(StatusCode::ERR_BAD_STATE,
                  "cannot connect to " + where + ": " + r.error + " after " + std::to_string(timeout_ms) + " ms",
                  r.timed_out ? ETIMEDOUT : 0);
    }
    int so_err = 0;
    socklen_t len = sizeof(so_err);
    getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &so_err, &len);
    if (so_err != 0) {
      throw Error(StatusCode::ERR_BAD_STATE, "cannot connect to " + where + ": " + Errno(so_err), so_err);
    }
  }
  return s;
}

void SetNoDelay(int fd, bool on) {
  int v = on ? 1 : 0;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &v, sizeof(v));
}

void SetBufferSizes(int fd, int sndbuf, int rcvbuf) {
  if (sndbuf > 0) setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
  if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
}

void SetKeepalive(int fd, bool on, int idle_s, int intvl_s, int cnt) {
  int v = on ? 1 : 0;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &v, sizeof(v));
  if (!on) return;
  if (idle_s > 0) setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  if (intvl_s > 0) setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl_s, sizeof(intvl_s));
  if (cnt > 0) setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
}

bool ReadableNow(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

size_t BytesReadable(int fd) {
  int n = 0;
  return ::ioctl(fd, FIONREAD, &n) == 0 && n > 0 ? static_cast<size_t>(n) : 0;
}

size_t BytesUnsent(int fd) {
  int n = 0;
  return ::ioctl(fd, TIOCOUTQ, &n) == 0 && n > 0 ? static_cast<size_t>(n) : 0;
}

bool PeekFull(int fd, void* buf, size_t n) {
  return ::recv(fd, buf, n, MSG_PEEK | MSG_DONTWAIT) == static_cast<ssize_t>(n);
}

bool WaitReadable(int fd, int timeout_ms) { return PollFor(fd, POLLIN, DeadlineAfterMs(timeout_ms)).ok; }

IoResult ReadFull(int fd, void* buf, size_t n, const IoDeadline& deadline) {
  std::vector<iovec> iov{{buf, n}};
  return ReadVFull(fd, iov, deadline);
}

IoResult WriteFull(int fd, const void* buf, size_t n, const IoDeadline& deadline) {
  std::vector<iovec> iov{{const_cast<void*>(buf), n}};
  return WriteVFull(fd, iov, deadline);
}

IoResult ReadVFull(int fd, std::vector<iovec>& iov, const IoDeadline& deadline) {
  return VecLoop(
      fd, iov, deadline, POLLIN, [](int f, msghdr* m) { return ::recvmsg(f, m, MSG_DONTWAIT); }, "recvmsg");
}

bool PeerAbandoned(int fd) {
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

ssize_t RecvAtMost(int fd, msghdr* m, size_t cap) {
  iovec* v = m->msg_iov;
  size_t total = 0, k = 0;
  while (k < m->msg_iovlen && total + v[k].iov_len <= cap) total += v[k++].iov_len;
  if (k == m->msg_iovlen) return ::recvmsg(fd, m, MSG_DONTWAIT);
  // Entry k crosses the cap: shortened for this call only.
  const size_t whole = v[k].iov_len;
  const size_t whole_count = m->msg_iovlen;
  v[k].iov_len = cap - total;
  m->msg_iovlen = k + 1;
  const ssize_t n = ::recvmsg(fd, m, MSG_DONTWAIT);
  const int err = errno;
  v[k].iov_len = whole;
  m->msg_iovlen = whole_count;
  errno = err;
  return n;
}

IoResult ReadVFullFenced(int fd, std::vector<iovec>& iov, const IoDeadline& deadline) {
  return VecLoop(
      fd, iov, deadline, POLLIN,
      [](int f, msghdr* m) -> ssize_t {
        if (PeerAbandoned(f)) {
          errno = ECONNABORTED;
          return -1;
        }
        return RecvAtMost(f, m, kFencedReceiveMax);
      },
      kFencedReceive);
}

IoResult WriteVFull(int fd, std::vector<iovec>& iov, const IoDeadline& deadline) {
  return VecLoop(
      fd, iov, deadline, POLLOUT, [](int f, msghdr* m) { return ::sendmsg(f, m, MSG_DONTWAIT | MSG_NOSIGNAL); },
      "sendmsg");
}

IoResult Discard(int fd, uint64_t n, const IoDeadline& deadline) {
  static thread_local std::vector<char> sink(1 << 16);
  while (n > 0) {
    size_t take = static_cast<size_t>(std::min<uint64_t>(n, sink.size()));
    IoResult r = ReadFull(fd, sink.data(), take, deadline);
    if (!r.ok) return r;
    n -= take;
  }
  return IoResult::Ok();
}

}  // namespace mori_torch
