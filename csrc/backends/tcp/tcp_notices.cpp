#include "backends/tcp/tcp_notices.h"

#include <utility>

namespace mori_torch {
namespace tcp {

int64_t NoticeDelayUs(const TcpConfig& cfg, const EventLoop& loop) {
  constexpr int64_t kWhereLoopsSpinUs = 1000;
  if (cfg.notice_delay_us >= 0) return cfg.notice_delay_us;
  return loop.Spins() ? kWhereLoopsSpinUs : 0;
}

std::shared_ptr<NoticeCourier> NoticeCourier::Make(EventLoop* loop, int64_t delay_us, int64_t op_timeout_ms,
                                                   std::function<std::shared_ptr<DataConn>()> pick) {
  std::shared_ptr<NoticeCourier> c(new NoticeCourier(delay_us, op_timeout_ms, std::move(pick)));
  std::weak_ptr<NoticeCourier> weak = c;
  c->timer_ = LoopTimer::Make(loop, [weak] {
    if (auto self = weak.lock()) self->Flush();
  });
  return c;
}

bool NoticeCourier::Hold(PartPtr notice) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return false;
  waiting_.push_back(std::move(notice));
  any_.store(true, std::memory_order_release);
  timer_->ArmIfIdle(delay_us_);  // under mu_: never after Close stopped it
  return true;
}

std::vector<PartPtr> NoticeCourier::TakeLocked() {
  std::vector<PartPtr> out;
  out.swap(waiting_);
  any_.store(false, std::memory_order_relaxed);
  // A held notice's send bound starts when it leaves (a batch's bound is its
  // first part's, and notices go first).
  const Deadline deadline = DeadlineAfterMs(op_timeout_ms_);
  for (auto& n : out) n->deadline = deadline;
  return out;
}

std::vector<PartPtr> NoticeCourier::Take() {
  if (!any_.load(std::memory_order_acquire)) return {};
  std::lock_guard<std::mutex> lk(mu_);
  return TakeLocked();
}

void NoticeCourier::Flush() {
  std::vector<PartPtr> out;
  {
    std::lock_guard<std::mutex> lk(mu_);
    out = TakeLocked();
  }
  if (out.empty()) return;
  // Null only once the peer closed, and its Close stops this timer first:
  // the peer sends what Close hands it.
  if (std::shared_ptr<DataConn> conn = pick_()) conn->EnqueueNotices(std::move(out));
}

std::vector<PartPtr> NoticeCourier::Close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return {};
    closed_ = true;
  }
  timer_->Stop();  // a flush under way ends first
  std::lock_guard<std::mutex> lk(mu_);
  return TakeLocked();
}

}  // namespace tcp
}  // namespace mori_torch
