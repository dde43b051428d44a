#include "backends/tcp/tcp_data_conn.h"

#include <cstring>

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>

#include "backends/tcp/tcp_inline.h"
#include "backends/tcp/tcp_notices.h"
#include "backends/tcp/tcp_staged_io.h"
#include "core/logging.h"
#include "core/retry_driver.h"

namespace mori_torch {
namespace tcp {
namespace {

// Requests coalesced into one sendmsg loop: enough to amortize system calls
// for small transfers, small enough to keep latency fair.
constexpr size_t kMaxPartsPerSend = 64;
constexpr uint64_t kMaxBytesPerSend = 8u << 20;

}  // namespace

void AppendIovecs(char* base, SegmentSpan segs, bool local_side, std::vector<iovec>* iov) {
  for (const auto& s : segs) {
    if (s.size == 0) continue;
    char* p = base + (local_side ? s.local_off : s.remote_off);
    if (!iov->empty()) {
      iovec& b = iov->back();
      if (static_cast<char*>(b.iov_base) + b.iov_len == p) {
        b.iov_len += s.size;
        continue;
      }
    }
    iov->push_back({p, s.size});
  }
}

void AppendPadding(uint64_t n, std::vector<iovec>* iov) {
  if (uint64_t pad = WirePad(n)) iov->push_back({const_cast<char*>(WireZeros()), pad});
}

DataConn::DataConn(std::function<Socket()> connect, std::string peer_key, const TcpConfig& cfg,
                   std::shared_ptr<gpu::StagingPool> staging, DataConnWorkers workers,
                   std::shared_ptr<NoticeCourier> courier)
    : connect_(std::move(connect)),
      peer_key_(std::move(peer_key)),
      cfg_(cfg),
      staging_(std::move(staging)),
      workers_(std::move(workers)),
      courier_(std::move(courier)) {}

DataConn::~DataConn() {
  // No job runs any more (each holds a reference).
  Break("connection closed");
  staging_->Give(std::move(send_staging_));
  staging_->Give(std::move(recv_staging_));
}

bool DataConn::Broken() const {
  std::lock_guard<std::mutex> lk(mu_);
  return broken_;
}

bool DataConn::Ready() const {
  std::lock_guard<std::mutex> lk(mu_);
  return connected_ && !broken_;
}

bool DataConn::Usable() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) return false;
    if (!connected_ || !send_q_.empty() || !inflight_.empty()) return true;
    // Checked under mu_: nothing can be sent meanwhile, so no response can
    // be what makes the socket readable.
    pollfd p{sock_.fd(), POLLIN, 0};
    if (::poll(&p, 1, 0) == 0) return true;
  }
  Break("connection closed by the peer while idle", StatusCode::ERR_BAD_STATE, /*path_failed=*/true);
  return false;
}

void DataConn::SchedulePostLocked() {
  if (send_scheduled_ || broken_) return;
  send_scheduled_ = true;
  auto self = shared_from_this();
  if (!workers_.senders->Post([self] { self->SendJob(); })) send_scheduled_ = false;
}

bool DataConn::SmallForInline(const Part& p) const {
  return p.op == Op::Notice || (p.total <= static_cast<uint64_t>(cfg_.inline_max_bytes) && !OnGpu(p.local->desc) &&
                                p.segs.size() <= kInlineMaxSegments && p.attempt == 0);
}

bool DataConn::SendInlineLocked(const Part& p) {
  if (!connected_ || send_scheduled_ || !send_q_.empty() || cfg_.inline_max_bytes == 0 || !SmallForInline(p)) {
    return false;
  }
  return room_.Fits(RequestWireBytes(p.op, p.segs.size(), p.total));
}

void DataConn::Enqueue(PartPtr p, std::vector<PartPtr> notices, bool counted) {
  bool stopped = false;
  bool send_here = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!broken_) {
      send_here = SendInlineLocked(*p);
      // Notices first: a few bytes the target files at once, never stuck
      // behind a large payload.
      notices_unsent_ += notices.size() + (p->op == Op::Notice && !counted ? 1 : 0);
      for (auto& n : notices) send_q_.push_back(std::move(n));
      notices.clear();
      send_q_.push_back(std::move(p));
      if (send_here) {
        send_scheduled_ = true;  // this thread takes the sender's turn
      } else {
        SchedulePostLocked();
        if (send_scheduled_) return;
        stopped = true;  // the workers are gone: the backend shut down
      }
    }
  }
  if (send_here) return SendQueued(/*max_batches=*/1);
  if (stopped) {
    Break("the TCP backend's workers have stopped");  // hands back what was queued
    return;
  }
  // Broken: notices go back to the courier; a request fails.
  if (counted) {
    std::lock_guard<std::mutex> lk(mu_);
    --notices_unsent_;
  }
  if (p->op == Op::Notice) notices.push_back(std::move(p));
  HandBack(std::move(notices));
  if (!p) return;
  bool path;
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu_);
    path = broken_path_;
    why = broken_reason_;
  }
  Complete(*p, StatusCode::ERR_BAD_STATE, "TCP connection to engine '" + peer_key_ + "' is broken: " + why, path);
}

void DataConn::EnqueueNotices(std::vector<PartPtr> notices) {
  if (notices.empty()) return;
  PartPtr last = std::move(notices.back());
  notices.pop_back();
  Enqueue(std::move(last), std::move(notices));
}

void DataConn::Complete(Part& p, StatusCode code, const std::string& msg, bool path_failed) {
  // p.use belongs to the send job, which releases it itself.
  if (p.tracker) p.tracker->PartDone(code, msg, path_failed);
}

void DataConn::BreakOnIo(const IoResult& r, const std::string& timeout_what) {
  if (r.timed_out) {
    Break(timeout_what + ": " + r.error + " (op_timeout_ms=" + std::to_string(cfg_.op_timeout_ms) +
          ", inactivity_timeout_ms=" + std::to_string(cfg_.inactivity_timeout_ms) + ")");
  } else {
    Break(r.error, StatusCode::ERR_BAD_STATE, /*path_failed=*/true);
  }
}

bool DataConn::Unbusy(Part& p) { return --p.busy == 0 && p.has_result; }

bool DataConn::DeferIfBusy(Part& p, StatusCode code, const std::string& msg, bool path_failed) {
  if (p.busy == 0) return false;
  if (!p.has_result) {
    p.has_result = true;
    p.result_code = code;
    p.result_msg = msg;
    p.result_path_failed = path_failed;
  }
  return true;
}

void DataConn::Break(const std::string& reason, StatusCode code, bool path_failed) {
  const std::string msg = "TCP connection to engine '" + peer_key_ + "' failed: " + reason;
  std::deque<PartPtr> failed;
  std::vector<PartPtr> unsent_notices;  // not requests: nothing to fail, nothing to fence
  bool watched = false;
  size_t deferred = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) return;
    broken_ = true;
    broken_path_ = path_failed;
    broken_reason_ = reason;
    for (auto& p : inflight_) {
      if (DeferIfBusy(*p, code, msg, path_failed)) {
        ++deferred;
      } else {
        failed.push_back(std::move(p));
      }
    }
    inflight_.clear();
    for (auto& p : send_q_) {
      if (p->op == Op::Notice) {
        --notices_unsent_;
        unsent_notices.push_back(std::move(p));
      } else {
        failed.push_back(std::move(p));
      }
    }
    send_q_.clear();
    watched = watched_;
    watched_ = false;
  }
  // Off the loop before the socket can close (and its number be reused).
  if (watched) workers_.loop->Remove(sock_.fd());
  {
    // With requests outstanding, reset, not just shut down: the target must
    // see the abort before it receives anything more into registered memory
    // (tcp_protocol.h, fence), even when its receive buffer is full and a FIN
    // would queue behind data. With none (every request was answered), a
    // plain close.
    std::lock_guard<std::mutex> lk(mu_);
    if (failed.empty()) {
      sock_.Shutdown();
    } else {
      sock_.Abort();
    }
  }
  if (!failed.empty() || deferred) {
    MORI_LOG(Warning, "TCP connection to engine '" << peer_key_ << "' broke (" << reason << "); failing "
                                                   << failed.size() + deferred << " request(s)");
  }
  for (auto& p : failed) Complete(*p, code, msg, path_failed);
  HandBack(std::move(unsent_notices));
}

void DataConn::HandBack(std::vector<PartPtr> notices) {
  if (!courier_) return;
  for (auto& n : notices) {
    if (n->rehomed) continue;
    n->rehomed = true;
    if (!courier_->Hold(std::move(n))) return;  // closed: the peer is going away
  }
}

void DataConn::DrainNotices(int64_t max_ms) {
  const Deadline until = DeadlineAfterMs(max_ms);
  while (true) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (broken_ || notices_unsent_ == 0) return;
    }
    if (Clock::now() >= until) return;
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // only on the way out
  }
}

bool DataConn::Prepare(Part& p) {
  if (p.op == Op::Write) {
    p.use = MemoryUse(p.local);
    if (!p.use) {
      Complete(p, StatusCode::ERR_NOT_FOUND,
               "local memory " + std::to_string(p.local->desc.id) + " was deregistered before the write was sent");
      return false;
    }
  }
  if (p.op != Op::Notice && OnGpu(p.local->desc)) {
    auto& st = p.op == Op::Write ? send_staging_ : recv_staging_;
    try {
      if (!st) st = staging_->Take(p.local->desc.device_id);
    } catch (const Error& e) {
      p.use.reset();
      Complete(p, StatusCode::ERR_GPU_OP, std::string("TCP staging buffers for GPU memory: ") + e.what());
      return false;
    }
  }
  p.hdr.magic = kRequestMagic;
  p.hdr.op = static_cast<uint8_t>(p.op);
  p.hdr.flags = p.notify ? kFlagNotify : 0;
  p.hdr.attempt = p.attempt;
  p.hdr.part_index = p.part_index;
  p.hdr.req_id = next_req_id_++;
  p.hdr.uid = p.uid;
  p.hdr.mem_id = p.mem_id;
  p.hdr.total_bytes = p.total;
  p.hdr.num_segs = static_cast<uint32_t>(p.segs.size());
  p.hdr.parts_total = p.parts_total;
  p.hdr.incarnation = p.incarnation;
  std::memcpy(p.hdr.token, p.token.data(), sizeof(p.hdr.token));
  p.table.resize(p.segs.size());
  for (size_t i = 0; i < p.segs.size(); ++i) p.table[i] = {p.segs[i].remote_off, p.segs[i].size};
  return true;
}

bool DataConn::Connect() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (connected_) return true;
  }
  Socket s;
  try {
    s = connect_();
  } catch (const Error& e) {
    Break(e.what(), e.code(), IsPathError(e));  // ERR_NOT_FOUND "engine restarted" stays that
    return false;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) return false;
  sock_ = std::move(s);
  reader_.Attach(sock_.fd());
  room_.Attach(sock_.fd());
  connected_ = true;
  progress_ms_.store(SteadyMs());
  // Responses are awaited on the event loop; its idle reports (at least once
  // a second) check the timeouts of the request at the head.
  std::weak_ptr<DataConn> weak = shared_from_this();
  try {
    workers_.loop->Add(sock_.fd(), EPOLLIN | EPOLLRDHUP, std::min<int64_t>(cfg_.inactivity_timeout_ms, 1000),
                       [weak](uint32_t ev) {
                         if (auto self = weak.lock()) self->OnSocketEvent(ev);
                       });
  } catch (const Error& e) {
    broken_reason_ = e.what();
    return false;  // the caller breaks it
  }
  watched_ = true;
  return true;
}

void DataConn::SendJob() {
  if (!Connect()) {
    std::string why;
    {
      std::lock_guard<std::mutex> lk(mu_);
      why = broken_reason_.empty() ? "connect failed" : broken_reason_;
    }
    Break(why);
    return;
  }
  SendQueued(/*max_batches=*/-1);
}

void DataConn::SendQueued(int max_batches) {
  std::vector<PartPtr> batch;
  for (int batches = 0;; ++batches) {
    batch.clear();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (broken_ || send_q_.empty()) {
        send_scheduled_ = false;  // Enqueue schedules the next job
        return;
      }
      if (batches == max_batches) {
        // More came meanwhile: a send job takes over (the turn stays taken).
        auto self = shared_from_this();
        if (workers_.senders->Post([self] { self->SendQueued(-1); })) return;
        send_scheduled_ = false;
        break;  // the workers are gone: broken below
      }
      uint64_t bytes = 0, wire = 0;
      // The submitting thread (or the loop, sending a notice) must not wait:
      // it takes only small parts that fit the send buffer now, together
      // (SendInlineLocked checked the first alone; others may have come since).
      const bool here = max_batches >= 0;
      auto fits_here = [&](const Part& p) {
        return SmallForInline(p) && room_.Fits(wire + RequestWireBytes(p.op, p.segs.size(), p.total));
      };
      while (!send_q_.empty() && batch.size() < kMaxPartsPerSend && bytes < kMaxBytesPerSend &&
             (!here || fits_here(*send_q_.front()))) {
        PartPtr p = std::move(send_q_.front());
        wire += RequestWireBytes(p->op, p->segs.size(), p->total);
        send_q_.pop_front();
        if (!Prepare(*p)) continue;
        bytes += p->op == Op::Write ? p->total : 0;
        if (p->op == Op::Write) ++p->busy;
        if (p->op != Op::Notice) inflight_.push_back(p);  // notices get no response
        batch.push_back(std::move(p));
      }
    }
    if (batch.empty()) continue;
    IoResult r = SendBatch(batch);
    std::vector<PartPtr> ended;  // answered (or failed) while they were being sent
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& p : batch) {
        p->use.reset();
        if (p->op == Op::Write && Unbusy(*p)) ended.push_back(p);
        if (p->op == Op::Notice) --notices_unsent_;
      }
    }
    for (auto& p : ended) Complete(*p, p->result_code, p->result_msg, p->result_path_failed);
    if (!r.ok) {
      BreakOnIo(r, "send timed out");
      std::lock_guard<std::mutex> lk(mu_);
      send_scheduled_ = false;
      return;
    }
  }
  Break("the TCP backend's workers have stopped");
}

IoResult DataConn::SendBatch(const std::vector<PartPtr>& batch) {
  std::vector<iovec> iov;
  const IoDeadline deadline = Bound(*batch.front());
  for (auto& p : batch) room_.Wrote(RequestWireBytes(p->op, p->table.size(), p->total));  // on failure the conn breaks
  for (auto& p : batch) {
    iov.push_back({&p->hdr, sizeof(p->hdr)});
    if (!p->table.empty()) iov.push_back({p->table.data(), p->table.size() * sizeof(WireSegment)});
    AppendPadding(sizeof(p->hdr) + p->table.size() * sizeof(WireSegment), &iov);
    if (p->op != Op::Write) continue;
    if (OnGpu(p->use->desc)) {
      // Headers so far go out first; the payload follows through staging.
      IoResult r = WriteVFull(sock_.fd(), iov, deadline);
      iov.clear();
      if (!r.ok) return r;
      r = SendStaged(sock_.fd(), *send_staging_,
                     {p->use->desc.data, p->use->desc.device_id, &p->segs, /*local_side=*/true}, deadline);
      if (!r.ok) return r;
    } else {
      AppendIovecs(p->use->Base(), p->segs, true, &iov);
    }
    AppendPadding(p->total, &iov);
  }
  return WriteVFull(sock_.fd(), iov, deadline);
}

bool DataConn::ResponseReadyInline() {
  PartPtr head;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_ || inflight_.empty() || cfg_.inline_max_bytes == 0) return false;
    head = inflight_.front();
  }
  if (head->op == Op::Read && !SmallForInline(*head)) return false;
  ResponseHeader rh;
  if (!reader_.Ready(sizeof(rh), &progress_ms_)) return false;
  std::memcpy(&rh, reader_.data(), sizeof(rh));
  if (rh.magic != kResponseMagic || rh.payload_bytes > static_cast<uint64_t>(cfg_.inline_max_bytes)) return false;
  return reader_.Ready(WireRound(sizeof(rh) + rh.msg_len) + WireRound(rh.payload_bytes), &progress_ms_);
}

void DataConn::OnSocketEvent(uint32_t events) {
  if (events != EventLoop::kIdle) {
    // Set before trying: a poller that holds the socket sees it when it
    // lets go, and re-arms the watch (DoneReading).
    event_pending_.store(true);
    if (reading_.exchange(true)) return;
    event_pending_.store(false);
    // Whole responses of small requests are read here (tcp_inline.h); the
    // rest, a hang-up or stray bytes go to a receive job.
    if (!ReceiveReadyResponses()) return;
    if (!reader_.MoreNow()) return DoneReading(/*rearm=*/true);
    return PostRecvJob();
  }
  // Bytes the peer acknowledged count as progress too: a request sent whole
  // into the socket buffer still drains over a slow link.
  const size_t unsent = BytesUnsent(sock_.fd());
  if (unsent != last_unsent_) {
    last_unsent_ = unsent;
    progress_ms_.store(SteadyMs());
  }
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) return;
    if (!inflight_.empty()) {
      if (Clock::now() >= inflight_.front()->deadline) {
        why = "no response within op_timeout_ms=" + std::to_string(cfg_.op_timeout_ms);
      } else if (SteadyMs() - progress_ms_.load() >= cfg_.inactivity_timeout_ms) {
        why = "no progress for " + std::to_string(cfg_.inactivity_timeout_ms) + " ms (inactivity_timeout_ms)";
      }
    }
  }
  if (!why.empty()) return Break(why);
  workers_.loop->Rearm(sock_.fd(), EPOLLIN | EPOLLRDHUP);
}

void DataConn::RecvJob() {
  do {
    bool idle;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (broken_) return;
      idle = inflight_.empty();
    }
    if (idle) {
      // Bytes (or a hang-up) with no request outstanding (a request is in
      // flight before its first byte is sent): the peer closed the
      // connection or broke the protocol.
      char c;
      ssize_t n = reader_.buffered() > 0 ? 1 : ::recv(sock_.fd(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
      const int err = errno;
      if (n < 0 && (err == EAGAIN || err == EWOULDBLOCK)) break;  // a spurious report
      if (n > 0) {
        Break("protocol error: bytes with no request outstanding");
      } else {  // closed or reset: the path's failure
        Break(n == 0 ? std::string("connection closed by the peer while idle")
                     : "connection failed while idle: " + std::string(std::strerror(err)),
              StatusCode::ERR_BAD_STATE, /*path_failed=*/true);
      }
      return;
    }
    if (!ReceiveOne()) return;
  } while (reader_.MoreNow());
  DoneReading(/*rearm=*/true);
}

bool DataConn::ReceiveReadyResponses() {
  reader_.NewEvent();  // whatever came since anyone last looked (the loop below may not ask the socket)
  for (int n = 0; n < kInlineMaxPerEvent && ResponseReadyInline(); ++n) {
    if (!ReceiveOne()) return false;
  }
  return true;
}

void DataConn::PostRecvJob() {
  auto self = shared_from_this();
  if (!workers_.receivers->Post([self] { self->RecvJob(); })) Break("the TCP backend's workers have stopped");
}

void DataConn::DoneReading(bool rearm) {
  reading_.store(false);
  if (event_pending_.exchange(false)) rearm = true;
  if (!rearm) return;
  // Under mu_ and only while not broken: a poller may get here on a user
  // thread as the engine shuts down, and Break (which comes first there)
  // takes the socket off the loop before the loop goes away.
  std::lock_guard<std::mutex> lk(mu_);
  if (!broken_) workers_.loop->Rearm(sock_.fd(), EPOLLIN | EPOLLRDHUP);
}

void DataConn::ReceiveForCaller() {
  {
    // Nothing to read before the socket is connected (Connect attaches the
    // reader under mu_) or with no request outstanding.
    std::lock_guard<std::mutex> lk(mu_);
    if (!connected_ || broken_ || inflight_.empty()) return;
  }
  if (reading_.load(std::memory_order_relaxed) || reading_.exchange(true)) return;
  try {
    if (!ReceiveReadyResponses()) return;  // broken: nobody reads it again
    if (reader_.buffered() == 0) return DoneReading(/*rearm=*/false);
    // Bytes taken from the socket that no event will report again (more
    // responses, or one not whole yet): a receive job reads on, as after a
    // loop event.
    PostRecvJob();
  } catch (...) {
    // The poller's caller carries on (a status poll swallows it); the
    // socket it held must not stay owned with its requests unanswered.
    Break("receiving on a polling thread failed");
    throw;
  }
}

bool DataConn::ReceiveOne() {
  std::vector<iovec>& iov = recv_iov_;
  std::string& msg = recv_msg_;
  PartPtr head;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_ || inflight_.empty()) return false;
    head = inflight_.front();
    if (head->op == Op::Read) ++head->busy;  // its payload lands in the caller's buffer
  }
  // On every way out: done with the read buffer; a result that came
  // meanwhile (a break) is delivered now.
  struct Unbusier {
    DataConn* c;
    Part* p;
    ~Unbusier() {
      if (!p || p->op != Op::Read) return;
      bool deliver;
      {
        std::lock_guard<std::mutex> lk(c->mu_);
        deliver = Unbusy(*p);
      }
      if (deliver) c->Complete(*p, p->result_code, p->result_msg, p->result_path_failed);
    }
  } unbusier{this, head.get()};
  const IoDeadline bound = Bound(*head);
  // A response is at least kWireAlign bytes: its first ones hold the
  // header and the start of the message (or padding).
  alignas(8) char first[kWireAlign];
  IoResult r = reader_.ReadFull(first, sizeof(first), bound);
  if (!r.ok) {
    BreakOnIo(r, "no response");
    return false;
  }
  ResponseHeader rh;
  std::memcpy(&rh, first, sizeof(rh));
  if (rh.magic != kResponseMagic || rh.req_id != head->hdr.req_id || rh.msg_len > kMaxMessageBytes) {
    Break("protocol error: unexpected response (magic, request id or length)");
    return false;
  }
  constexpr size_t kFirstMsg = sizeof(first) - sizeof(rh);
  msg.assign(first + sizeof(rh), kFirstMsg);
  msg.resize(WireRound(sizeof(rh) + rh.msg_len) - sizeof(rh));  // message and padding
  r = reader_.ReadFull(&msg[0] + kFirstMsg, msg.size() - kFirstMsg, bound);
  msg.resize(rh.msg_len);
  auto code = static_cast<StatusCode>(rh.code);
  if (r.ok && code == StatusCode::SUCCESS && head->op == Op::Read) {
    if (rh.payload_bytes != head->total) {
      Break("protocol error: read payload of " + std::to_string(rh.payload_bytes) + " bytes, expected " +
            std::to_string(head->total));
      return false;
    }
    MemoryUse use(head->local);
    if (use && OnGpu(use->desc)) {
      std::string gpu_error;
      r = RecvStaged(reader_, *recv_staging_, {use->desc.data, use->desc.device_id, &head->segs, true}, bound,
                     &gpu_error);
      if (r.ok) r = reader_.Discard(WirePad(rh.payload_bytes), bound);
      if (!gpu_error.empty()) {
        code = StatusCode::ERR_GPU_OP;
        msg = "copying the read payload to GPU memory failed: " + gpu_error;
      }
    } else if (use) {
      iov.clear();
      AppendIovecs(use->Base(), head->segs, true, &iov);
      char pad[kWireAlign];
      if (uint64_t n = WirePad(rh.payload_bytes)) iov.push_back({pad, n});
      r = reader_.ReadVFull(iov, bound);
    } else {
      r = reader_.Discard(WireRound(rh.payload_bytes), bound);
      code = StatusCode::ERR_NOT_FOUND;
      msg = "local memory " + std::to_string(head->local->desc.id) + " was deregistered during the read";
    }
  } else if (r.ok && rh.payload_bytes != 0) {
    Break("protocol error: unexpected payload on a response");
    return false;
  }
  if (!r.ok) {
    BreakOnIo(r, "read payload timed out");
    return false;
  }
  if (code != StatusCode::SUCCESS && !IsError(code)) code = StatusCode::ERR_BAD_STATE;
  if (IsError(code)) msg = "engine '" + peer_key_ + "': " + msg;
  const bool notice = code == StatusCode::SUCCESS && head->op == Op::Read && head->notify;
  bool deferred;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) return false;  // Break() failed `head` (or left it to unbusier)
    inflight_.pop_front();
    if (head->op == Op::Read) {
      --head->busy;  // done with the buffer; the unbusier has nothing left to do
      unbusier.p = nullptr;
    }
    deferred = DeferIfBusy(*head, code, msg);
    // Counted before the status ends: a caller that closes the peer as soon
    // as its read ends waits for this notice (DrainNotices), which follows.
    if (notice) ++notices_unsent_;
  }
  if (!deferred) Complete(*head, code, msg);
  if (notice) NoticeRead(*head);
  return true;
}

void DataConn::NoticeRead(const Part& read) {
  auto n = std::make_shared<Part>();
  n->op = Op::Notice;
  n->uid = read.uid;
  n->parts_total = read.parts_total;
  n->part_index = read.part_index;
  n->attempt = read.attempt;
  n->incarnation = read.incarnation;
  n->deadline = DeadlineAfterMs(cfg_.op_timeout_ms);
  if (courier_ && courier_->Hold(n)) {
    std::lock_guard<std::mutex> lk(mu_);
    --notices_unsent_;  // the courier has it now
    return;
  }
  Enqueue(std::move(n), {}, /*counted=*/true);
}
}  // namespace tcp
}  // namespace mori_torch
