// Completion notices of reads (the initiator tells the target that a read's
// bytes have landed) wait up to notice_delay_us to ride on the next request
// to the same peer, in the same sendmsg just before it. Sent on their own,
// each costs the initiator a system call before its poll returns and the
// target a second event per read, handled just as the next request arrives
// (measured: 2.8 us of a 4 KiB read's p50 where loops spin, 8 us where they
// sleep; docs/BENCHMARK.md). A notice nobody takes goes out by itself when
// the delay ends (a LoopTimer), and all waiting ones when the peer closes.
// The target files a notice by the peer's key, whatever connection brings it.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "backends/tcp/tcp_data_conn.h"
#include "core/loop_timer.h"

namespace mori_torch {
namespace tcp {

class NoticeCourier : public std::enable_shared_from_this<NoticeCourier> {
 public:
  static std::shared_ptr<NoticeCourier> Make(EventLoop* loop, int64_t delay_us);
  NoticeCourier(const NoticeCourier&) = delete;
  NoticeCourier& operator=(const NoticeCourier&) = delete;

  // From the thread that read the response on `conn` (which may carry the
  // notice if no request does). False once closed: the caller sends it.
  bool Hold(PartPtr notice, const std::shared_ptr<DataConn>& conn);
  // The waiting notices, for the caller to send with its next request
  // (usually none: one atomic load).
  std::vector<PartPtr> Take();
  // Sends the waiting notices now, on the connection of the latest.
  void Flush();
  // Flushes and stops the timer; Hold refuses from then on. Idempotent.
  void Close();

 private:
  explicit NoticeCourier(int64_t delay_us) : delay_us_(delay_us) {}

  const int64_t delay_us_;
  std::shared_ptr<LoopTimer> timer_;  // set by Make
  std::mutex mu_;
  bool closed_ = false;
  std::vector<PartPtr> waiting_;
  std::weak_ptr<DataConn> carrier_;  // the connection of the latest waiting notice
  std::atomic<bool> any_{false};     // waiting_ is not empty
};

}  // namespace tcp
}  // namespace mori_torch
