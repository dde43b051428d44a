// Sessions as int handles for stream-ordered ops: an int is a plain constant
// to torch.compile and CUDA graphs, where an object argument would need a
// fake class and flattening support. Each handle keeps its session alive and
// owns the session's StreamErrors until released.
#pragma once

#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <unordered_map>

#include "core/session.h"
#include "stream/stream_errors.h"

namespace mori_torch {

struct StreamSession {
  std::shared_ptr<Session> session;
  std::shared_ptr<StreamErrors> errors;
};

class HandleRegistry {
 public:
  static HandleRegistry& Instance();
  // The handle of `s` (the same one for the same session), made on first use.
  int64_t HandleOf(const std::shared_ptr<Session>& s);
  // Throws Error (ERR_NOT_FOUND) naming `op` and the handle when unknown.
  std::shared_ptr<StreamSession> Find(int64_t handle, const char* op);
  // False when the handle is unknown or already released.
  bool Release(int64_t handle);

 private:
  std::shared_mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<StreamSession>> by_handle_;
  std::unordered_map<const Session*, int64_t> by_session_;
  int64_t next_ = 1;
};

}  // namespace mori_torch
