#include "core/notification_table.h"

#include "core/logging.h"

namespace mori_torch {

void NotificationTable::Arrive(const std::string& initiator, TransferUid uid, uint32_t parts_total) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry& e = table_[initiator][uid];
  const bool fresh = e.total == 0;
  if (fresh) e.total = parts_total == 0 ? 1 : parts_total;
  if (e.arrived >= e.total) return;  // duplicate part of a finished transfer
  if (++e.arrived < e.total) {
    if (fresh) {
      ++partial_;
      partial_order_.emplace_back(initiator, uid);
      EvictPartial();
    }
    return;
  }
  if (!fresh) --partial_;
  ++completed_;
  completed_order_.emplace_back(initiator, uid);
  // Evict the oldest unclaimed notices past the bound. Entries already popped
  // are skipped as their order records come up.
  while (completed_ > max_completed_ && !completed_order_.empty()) {
    auto old = std::move(completed_order_.front());
    completed_order_.pop_front();
    if (!IsLiveCompleted(old)) continue;
    auto it = table_.find(old.first);
    it->second.erase(old.second);
    if (it->second.empty()) table_.erase(it);
    --completed_;
    ++dropped_;
    MORI_LOG(Warning, "notice table full: dropped unclaimed notice (" << old.first << ", " << old.second << ")");
  }
  TrimStaleOrder();
}

void NotificationTable::EvictPartial() {
  while (partial_ > max_partial_ && !partial_order_.empty()) {
    auto old = std::move(partial_order_.front());
    partial_order_.pop_front();
    auto it = table_.find(old.first);
    if (it == table_.end()) continue;
    auto jt = it->second.find(old.second);
    if (jt == it->second.end() || jt->second.arrived >= jt->second.total) continue;  // completed since
    it->second.erase(jt);
    if (it->second.empty()) table_.erase(it);
    --partial_;
    ++dropped_;
    MORI_LOG(Warning, "notice table: too many unfinished transfers; dropped (" << old.first << ", " << old.second
                                                                               << ")");
  }
  // Records of transfers that completed since keep the queue from shrinking:
  // drop those from the front.
  while (!partial_order_.empty()) {
    auto it = table_.find(partial_order_.front().first);
    if (it != table_.end()) {
      auto jt = it->second.find(partial_order_.front().second);
      if (jt != it->second.end() && jt->second.arrived < jt->second.total) break;
    }
    partial_order_.pop_front();
  }
}

bool NotificationTable::IsLiveCompleted(const std::pair<std::string, TransferUid>& rec) const {
  auto it = table_.find(rec.first);
  if (it == table_.end()) return false;
  auto jt = it->second.find(rec.second);
  return jt != it->second.end() && jt->second.arrived >= jt->second.total;
}

void NotificationTable::TrimStaleOrder() {
  // Popped notices leave their order record behind; drop those from the front
  // so the order queue stays as long as the unclaimed notices (pops are
  // mostly in order).
  while (!completed_order_.empty() && !IsLiveCompleted(completed_order_.front())) completed_order_.pop_front();
}

bool NotificationTable::Pop(const std::string& initiator, TransferUid uid) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(initiator);
  if (it == table_.end()) return false;
  auto jt = it->second.find(uid);
  if (jt == it->second.end() || jt->second.arrived < jt->second.total) return false;
  it->second.erase(jt);
  --completed_;
  if (it->second.empty()) table_.erase(it);
  TrimStaleOrder();
  return true;
}

size_t NotificationTable::PartialCount() const {
  std::lock_guard<std::mutex> lk(mu_);
  return partial_;
}

uint64_t NotificationTable::Dropped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return dropped_;
}

size_t NotificationTable::CompletedCount() const {
  std::lock_guard<std::mutex> lk(mu_);
  return completed_;
}

}  // namespace mori_torch
