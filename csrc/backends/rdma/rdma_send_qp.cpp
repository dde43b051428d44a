#include "backends/rdma/rdma_send_qp.h"

#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/logging.h"

namespace mori_torch {
namespace rdma {
namespace {

std::atomic<int> g_fail_next_posts{0};  // FailNextPostedQpsForTest

std::string CompletionError(const VerbsApi* api, const ibv_wc& wc, const char* verb, const std::string& peer) {
  std::string m = std::string(verb) + " to engine '" + peer + "' failed: " + api->wc_status_str(wc.status) +
                  " (status " + std::to_string(static_cast<int>(wc.status)) + ", vendor error " +
                  std::to_string(wc.vendor_err) + ")";
  if (wc.status == IBV_WC_REM_ACCESS_ERR) {
    m += "; the remote memory was deregistered or the range lies outside its registration";
  } else if (wc.status == IBV_WC_RETRY_EXC_ERR) {
    m += "; the peer stopped answering (dead process, wrong GID or no route)";
  }
  return m;
}

}  // namespace

SendQp::SendQp(std::shared_ptr<RdmaDevice> dev, size_t rail, CompletionWorker* worker, uint32_t depth,
               std::string peer_key, int64_t inactivity_ms)
    : RdmaQp(std::move(dev), rail, worker, depth, 0),
      depth_(depth),
      peer_key_(std::move(peer_key)),
      inactivity_ms_(inactivity_ms),
      notices_(depth) {
  notice_mr_ =
      dev_->api->reg_mr(dev_->pd, notices_.data(), notices_.size() * sizeof(NoticeWire), IBV_ACCESS_LOCAL_WRITE);
  if (!notice_mr_) {
    throw Error(StatusCode::ERR_RDMA_OP,
                "RDMA (" + dev_->name + "): ibv_reg_mr of the notice buffers: " + std::strerror(errno));
  }
}

SendQp::~SendQp() {
  Close();
  if (notice_mr_) dev_->api->dereg_mr(notice_mr_);
}

void FailNextPostedQpsForTest(int n) { g_fail_next_posts.store(n); }

bool SendQp::Reserve(uint32_t n, Deadline deadline, std::string* why) {
  std::unique_lock<std::mutex> lk(mu_);
  auto fits = [&] { return broken_ || used_ + n <= depth_; };
  if (!fits()) {
    if (deadline == Deadline::max()) {
      room_.wait(lk, fits);
    } else {
      room_.wait_until(lk, deadline, fits);
    }
  }
  if (broken_) {
    *why = broken_reason_;
    return false;
  }
  if (used_ + n > depth_) {
    *why = "SQ full: no room for " + std::to_string(n) + " work requests on a QP to engine '" + peer_key_ +
           "' (depth " + std::to_string(depth_) + ", " + std::to_string(used_) + " in flight) within the " +
           "send-queue timeout";
    return false;
  }
  used_ += n;
  return true;
}

void SendQp::Unreserve(uint32_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  used_ -= n;
  room_.notify_all();
}

ibv_sge SendQp::Notice(uint64_t uid, uint32_t parts_total) {
  std::lock_guard<std::mutex> lk(mu_);
  // A ring of `depth` buffers: an entry is reused only after `depth` later
  // WRs were posted, which needs its own chain's slots freed first.
  NoticeWire& n = notices_[next_notice_++ % depth_];
  n = {kNoticeMagic, parts_total, uid};
  return ibv_sge{reinterpret_cast<uint64_t>(&n), sizeof n, notice_mr_->lkey};
}

bool SendQp::Post(ibv_send_wr* first, Chain* chain, std::string* why) {
  ibv_send_wr* last = first;
  for (ibv_send_wr* w = first; w; w = w->next) {
    w->wr_id = reinterpret_cast<uint64_t>(chain);
    last = w;
  }
  last->wr_id |= 1;  // the chain ends at this one's completion
  last->send_flags |= IBV_SEND_SIGNALED;
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) {
    *why = broken_reason_;
    return false;
  }
  if (outstanding_.empty()) {
    last_progress_ = Clock::now();  // the silence to judge starts now
    worker_->WorkPosted();
  }
  outstanding_.push_back(chain);
  ibv_send_wr* bad = nullptr;
  if (g_fail_next_posts.load(std::memory_order_relaxed) > 0 && g_fail_next_posts.fetch_sub(1) > 0) RdmaQp::Fail();
  int rc = ibv_post_send(qp_, first, &bad);
  if (rc == 0) return true;
  if (bad == first) {
    outstanding_.pop_back();
    *why = std::string("ibv_post_send to engine '") + peer_key_ + "': " + std::strerror(rc);
    return false;
  }
  // Part of the chain is on the wire without its signaled end: flush it all.
  chain->code = StatusCode::ERR_RDMA_OP;
  chain->path_failed = true;
  chain->msg = std::string("ibv_post_send to engine '") + peer_key_ + "' failed midway: " + std::strerror(rc);
  broken_ = true;
  broken_reason_ = chain->msg;
  room_.notify_all();
  RdmaQp::Fail();
  return true;
}

bool SendQp::path_broken() const {
  std::lock_guard<std::mutex> lk(mu_);
  return broken_ && broken_path_;
}

void SendQp::Break(const std::string& reason, bool path_failed) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!broken_) {
      broken_ = true;
      broken_path_ = path_failed;
      broken_reason_ = reason;
    }
    room_.notify_all();
  }
  RdmaQp::Fail();
}

void SendQp::OnCompletion(const ibv_wc& wc) {
  auto* c = reinterpret_cast<Chain*>(wc.wr_id & ~uint64_t{1});
  if (wc.status != IBV_WC_SUCCESS && c->code == StatusCode::SUCCESS) {
    c->code = StatusCode::ERR_RDMA_OP;
    // Errors of the request itself (keys, bounds, protection) are final;
    // the rest (flushed by a QP in error, retries exhausted) are the path's.
    c->path_failed = wc.status != IBV_WC_REM_ACCESS_ERR && wc.status != IBV_WC_REM_INV_REQ_ERR &&
                     wc.status != IBV_WC_LOC_PROT_ERR && wc.status != IBV_WC_LOC_LEN_ERR;
    bool first_failure = false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (broken_ && wc.status == IBV_WC_WR_FLUSH_ERR) {
        c->msg = std::string(c->xfer->verb) + " to engine '" + peer_key_ + "' aborted: " + broken_reason_;
        c->path_failed = broken_path_;
      } else {
        c->msg = CompletionError(dev_->api, wc, c->xfer->verb, peer_key_);
        first_failure = !broken_;
      }
    }
    if (first_failure && on_error_) on_error_(c->msg);
  }
  if (wc.wr_id & 1) Finish(c);
}

void SendQp::Finish(Chain* c) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!outstanding_.empty() && outstanding_.front() == c) {
      outstanding_.pop_front();
    } else {  // never expected: completions of one QP come in posting order
      for (auto it = outstanding_.begin(); it != outstanding_.end(); ++it) {
        if (*it == c) {
          outstanding_.erase(it);
          break;
        }
      }
    }
    used_ -= c->slots;
    last_progress_ = Clock::now();
    room_.notify_all();
  }
  c->xfer->tracker->PartDone(c->code, c->msg, c->path_failed);
  delete c;
}

bool SendQp::CheckProgress(Clock::time_point now) {
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_ || outstanding_.empty()) return false;
    const auto silent_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_progress_).count();
    if (silent_ms < inactivity_ms_) return true;
    why = "no work completion from engine '" + peer_key_ + "' for " + std::to_string(silent_ms) + " ms with " +
          std::to_string(outstanding_.size()) +
          " chain(s) in flight on a QP (RdmaBackendConfig.inactivity_timeout_ms=" + std::to_string(inactivity_ms_) +
          "): the path stalled and its connection is dropped";
  }
  MORI_LOG(Warning, "RDMA: " << why);
  if (on_error_) {
    on_error_(why);
  } else {
    Break(why);
  }
  return false;
}

bool SendQp::Idle() {
  std::lock_guard<std::mutex> lk(mu_);
  return outstanding_.empty();
}

void SendQp::OnClosed() {
  std::deque<Chain*> left;
  bool path;
  {
    std::lock_guard<std::mutex> lk(mu_);
    left.swap(outstanding_);
    if (!broken_) broken_path_ = true;  // closed under us: the path's failure
    path = broken_path_;
    broken_ = true;
    if (broken_reason_.empty()) broken_reason_ = "connection to engine '" + peer_key_ + "' closed";
    room_.notify_all();
  }
  for (Chain* c : left) {
    c->xfer->tracker->PartDone(
        StatusCode::ERR_RDMA_OP,
        std::string(c->xfer->verb) + " to engine '" + peer_key_ + "' did not complete: " + broken_reason_, path);
    delete c;
  }
}

}  // namespace rdma
}  // namespace mori_torch
