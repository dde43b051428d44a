#include "core/memory_registry.h"

#include "core/byte_io.h"
#include "core/crypto.h"

namespace mori_torch {

bool LocalMemory::Acquire() {
  if (retired()) return false;
  users_.fetch_add(1, std::memory_order_acq_rel);
  if (retired()) {  // lost the race with Retire()
    Release();
    return false;
  }
  return true;
}

void LocalMemory::Release() {
  if (users_.fetch_sub(1, std::memory_order_acq_rel) == 1 && retired()) {
    std::lock_guard<std::mutex> lk(mu_);
    cv_.notify_all();
  }
}

void LocalMemory::Retire() {
  retired_.store(true, std::memory_order_release);
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return users_.load(std::memory_order_acquire) == 0; });
}

LocalMemory::WatchResult LocalMemory::AddWatcher(const EngineDesc& engine) {
  std::lock_guard<std::mutex> lk(mu_);
  // Checked under mu_, which Watchers() takes after Retire() set the flag:
  // a watcher is either in the final list or refused.
  if (retired()) return WatchResult::kRetired;
  for (auto& w : watchers_) {
    if (w.key == engine.key) {
      w = engine;  // the engine restarted with a new address
      return WatchResult::kAdded;
    }
  }
  if (watchers_.size() >= kMaxWatchers) return WatchResult::kFull;
  watchers_.push_back(engine);
  return WatchResult::kAdded;
}

std::vector<EngineDesc> LocalMemory::Watchers() {
  std::lock_guard<std::mutex> lk(mu_);
  return watchers_;
}

std::shared_ptr<LocalMemory> MemoryRegistry::Add(MemoryDesc desc) {
  crypto::SecureRandom(desc.token.data(), desc.token.size());
  std::unique_lock<std::shared_mutex> lk(mu_);
  desc.id = next_id_++;
  auto m = std::make_shared<LocalMemory>(std::move(desc));
  map_[m->desc.id] = m;
  return m;
}

std::shared_ptr<LocalMemory> MemoryRegistry::Find(MemoryId id) const {
  std::shared_lock<std::shared_mutex> lk(mu_);
  auto it = map_.find(id);
  return it == map_.end() ? nullptr : it->second;
}

std::shared_ptr<LocalMemory> MemoryRegistry::Find(MemoryId id, const MemoryToken& token) const {
  auto m = Find(id);
  if (!m || !crypto::ConstantTimeEqual(m->desc.token.data(), token.data(), token.size())) return nullptr;
  return m;
}

std::shared_ptr<LocalMemory> MemoryRegistry::FindForPeer(MemoryId id, Incarnation incarnation, const MemoryToken& token,
                                                         std::string* msg) const {
  if (incarnation != owner_incarnation_) {
    *msg = EngineRestartedMessage(owner_key_, incarnation, owner_incarnation_);
    return nullptr;
  }
  auto m = Find(id, token);
  // The same answer for an unknown id and a wrong token: nothing to probe.
  if (!m) *msg = "memory " + std::to_string(id) + " is not registered with engine '" + owner_key_ + "' (deregistered?)";
  return m;
}

std::shared_ptr<LocalMemory> MemoryRegistry::FindByRef(const std::vector<uint8_t>& payload, const char* what) const {
  ByteReader r(payload.data(), payload.size(), what);
  const uint64_t id = r.Get<uint64_t>("memory id");
  const Incarnation incarnation = r.Get<uint64_t>("incarnation");
  MemoryToken token;
  r.GetBytes(token.data(), token.size(), "token");
  r.ExpectEnd();
  std::string msg;
  auto m = FindForPeer(id, incarnation, token, &msg);
  if (!m) throw Error(StatusCode::ERR_NOT_FOUND, msg);
  return m;
}

std::vector<uint8_t> EncodeMemoryRef(const MemoryDesc& d) {
  ByteWriter w;
  w.Put<uint64_t>(d.id);
  w.Put<uint64_t>(d.incarnation);
  w.PutBytes(d.token.data(), d.token.size());
  return w.bytes();
}

std::string EngineRestartedMessage(const std::string& key, Incarnation wanted, Incarnation current) {
  return "engine restarted: the request is for incarnation " + std::to_string(wanted) + " of engine '" + key +
         "', which is now incarnation " + std::to_string(current) + " (fetch its new descriptors)";
}

bool MemoryRegistry::Remove(MemoryId id) {
  std::shared_ptr<LocalMemory> m;
  {
    std::unique_lock<std::shared_mutex> lk(mu_);
    auto it = map_.find(id);
    if (it == map_.end()) return false;
    m = std::move(it->second);
    map_.erase(it);
  }
  m->Retire();  // outside the lock: waits for running I/O only
  RunRemovalHooks({m});
  return true;
}

std::vector<std::shared_ptr<LocalMemory>> MemoryRegistry::Clear() {
  std::unordered_map<MemoryId, std::shared_ptr<LocalMemory>> all;
  {
    std::unique_lock<std::shared_mutex> lk(mu_);
    all.swap(map_);
  }
  std::vector<std::shared_ptr<LocalMemory>> out;
  for (auto& kv : all) {
    kv.second->Retire();
    out.push_back(std::move(kv.second));
  }
  if (!out.empty()) RunRemovalHooks(out);
  return out;
}

uint64_t MemoryRegistry::AddRemovalHook(RemovalHook hook) {
  std::unique_lock<std::shared_mutex> lk(hooks_mu_);
  hooks_[next_hook_] = std::move(hook);
  return next_hook_++;
}

void MemoryRegistry::RemoveRemovalHook(uint64_t token) {
  std::unique_lock<std::shared_mutex> lk(hooks_mu_);  // waits for running hooks
  hooks_.erase(token);
}

void MemoryRegistry::RunRemovalHooks(const std::vector<std::shared_ptr<LocalMemory>>& retired) {
  std::shared_lock<std::shared_mutex> lk(hooks_mu_);
  for (auto& kv : hooks_) kv.second(retired);
}

std::string CheckRange(const MemoryDesc& d, uint64_t offset, uint64_t size, const char* side) {
  if (offset > d.size || size > d.size - offset) {
    return std::string(side) + " range out of bounds: offset " + std::to_string(offset) + " + size " +
           std::to_string(size) + " exceeds memory " + std::to_string(d.id) + " of engine '" + d.engine_key +
           "' (size " + std::to_string(d.size) + ")";
  }
  return "";
}

}  // namespace mori_torch
