// Inbound completion notices on the target side: counts the finished parts of
// each (initiator key, uid) and hands the result out once, through Pop().
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/types.h"

namespace mori_torch {

class NotificationTable {
 public:
  // Bounds: completed notices nobody popped, and transfers with some parts
  // arrived (a peer can claim any number of parts). Past either, the oldest
  // entry is evicted and counted in Dropped().
  explicit NotificationTable(size_t max_completed = 1 << 20, size_t max_partial = 1 << 16)
      : max_completed_(max_completed), max_partial_(max_partial) {}

  // One part of transfer (initiator, uid) finished with its data in place;
  // the transfer has `parts_total` parts in all.
  void Arrive(const std::string& initiator, TransferUid uid, uint32_t parts_total);
  // True once, when every part of (initiator, uid) has arrived; consumes it.
  bool Pop(const std::string& initiator, TransferUid uid);
  size_t CompletedCount() const;
  size_t PartialCount() const;
  uint64_t Dropped() const;

 private:
  struct Entry {
    uint32_t arrived = 0;
    uint32_t total = 0;
  };
  bool IsLiveCompleted(const std::pair<std::string, TransferUid>& rec) const;
  void TrimStaleOrder();
  void EvictPartial();

  using PerInitiator = std::unordered_map<TransferUid, Entry>;

  mutable std::mutex mu_;
  std::unordered_map<std::string, PerInitiator> table_;
  // Completed, not yet popped, oldest first: bounds memory when nobody pops.
  std::deque<std::pair<std::string, TransferUid>> completed_order_;
  size_t completed_ = 0;
  size_t max_completed_;
  // Transfers with some but not all parts arrived, oldest first (records of
  // ones completed or evicted meanwhile are skipped when they come up).
  std::deque<std::pair<std::string, TransferUid>> partial_order_;
  size_t partial_ = 0;
  size_t max_partial_;
  uint64_t dropped_ = 0;
};

}  // namespace mori_torch
