// Local memory registrations. A registration counts the I/O using it, so
// deregistration can stop new users and wait for running ones: a buffer is
// never touched after deregister_memory returns.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/descriptors.h"

namespace mori_torch {

class LocalMemory {
 public:
  explicit LocalMemory(MemoryDesc d) : desc(std::move(d)) {}
  const MemoryDesc desc;

  char* Base() const { return reinterpret_cast<char*>(desc.data); }
  bool retired() const { return retired_.load(std::memory_order_acquire); }

  // Returns false once the registration is retired.
  bool Acquire();
  void Release();
  // Stops new users and waits until the running ones have released.
  void Retire();

  // Engines that mapped this memory into their own address space (one-sided
  // backends) and must be told when it goes away. Bounded: a full list
  // refuses newcomers (kFull) rather than evicting one, since an evicted
  // watcher would never learn that the memory went away and could write into
  // it after deregistration; the refused one simply cannot map it.
  static constexpr size_t kMaxWatchers = 64;
  enum class WatchResult { kAdded, kRetired, kFull };
  WatchResult AddWatcher(const EngineDesc& engine);
  // The watchers, deduplicated by key. After Retire() the list is final.
  std::vector<EngineDesc> Watchers();

 private:
  std::vector<EngineDesc> watchers_;  // guarded by mu_
  std::atomic<bool> retired_{false};
  std::atomic<int64_t> users_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

// RAII use of a registration; empty when the registration was retired.
class MemoryUse {
 public:
  MemoryUse() = default;
  explicit MemoryUse(std::shared_ptr<LocalMemory> m) {
    if (m && m->Acquire()) mem_ = std::move(m);
  }
  ~MemoryUse() { reset(); }
  MemoryUse(MemoryUse&& o) noexcept : mem_(std::move(o.mem_)) {}
  MemoryUse& operator=(MemoryUse&& o) noexcept {
    if (this != &o) {
      reset();
      mem_ = std::move(o.mem_);
    }
    return *this;
  }
  explicit operator bool() const { return mem_ != nullptr; }
  LocalMemory* operator->() const { return mem_.get(); }
  const std::shared_ptr<LocalMemory>& get() const { return mem_; }
  void reset() {
    if (mem_) mem_->Release();
    mem_.reset();
  }

 private:
  std::shared_ptr<LocalMemory> mem_;
};

class MemoryRegistry {
 public:
  // Called after registrations are retired (no local I/O uses them any
  // more): once per Remove with its one entry, once per Clear with all. So
  // backends drop what they derived from them (NIC registrations ...) and
  // take them back from the peers that mapped them, all in one go.
  using RemovalHook = std::function<void(const std::vector<std::shared_ptr<LocalMemory>>& retired)>;
  // Returns a token for RemoveRemovalHook.
  uint64_t AddRemovalHook(RemovalHook hook);
  // After it returns, the hook is not running and will not run again.
  void RemoveRemovalHook(uint64_t token);

  // Assigns the next id (ids count from 0 per engine) and a fresh random
  // token, and stores the entry.
  std::shared_ptr<LocalMemory> Add(MemoryDesc desc);
  // For this engine's own calls (it holds the descriptor it returned).
  std::shared_ptr<LocalMemory> Find(MemoryId id) const;
  // nullptr unless `token` is the registration's (compared in constant
  // time), so ids alone reveal nothing.
  std::shared_ptr<LocalMemory> Find(MemoryId id, const MemoryToken& token) const;
  // What serves a peer's request for memory `id` of owner incarnation
  // `incarnation` with `token`: the registration, or nullptr and *msg (an
  // ERR_NOT_FOUND message: "engine restarted", or not registered).
  std::shared_ptr<LocalMemory> FindForPeer(MemoryId id, Incarnation incarnation, const MemoryToken& token,
                                           std::string* msg) const;
  // The registration a peer's request payload names (EncodeMemoryRef);
  // throws Error: ERR_INVALID_ARGS for a malformed payload (`what` names
  // it), ERR_NOT_FOUND as FindForPeer.
  std::shared_ptr<LocalMemory> FindByRef(const std::vector<uint8_t>& payload, const char* what) const;
  // The engine whose memories these are (named in FindForPeer's messages).
  void SetOwner(const std::string& key, Incarnation incarnation) {
    owner_key_ = key;
    owner_incarnation_ = incarnation;
  }
  // Removes and retires; returns false if the id is unknown.
  bool Remove(MemoryId id);
  // Retires everything (engine shutdown) and returns the retired entries.
  std::vector<std::shared_ptr<LocalMemory>> Clear();

 private:
  void RunRemovalHooks(const std::vector<std::shared_ptr<LocalMemory>>& retired);

  mutable std::shared_mutex mu_;
  std::string owner_key_;
  Incarnation owner_incarnation_ = 0;
  MemoryId next_id_ = 0;
  std::shared_mutex hooks_mu_;
  uint64_t next_hook_ = 0;
  std::map<uint64_t, RemovalHook> hooks_;
  std::unordered_map<MemoryId, std::shared_ptr<LocalMemory>> map_;
};

// Payload of a request that names one of an engine's memories (MemLookup,
// MemWatch): id, owner incarnation, token.
std::vector<uint8_t> EncodeMemoryRef(const MemoryDesc& d);

// The message of a request aimed at an earlier process of engine `key`.
std::string EngineRestartedMessage(const std::string& key, Incarnation wanted, Incarnation current);

// "" when [offset, offset+size) lies inside the registration, else a message
// naming the side, values and the registration's size.
std::string CheckRange(const MemoryDesc& d, uint64_t offset, uint64_t size, const char* side);

}  // namespace mori_torch
