#include "core/notification_table.h"

#include "core/logging.h"

namespace mori_torch {

void NotificationTable::Arrive(const std::string& initiator, TransferUid uid, uint32_t parts_total, uint32_t part_index,
                               uint16_t attempt) {
  std::lock_guard<std::mutex> lk(mu_);
  Entry& e = table_[initiator][uid];
  if (e.popped) {
    if (attempt > 0) return;  // a retry's copy of a notice already handed out
    e = Entry{};              // the uid used again for a new transfer
  }
  if (parts_total == 0) parts_total = 1;
  bool fresh = e.total == 0;
  if (fresh) {
    e.total = parts_total;
    e.attempt = attempt;
  }
  if (e.arrived >= e.total) return;  // duplicate part of a finished transfer
  if (attempt > e.attempt && parts_total != e.total) {
    // A retry over another backend, split differently: its parts replace the
    // earlier attempt's (whose missing ones will never come: they failed).
    e.total = parts_total;
    e.arrived = 0;
    e.seen = 0;
  }
  if (attempt > e.attempt) e.attempt = attempt;
  if (part_index < kIndexedParts) {
    const uint64_t bit = uint64_t{1} << part_index;
    if (e.seen & bit) return;  // this part arrived before (an earlier attempt's copy)
    e.seen |= bit;
  }
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
    MORI_LOG(Warning,
             "notice table: too many unfinished transfers; dropped (" << old.first << ", " << old.second << ")");
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
  return jt != it->second.end() && !jt->second.popped && jt->second.arrived >= jt->second.total;
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
  if (jt == it->second.end() || jt->second.popped || jt->second.arrived < jt->second.total) return false;
  jt->second.popped = true;
  --completed_;
  popped_order_.emplace_back(initiator, uid);
  EvictPopped();
  TrimStaleOrder();
  return true;
}

void NotificationTable::EvictPopped() {
  while (popped_order_.size() > max_popped_) {
    auto old = std::move(popped_order_.front());
    popped_order_.pop_front();
    auto it = table_.find(old.first);
    if (it == table_.end()) continue;
    auto jt = it->second.find(old.second);
    if (jt == it->second.end() || !jt->second.popped) continue;  // reused since
    it->second.erase(jt);
    if (it->second.empty()) table_.erase(it);
  }
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
