// Which copy stream (lane) of a device's pool a transfer goes to.
//
// The lane of the latest transfer again while nothing is in flight on it: a
// copy starts sooner on the stream that ran the previous one than on another
// (64 MiB between two processes on one H200: 0.953-0.964 of torch's copy_
// this way against 0.905-0.948 with each transfer on the next stream, about
// 2 us each; docs/BENCHMARK.md). When that lane is busy, an idle one from a
// rotating start (the next if all are busy), so transfers submitted together
// still run side by side.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>

namespace mori_torch {
namespace xgmi {

class LanePicker {
 public:
  explicit LanePicker(size_t lanes);

  // A lane for one transfer, counted in flight until Release(lane): once its
  // copies are done, or at once if nothing was enqueued on it.
  size_t Take();
  void Release(size_t lane);

  int InFlight(size_t lane) const { return in_flight_[lane].load(std::memory_order_acquire); }

 private:
  bool TakeIfIdle(size_t lane);

  const size_t n_;
  std::unique_ptr<std::atomic<int>[]> in_flight_;
  std::atomic<size_t> last_{0};  // the latest transfer's lane
  std::atomic<size_t> next_{1};  // where the search for an idle lane starts
};

}  // namespace xgmi
}  // namespace mori_torch
