// The one error currency of every layer: a StatusCode (MORI-IO's values;
// users compare them, so never renumber) plus, where a system call failed,
// its errno. Code decides on these fields, never on message text.
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>

namespace mori_torch {

enum class StatusCode : int {
  SUCCESS = 0,
  INIT = 1,
  IN_PROGRESS = 2,
  ERR_INVALID_ARGS = 11,
  ERR_NOT_FOUND = 12,
  ERR_RDMA_OP = 13,
  ERR_BAD_STATE = 14,
  ERR_GPU_OP = 15,
};

// Why an error happened, where callers act on it (MORI-IO's StatusCode is
// too coarse for that, and its values are fixed).
enum class ErrorCause : int {
  kUnspecified = 0,
  kPeerRestarted,  // the engine there is a later incarnation than the one named
  kWrongPeer,      // another engine listens at the address named
  kPathFailed,     // the connection broke while being set up (reset or closed mid-handshake):
                   // a fresh one may work (core/retry_driver.h)
};

inline bool IsError(StatusCode c) { return static_cast<int>(c) > 10; }
inline bool IsTerminal(StatusCode c) { return c == StatusCode::SUCCESS || IsError(c); }

const char* StatusCodeName(StatusCode c);

// Thrown by calls that fail before any transfer exists (bad registration,
// malformed descriptor bytes, a bad environment variable ...). The code lets
// the bindings pick the matching Python exception; sys_errno (0: none) is the
// errno of the system call behind it (ECONNREFUSED ...), cause the reason
// where one is known. The message is for people only.
class Error : public std::runtime_error {
 public:
  Error(StatusCode code, const std::string& msg, int sys_errno = 0, ErrorCause cause = ErrorCause::kUnspecified)
      : std::runtime_error(msg), code_(code), sys_errno_(sys_errno), cause_(cause) {}
  // The same error with `context` put in front of its message.
  Error(const std::string& context, const Error& e) : Error(e.code(), context + e.what(), e.sys_errno(), e.cause()) {}
  StatusCode code() const { return code_; }
  int sys_errno() const { return sys_errno_; }
  ErrorCause cause() const { return cause_; }

 private:
  StatusCode code_;
  int sys_errno_;
  ErrorCause cause_;
};

// True if `e` (thrown while opening or using a connection) is the path's
// fault: reset or aborted while connecting or mid-handshake. A fresh
// connection may work. Refused (nobody listens), timeouts, auth and "engine
// restarted" are not.
inline bool IsPathError(const Error& e) {
  return e.cause() == ErrorCause::kPathFailed || e.sys_errno() == ECONNRESET || e.sys_errno() == ECONNABORTED ||
         e.sys_errno() == EPIPE;
}

}  // namespace mori_torch
