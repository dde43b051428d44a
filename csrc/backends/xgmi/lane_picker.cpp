#include "backends/xgmi/lane_picker.h"

#include "base/error.h"

namespace mori_torch {
namespace xgmi {

LanePicker::LanePicker(size_t lanes) : n_(lanes), in_flight_(new std::atomic<int>[lanes]) {
  if (lanes == 0) throw Error(StatusCode::ERR_INVALID_ARGS, "LanePicker: a pool of 0 lanes");
  for (size_t i = 0; i < n_; ++i) in_flight_[i].store(0, std::memory_order_relaxed);
}

bool LanePicker::TakeIfIdle(size_t lane) {
  int idle = 0;
  return in_flight_[lane].compare_exchange_strong(idle, 1, std::memory_order_acq_rel);
}

size_t LanePicker::Take() {
  // Idle lanes are taken in one step (0 -> 1): of two transfers racing for
  // one, the other looks further.
  const size_t last = last_.load(std::memory_order_relaxed);
  if (TakeIfIdle(last)) return last;
  const size_t start = next_.fetch_add(1, std::memory_order_relaxed);
  size_t pick = n_;
  for (size_t k = 0; k < n_ && pick == n_; ++k) {
    const size_t i = (start + k) % n_;
    if (TakeIfIdle(i)) pick = i;
  }
  if (pick == n_) {  // all busy: queue behind the start lane
    pick = start % n_;
    in_flight_[pick].fetch_add(1, std::memory_order_acq_rel);
  }
  last_.store(pick, std::memory_order_relaxed);
  return pick;
}

void LanePicker::Release(size_t lane) { in_flight_[lane].fetch_sub(1, std::memory_order_acq_rel); }

}  // namespace xgmi
}  // namespace mori_torch
