// The per-remote-engine peer map every backend keeps: found without scanning,
// created once on first use, handed out whole on removal or shutdown.
#pragma once

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace mori_torch {

template <typename PeerT>
class PeerCache {
 public:
  // The peer for `key`; `make()` builds it on first use (under the lock, so
  // exactly once).
  template <typename Make>
  std::shared_ptr<PeerT> GetOrCreate(const std::string& key, Make make) {
    if (auto p = Find(key)) return p;
    std::unique_lock<std::shared_mutex> lk(mu_);
    auto& p = map_[key];
    if (!p) p = make();
    return p;
  }

  // The peer for `key` if there is one (nullptr otherwise); creates none.
  std::shared_ptr<PeerT> Find(const std::string& key) {
    std::shared_lock<std::shared_mutex> lk(mu_);
    auto it = map_.find(key);
    return it == map_.end() ? nullptr : it->second;
  }

  std::vector<std::shared_ptr<PeerT>> All() {
    std::shared_lock<std::shared_mutex> lk(mu_);
    std::vector<std::shared_ptr<PeerT>> out;
    out.reserve(map_.size());
    for (auto& kv : map_) out.push_back(kv.second);
    return out;
  }

  // Removes and returns the peer for `key` (nullptr if there is none).
  std::shared_ptr<PeerT> Take(const std::string& key) {
    std::unique_lock<std::shared_mutex> lk(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    auto p = std::move(it->second);
    map_.erase(it);
    return p;
  }

  std::vector<std::shared_ptr<PeerT>> TakeAll() {
    std::unique_lock<std::shared_mutex> lk(mu_);
    std::vector<std::shared_ptr<PeerT>> out;
    out.reserve(map_.size());
    for (auto& kv : map_) out.push_back(std::move(kv.second));
    map_.clear();
    return out;
  }

 private:
  std::shared_mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<PeerT>> map_;
};

}  // namespace mori_torch
