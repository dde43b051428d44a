// Thin POSIX socket helpers: RAII fds, listen/connect, and full reads/writes
// (plain and scatter-gather) bounded by a deadline. I/O uses MSG_DONTWAIT and
// poll(), so a shutdown() from another thread or a passed deadline always ends
// a blocked call.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace mori_torch {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline DeadlineAfterMs(int64_t ms) {
  return ms < 0 ? Deadline::max() : Clock::now() + std::chrono::milliseconds(ms);
}

// When a blocking I/O helper gives up: at `at` (the whole operation's
// deadline), or once no byte has moved for `idle_ms` (-1: never), whichever
// comes first. With `progress`, bytes moved by any call sharing it count
// (the two directions of one connection: a response is awaited while the
// request's payload is still being sent). Converts from a plain Deadline.
struct IoDeadline {
  Deadline at = Deadline::max();
  int64_t idle_ms = -1;
  std::atomic<int64_t>* progress = nullptr;  // steady-clock ms of the last byte moved
  IoDeadline() = default;
  IoDeadline(Deadline d, int64_t idle = -1, std::atomic<int64_t>* prog = nullptr)  // NOLINT: implicit on purpose
      : at(d), idle_ms(idle), progress(prog) {}
};
int64_t SteadyMs();

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { Close(); }
  Socket(Socket&& o) noexcept : fd_(o.release()) {}
  Socket& operator=(Socket&& o) noexcept {
    if (this != &o) {
      Close();
      fd_ = o.release();
    }
    return *this;
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void Close();
  // Wakes any thread blocked on this socket; the fd stays open.
  void Shutdown() const;
  // Resets the connection (RST: unsent data is dropped and the peer's kernel
  // marks it aborted at once), then wakes this side's waiters like Shutdown.
  void Abort() const;

 private:
  int fd_ = -1;
};

// Result of an I/O helper: ok, or a reason ("peer closed the connection",
// "timed out after ...", strerror text).
struct IoResult {
  bool ok = true;
  bool timed_out = false;
  std::string error;
  static IoResult Ok() { return {}; }
  static IoResult Fail(std::string e, bool timeout = false) { return {false, timeout, std::move(e)}; }
};

// Binds and listens; *bound_port receives the real port (port 0 picks one).
// Throws Error with the host, port and errno text on failure.
Socket Listen(const std::string& host, int port, int* bound_port);
// Connects with a timeout; throws Error naming host:port and the reason.
Socket Connect(const std::string& host, int port, int timeout_ms);

void SetNoDelay(int fd, bool on);
void SetBufferSizes(int fd, int sndbuf, int rcvbuf);
void SetKeepalive(int fd, bool on, int idle_s, int intvl_s, int cnt);

// Waits until fd is readable (or hung up). Returns false on timeout.
bool WaitReadable(int fd, int timeout_ms);

IoResult ReadFull(int fd, void* buf, size_t n, const IoDeadline& deadline);
IoResult WriteFull(int fd, const void* buf, size_t n, const IoDeadline& deadline);
// Reads / writes the whole iovec list, IOV_MAX entries per system call.
// The vector is consumed (entries are advanced in place).
IoResult ReadVFull(int fd, std::vector<iovec>& iov, const IoDeadline& deadline);
// True once the peer has closed or reset the connection (its kernel said so;
// unread data may still be queued).
bool PeerAbandoned(int fd);
// ReadVFull into memory the peer may only write while it waits for the
// answer: fails, receiving nothing more, as soon as PeerAbandoned. The check
// and the receive are two system calls: a thread stopped between them copies
// what was queued when it resumes, so each receive takes at most
// kFencedReceiveMax bytes, which bounds what can land after the peer gave up
// (docs/SECURITY.md, "No late writes").
constexpr size_t kFencedReceiveMax = size_t{1} << 20;
// What a fenced receive that stops because the peer gave up reports (before
// ": " and the text of ECONNABORTED).
constexpr const char* kFencedReceive = "fenced receive (the peer abandoned the connection; nothing more is written)";
IoResult ReadVFullFenced(int fd, std::vector<iovec>& iov, const IoDeadline& deadline);
// One non-blocking recvmsg of at most `cap` bytes into m's iovecs: the entry
// that crosses the cap is shortened for this call and restored after it, so
// *m is as it was (errno is the call's).
ssize_t RecvAtMost(int fd, msghdr* m, size_t cap);
IoResult WriteVFull(int fd, std::vector<iovec>& iov, const IoDeadline& deadline);
// Reads and throws away n bytes (keeps a stream in sync after a rejected request).
IoResult Discard(int fd, uint64_t n, const IoDeadline& deadline);
// True if fd has bytes to read (or hung up) right now.
bool ReadableNow(int fd);
// Bytes queued for reading now (FIONREAD); 0 on error.
size_t BytesReadable(int fd);
// Bytes written but not yet acknowledged by the peer (TIOCOUTQ); 0 on error.
size_t BytesUnsent(int fd);
// Copies the next n bytes without consuming them; false unless all n are there.
bool PeekFull(int fd, void* buf, size_t n);

}  // namespace mori_torch
