#include "backends/tcp/tcp_data_conn.h"

#include <cstring>

#include <poll.h>

#include "backends/tcp/tcp_staged_io.h"
#include "core/logging.h"

namespace mori_torch {
namespace tcp {
namespace {

// Requests coalesced into one sendmsg loop: enough to amortize system calls
// for small transfers, small enough to keep latency fair.
constexpr size_t kMaxPartsPerSend = 64;
constexpr uint64_t kMaxBytesPerSend = 8u << 20;

}  // namespace

void AppendIovecs(char* base, const std::vector<Segment>& segs, bool local_side, std::vector<iovec>* iov) {
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
                   std::shared_ptr<gpu::StagingPool> staging)
    : connect_(std::move(connect)), peer_key_(std::move(peer_key)), cfg_(cfg), staging_(std::move(staging)) {
  sender_ = std::thread([this] { SendLoop(); });
  receiver_ = std::thread([this] { RecvLoop(); });
}

DataConn::~DataConn() {
  Break("connection closed");
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
  staging_->Give(std::move(send_staging_));
  staging_->Give(std::move(recv_staging_));
}

bool DataConn::Broken() const {
  std::lock_guard<std::mutex> lk(mu_);
  return broken_;
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
  Break("connection closed by the peer while idle");
  return false;
}

void DataConn::Enqueue(PartPtr p) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!broken_) {
      send_q_.push_back(std::move(p));
      cv_.notify_all();
      return;
    }
  }
  Complete(*p, StatusCode::ERR_BAD_STATE, "TCP connection to engine '" + peer_key_ + "' is broken: " + broken_reason_);
}

void DataConn::Complete(Part& p, StatusCode code, const std::string& msg) {
  // p.use belongs to the sender thread, which may still be gathering from it
  // (Break() and responses can end a part mid-send); it releases it itself.
  if (p.tracker) p.tracker->PartDone(code, msg);
}

void DataConn::Break(const std::string& reason, StatusCode code) {
  std::deque<PartPtr> failed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (broken_) return;
    broken_ = true;
    broken_reason_ = reason;
    failed.swap(inflight_);
    for (auto& p : send_q_) failed.push_back(std::move(p));
    send_q_.clear();
    cv_.notify_all();
  }
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
  if (!failed.empty()) {
    MORI_LOG(Warning, "TCP connection to engine '" << peer_key_ << "' broke (" << reason << "); failing "
                                                   << failed.size() << " request(s)");
  }
  const std::string msg = "TCP connection to engine '" + peer_key_ + "' failed: " + reason;
  for (auto& p : failed) Complete(*p, code, msg);
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
  Socket s;
  try {
    s = connect_();
  } catch (const Error& e) {
    Break(e.what(), e.code());  // ERR_NOT_FOUND "engine restarted" stays that
    return false;
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (broken_) return false;
  sock_ = std::move(s);
  connected_ = true;
  cv_.notify_all();
  return true;
}

void DataConn::SendLoop() {
  if (!Connect()) return;
  std::vector<PartPtr> batch;
  while (true) {
    batch.clear();
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return broken_ || !send_q_.empty(); });
      if (broken_) return;
      uint64_t bytes = 0;
      while (!send_q_.empty() && batch.size() < kMaxPartsPerSend && bytes < kMaxBytesPerSend) {
        PartPtr p = std::move(send_q_.front());
        send_q_.pop_front();
        if (!Prepare(*p)) continue;
        bytes += p->op == Op::Write ? p->total : 0;
        if (p->op != Op::Notice) inflight_.push_back(p);  // notices get no response
        batch.push_back(std::move(p));
      }
      if (!batch.empty()) cv_.notify_all();  // wakes the receiver for the new in-flight requests
    }
    if (batch.empty()) continue;
    IoResult r = SendBatch(batch);
    for (auto& p : batch) p->use.reset();
    if (!r.ok) {
      Break(r.timed_out ? "send timed out after " + std::to_string(cfg_.op_timeout_ms) + " ms" : r.error);
      return;
    }
  }
}

IoResult DataConn::SendBatch(const std::vector<PartPtr>& batch) {
  std::vector<iovec> iov;
  const Deadline deadline = batch.front()->deadline;
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

void DataConn::RecvLoop() {
  std::vector<iovec> iov;
  std::string msg;
  while (true) {
    PartPtr head;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return broken_ || (connected_ && !inflight_.empty()); });
      if (broken_) return;
      head = inflight_.front();
    }
    // A response is at least kWireAlign bytes: its first ones hold the
    // header and the start of the message (or padding).
    alignas(8) char first[kWireAlign];
    IoResult r = ReadFull(sock_.fd(), first, sizeof(first), head->deadline);
    if (!r.ok) {
      Break(r.timed_out ? "no response within op_timeout_ms=" + std::to_string(cfg_.op_timeout_ms) : r.error);
      return;
    }
    ResponseHeader rh;
    std::memcpy(&rh, first, sizeof(rh));
    if (rh.magic != kResponseMagic || rh.req_id != head->hdr.req_id || rh.msg_len > kMaxMessageBytes) {
      Break("protocol error: unexpected response (magic, request id or length)");
      return;
    }
    constexpr size_t kFirstMsg = sizeof(first) - sizeof(rh);
    msg.assign(first + sizeof(rh), kFirstMsg);
    msg.resize(WireRound(sizeof(rh) + rh.msg_len) - sizeof(rh));  // message and padding
    r = ReadFull(sock_.fd(), &msg[0] + kFirstMsg, msg.size() - kFirstMsg, head->deadline);
    msg.resize(rh.msg_len);
    auto code = static_cast<StatusCode>(rh.code);
    if (r.ok && code == StatusCode::SUCCESS && head->op == Op::Read) {
      if (rh.payload_bytes != head->total) {
        Break("protocol error: read payload of " + std::to_string(rh.payload_bytes) + " bytes, expected " +
              std::to_string(head->total));
        return;
      }
      MemoryUse use(head->local);
      if (use && OnGpu(use->desc)) {
        std::string gpu_error;
        r = RecvStaged(sock_.fd(), *recv_staging_, {use->desc.data, use->desc.device_id, &head->segs, true},
                       head->deadline, &gpu_error);
        if (r.ok) r = Discard(sock_.fd(), WirePad(rh.payload_bytes), head->deadline);
        if (!gpu_error.empty()) {
          code = StatusCode::ERR_GPU_OP;
          msg = "copying the read payload to GPU memory failed: " + gpu_error;
        }
      } else if (use) {
        iov.clear();
        AppendIovecs(use->Base(), head->segs, true, &iov);
        char pad[kWireAlign];
        if (uint64_t n = WirePad(rh.payload_bytes)) iov.push_back({pad, n});
        r = ReadVFull(sock_.fd(), iov, head->deadline);
      } else {
        r = Discard(sock_.fd(), WireRound(rh.payload_bytes), head->deadline);
        code = StatusCode::ERR_NOT_FOUND;
        msg = "local memory " + std::to_string(head->local->desc.id) + " was deregistered during the read";
      }
    } else if (r.ok && rh.payload_bytes != 0) {
      Break("protocol error: unexpected payload on a response");
      return;
    }
    if (!r.ok) {
      Break(r.timed_out ? "read payload timed out" : r.error);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (broken_) return;  // Break() already failed `head`
      inflight_.pop_front();
    }
    if (code != StatusCode::SUCCESS && !IsError(code)) code = StatusCode::ERR_BAD_STATE;
    if (IsError(code)) msg = "engine '" + peer_key_ + "': " + msg;
    Complete(*head, code, msg);
    if (code == StatusCode::SUCCESS && head->op == Op::Read && head->notify) {
      auto n = std::make_shared<Part>();
      n->op = Op::Notice;
      n->uid = head->uid;
      n->parts_total = head->parts_total;
      n->incarnation = head->incarnation;
      n->deadline = DeadlineAfterMs(cfg_.op_timeout_ms);
      Enqueue(std::move(n));
    }
  }
}

}  // namespace tcp
}  // namespace mori_torch
