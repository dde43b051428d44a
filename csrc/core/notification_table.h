// Inbound completion notices on the target side: counts the finished parts of
// each (initiator key, uid) and hands the result out once, through Pop().
// Exactly once across retries (core/retry_driver.h): a part that names its
// index counts once however often it arrives, and a retried part (attempt >
// 0) of a transfer whose notice was already popped is a duplicate, not a new
// transfer (popped uids are remembered, boundedly, for that).
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
  explicit NotificationTable(size_t max_completed = 1 << 20, size_t max_partial = 1 << 16, size_t max_popped = 1 << 16)
      : max_completed_(max_completed), max_partial_(max_partial), max_popped_(max_popped) {}

  // Parts with an index below this are counted once each; others (and
  // kUnindexed) are counted every time they arrive.
  static constexpr uint32_t kIndexedParts = 64;
  static constexpr uint32_t kUnindexed = UINT32_MAX;

  // One part of transfer (initiator, uid) finished with its data in place;
  // the transfer has `parts_total` parts in all. `attempt` > 0: the part
  // belongs to a retry of the transfer, whose parts may differ from the
  // earlier attempt's (another backend).
  void Arrive(const std::string& initiator, TransferUid uid, uint32_t parts_total, uint32_t part_index = kUnindexed,
              uint16_t attempt = 0);
  // True once, when every part of (initiator, uid) has arrived; consumes it.
  bool Pop(const std::string& initiator, TransferUid uid);
  size_t CompletedCount() const;
  size_t PartialCount() const;
  uint64_t Dropped() const;

 private:
  struct Entry {
    uint32_t arrived = 0;
    uint32_t total = 0;
    uint64_t seen = 0;     // bit i: indexed part i arrived
    uint16_t attempt = 0;  // the latest attempt whose parts are counted
    bool popped = false;   // consumed; kept (boundedly) to refuse retried duplicates
  };
  bool IsLiveCompleted(const std::pair<std::string, TransferUid>& rec) const;
  void TrimStaleOrder();
  void EvictPartial();
  void EvictPopped();

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
  // Popped entries kept as tombstones, oldest first.
  std::deque<std::pair<std::string, TransferUid>> popped_order_;
  size_t max_popped_;
  uint64_t dropped_ = 0;
};

}  // namespace mori_torch
