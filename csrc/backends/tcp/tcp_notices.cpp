#include "backends/tcp/tcp_notices.h"

#include <utility>

namespace mori_torch {
namespace tcp {

std::shared_ptr<NoticeCourier> NoticeCourier::Make(EventLoop* loop, int64_t delay_us) {
  std::shared_ptr<NoticeCourier> c(new NoticeCourier(delay_us));
  std::weak_ptr<NoticeCourier> weak = c;
  c->timer_ = LoopTimer::Make(loop, [weak] {
    if (auto self = weak.lock()) self->Flush();
  });
  return c;
}

bool NoticeCourier::Hold(PartPtr notice, const std::shared_ptr<DataConn>& conn) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return false;
  waiting_.push_back(std::move(notice));
  carrier_ = conn;
  any_.store(true, std::memory_order_release);
  timer_->ArmIfIdle(delay_us_);  // under mu_: never after Close stopped it
  return true;
}

std::vector<PartPtr> NoticeCourier::Take() {
  std::vector<PartPtr> out;
  if (!any_.load(std::memory_order_acquire)) return out;
  std::lock_guard<std::mutex> lk(mu_);
  out.swap(waiting_);
  any_.store(false, std::memory_order_relaxed);
  return out;
}

void NoticeCourier::Flush() {
  std::vector<PartPtr> out;
  std::shared_ptr<DataConn> conn;
  {
    std::lock_guard<std::mutex> lk(mu_);
    out.swap(waiting_);
    any_.store(false, std::memory_order_relaxed);
    conn = carrier_.lock();
    carrier_.reset();
  }
  if (out.empty()) return;
  // Gone or broken: the notices go with it, as they would have had they
  // been sent on it at once.
  if (!conn) return;
  PartPtr first = std::move(out.front());
  out.erase(out.begin());
  conn->Enqueue(std::move(first), std::move(out));
}

void NoticeCourier::Close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
  }
  Flush();
  timer_->Stop();
}

}  // namespace tcp
}  // namespace mori_torch
