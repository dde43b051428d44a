// Enums, ids and the error type shared by every layer. Integer values match
// MORI-IO's (users compare them), so never renumber.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace mori_torch {

enum class BackendType : int { Unknown = 0, XGMI = 1, RDMA = 2, TCP = 3 };
enum class MemoryLocationType : int { Unknown = 0, CPU = 1, GPU = 2 };
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

using MemoryId = uint64_t;
using TransferUid = uint64_t;

inline bool IsError(StatusCode c) { return static_cast<int>(c) > 10; }
inline bool IsTerminal(StatusCode c) { return c == StatusCode::SUCCESS || IsError(c); }

const char* StatusCodeName(StatusCode c);
const char* BackendTypeName(BackendType t);
const char* MemoryLocationName(MemoryLocationType t);

// Thrown by API calls that fail before any transfer exists (bad registration,
// malformed descriptor bytes, ...). The code lets the bindings pick the
// matching Python exception.
class Error : public std::runtime_error {
 public:
  Error(StatusCode code, const std::string& msg) : std::runtime_error(msg), code_(code) {}
  StatusCode code() const { return code_; }
  // The connection failed (reset or closed while connecting), not the
  // request: a retry on a fresh one may succeed (core/retry_driver.h).
  bool path_failed() const { return path_failed_; }
  Error& MarkPathFailed() {
    path_failed_ = true;
    return *this;
  }

 private:
  StatusCode code_;
  bool path_failed_ = false;
};

}  // namespace mori_torch
