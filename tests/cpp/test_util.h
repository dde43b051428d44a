// Small helpers shared by the GoogleTest files (not a test file itself: the
// CMake glob only picks up *_test.cpp).
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/segments.h"
#include "core/types.h"

namespace mori_torch {
namespace testing_util {

// Merges contiguous neighbours the plain way, in one pass (append, or grow
// the last entry; empty segments dropped): the reference for the library's
// merge, which works in chunks on long lists.
inline std::vector<Segment> ReferenceMerge(const std::vector<Segment>& in) {
  std::vector<Segment> out;
  for (const Segment& s : in) {
    if (s.size == 0) continue;
    if (!out.empty() && out.back().local_off + out.back().size == s.local_off &&
        out.back().remote_off + out.back().size == s.remote_off) {
      out.back().size += s.size;
    } else {
      out.push_back(s);
    }
  }
  return out;
}

// Runs `f` and returns the mori_torch::Error it throws; records a failure
// (and returns an empty optional) when it throws nothing or something else.
template <typename F>
std::optional<Error> CatchError(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mori_torch::Error, got std::exception: " << e.what();
    return std::nullopt;
  } catch (...) {
    ADD_FAILURE() << "expected mori_torch::Error, got an unknown exception";
    return std::nullopt;
  }
  ADD_FAILURE() << "expected mori_torch::Error, nothing was thrown";
  return std::nullopt;
}

inline bool Contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

// Polls `pred` until it holds or `timeout_ms` passes.
inline bool PollUntil(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

inline int64_t MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

inline void FillRandom(std::vector<uint8_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    uint64_t x = rng();
    for (int k = 0; k < 8; ++k) v[i + k] = static_cast<uint8_t>(x >> (8 * k));
  }
  for (; i < v.size(); ++i) v[i] = static_cast<uint8_t>(rng());
}

// Sets an environment variable for one scope and restores the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = std::string(old);
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// A plain TCP connection to 127.0.0.1:`port`, as a hostile or broken peer
// would open it (no Hello); -1 when the connect fails.
inline int RawConnect(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True once the peer closed `fd` (EOF or reset) within `ms`; what it sent
// before closing is read and dropped.
inline bool ClosedWithin(int fd, int ms) {
  const auto t0 = std::chrono::steady_clock::now();
  char buf[4096];
  while (MsSince(t0) < ms) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, std::min(ms, 50)) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

// Shuts down every connected socket of this process whose local port is
// `port` (an engine's inbound control and data connections): the real fault
// of a link that drops, from inside the test. The engine still owns the
// descriptors, so nothing is closed under it. Returns how many.
inline int ShutDownInboundSockets(int port) {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return 0;
  std::vector<int> fds;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') fds.push_back(std::atoi(e->d_name));
  }
  ::closedir(dir);
  for (int fd : fds) {
    sockaddr_in self{}, peer{};
    socklen_t len = sizeof self, plen = sizeof peer;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) != 0 || self.sin_family != AF_INET) continue;
    if (ntohs(self.sin_port) != port) continue;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) continue;  // the listener
    if (::shutdown(fd, SHUT_RDWR) == 0) ++n;
  }
  return n;
}

}  // namespace testing_util
}  // namespace mori_torch
