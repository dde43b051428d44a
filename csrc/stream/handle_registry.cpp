#include "stream/handle_registry.h"

#include <mutex>
#include <string>

namespace mori_torch {

HandleRegistry& HandleRegistry::Instance() {
  static HandleRegistry r;
  return r;
}

int64_t HandleRegistry::HandleOf(const std::shared_ptr<Session>& s) {
  std::unique_lock<std::shared_mutex> lk(mu_);
  auto it = by_session_.find(s.get());
  if (it != by_session_.end()) return it->second;
  auto ss = std::make_shared<StreamSession>();
  ss->session = s;
  ss->errors = std::make_shared<StreamErrors>();
  const int64_t h = next_++;
  by_handle_[h] = std::move(ss);
  by_session_[s.get()] = h;
  return h;
}

std::shared_ptr<StreamSession> HandleRegistry::Find(int64_t h, const char* op) {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = by_handle_.find(h);
  if (it == by_handle_.end()) {
    throw Error(StatusCode::ERR_NOT_FOUND, std::string(op) + ": session handle " + std::to_string(h) +
                                               " is unknown or released; get one from mori_torch.ops.session_handle");
  }
  return it->second;
}

bool HandleRegistry::Release(int64_t h) {
  std::unique_lock<std::shared_mutex> lk(mu_);
  auto it = by_handle_.find(h);
  if (it == by_handle_.end()) return false;
  by_session_.erase(it->second->session.get());
  by_handle_.erase(it);
  return true;
}

}  // namespace mori_torch
