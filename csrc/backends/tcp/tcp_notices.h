// Completion notices of reads (the initiator tells the target that a read's
// bytes have landed) wait up to notice_delay_us to ride on the next request
// to the same peer, in the same sendmsg just before it. Sent on their own,
// each costs the initiator a system call and the target a second event per
// read, handled just as the next request arrives (docs/BENCHMARK.md). A
// notice nobody takes goes out by itself when the delay ends (a LoopTimer),
// and all waiting ones when the peer closes. The target files a notice by
// the peer's key, whatever connection brings it.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/tcp/tcp_data_conn.h"
#include "core/loop_timer.h"

namespace mori_torch {
namespace tcp {

// notice_delay_us as configured, -1 resolved: 1000 us where the event loop
// spins after events, 0 where it sleeps. Measured (docs/BENCHMARK.md): with
// spinning loops a held notice takes 1.4-2.5 us off a 4 KiB read's p50; with
// sleeping ones it gains nothing where the polling thread receives, and costs
// 2-3 us where the loop does (a notice sent at once wakes the target's loop
// just before the initiator's next request arrives).
int64_t NoticeDelayUs(const TcpConfig& cfg, const EventLoop& loop);

class NoticeCourier {
 public:
  // `pick` returns a connection of the peer to send on (null once the peer
  // is closed); a notice's send deadline is op_timeout_ms from when it leaves.
  static std::shared_ptr<NoticeCourier> Make(EventLoop* loop, int64_t delay_us, int64_t op_timeout_ms,
                                             std::function<std::shared_ptr<DataConn>()> pick);
  NoticeCourier(const NoticeCourier&) = delete;
  NoticeCourier& operator=(const NoticeCourier&) = delete;

  // Keeps a notice until a request takes it or its delay ends. False once
  // closed: the caller sends it or lets it go.
  bool Hold(PartPtr notice);
  // The waiting notices, for the caller to send with its next request
  // (usually none: one atomic load).
  std::vector<PartPtr> Take();
  // Sends the waiting notices now on a connection `pick` gives.
  void Flush();
  // Stops the timer (waiting for a flush under way) and returns the waiting
  // notices, for the peer to send before its connections close; Hold
  // refuses from then on. A second call returns none at once.
  std::vector<PartPtr> Close();

 private:
  NoticeCourier(int64_t delay_us, int64_t op_timeout_ms, std::function<std::shared_ptr<DataConn>()> pick)
      : delay_us_(delay_us), op_timeout_ms_(op_timeout_ms), pick_(std::move(pick)) {}
  // mu_ held: takes the waiting notices, their deadlines counted from now.
  std::vector<PartPtr> TakeLocked();

  const int64_t delay_us_;
  const int64_t op_timeout_ms_;
  const std::function<std::shared_ptr<DataConn>()> pick_;
  std::shared_ptr<LoopTimer> timer_;  // set by Make
  std::mutex mu_;
  bool closed_ = false;
  std::vector<PartPtr> waiting_;
  std::atomic<bool> any_{false};  // waiting_ is not empty
};

}  // namespace tcp
}  // namespace mori_torch
