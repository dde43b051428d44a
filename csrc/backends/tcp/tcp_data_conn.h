// Initiator side of one TCP data connection, driven by the backend's shared
// workers (no thread of its own). A send job first opens the connection (so
// submitting never waits on the network), then writes queued requests back to
// back (several per sendmsg, payload gathered straight from registered
// memory) until the queue is empty. The event loop watches the socket; when a
// response arrives, a receive job reads the in-order responses (and read
// payloads, scattered straight into registered memory) while they keep
// coming. Any I/O error or timeout breaks the connection and ends every
// request on it with an error.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/tcp/tcp_config.h"
#include "backends/tcp/tcp_inline.h"
#include "backends/tcp/tcp_protocol.h"
#include "core/event_loop.h"
#include "core/memory_registry.h"
#include "core/net.h"
#include "core/segments.h"
#include "core/socket_reader.h"
#include "core/transfer_tracker.h"
#include "gpu/staging.h"

namespace mori_torch {
namespace tcp {

// One request: a stripe of a transfer, or a read-completion notice.
struct Part {
  Op op = Op::Write;
  bool notify = false;
  std::shared_ptr<LocalMemory> local;  // null for notices
  uint64_t mem_id = 0;                 // target memory id
  Incarnation incarnation = 0;         // of the target engine
  MemoryToken token{};                 // of the target memory
  std::vector<Segment> segs;
  uint64_t total = 0;
  TransferUid uid = 0;
  uint32_t parts_total = 1;
  uint32_t part_index = 0;
  uint16_t attempt = 0;                      // TransferOp::attempt
  std::shared_ptr<TransferTracker> tracker;  // null for notices
  bool rehomed = false;                      // a notice handed back once by a broken connection
  Deadline deadline;

  // Filled by the sender.
  RequestHeader hdr{};
  std::vector<WireSegment> table;
  MemoryUse use;  // write payload source, held while it is sent
  // Guarded by the connection's mu_: jobs using the part's local bytes now
  // (the send job gathering a write payload, the receive job scattering a
  // read payload). Its status must not end while they do (the caller may
  // free the buffer once it ends), so a result that comes meanwhile (the
  // response, a break) waits here and the last job out delivers it.
  int busy = 0;
  bool has_result = false;
  StatusCode result_code = StatusCode::SUCCESS;
  std::string result_msg;
  bool result_path_failed = false;
};
using PartPtr = std::shared_ptr<Part>;

// The threads every initiator connection of a backend shares: one pool per
// direction, so that a send blocked on a full socket never keeps a response
// from being read (pools of one role only wait on jobs of another).
struct DataConnWorkers {
  EventLoop* loop = nullptr;
  std::shared_ptr<WorkerPool> senders;
  std::shared_ptr<WorkerPool> receivers;
};

class NoticeCourier;

class DataConn : public std::enable_shared_from_this<DataConn> {
 public:
  // `connect` opens the socket (throws Error); it runs in the first send
  // job, and requests queued meanwhile fail with its error if it throws.
  // `staging` lends pinned bounce buffers for GPU memory. `courier` (null:
  // none) holds read notices for the peer's next request (tcp_notices.h).
  DataConn(std::function<Socket()> connect, std::string peer_key, const TcpConfig& cfg,
           std::shared_ptr<gpu::StagingPool> staging, DataConnWorkers workers,
           std::shared_ptr<NoticeCourier> courier = nullptr);
  ~DataConn();  // breaks the connection (ending its requests)
  DataConn(const DataConn&) = delete;
  DataConn& operator=(const DataConn&) = delete;

  // Queues a request, with `notices` just before it (in the same system
  // call when they fit); on a broken connection the request fails at once
  // and the notices go back to the courier. `counted`: p is a notice that
  // notices_unsent_ already counts (ReceiveOne).
  void Enqueue(PartPtr p, std::vector<PartPtr> notices = {}, bool counted = false);
  // Queues notices alone (none: nothing), as Enqueue does.
  void EnqueueNotices(std::vector<PartPtr> notices);
  // Waits up to max_ms until no notice is queued or being sent (the peer's
  // Close: notices queued last leave before the connection breaks).
  void DrainNotices(int64_t max_ms);
  bool Broken() const;
  // Connected and not broken: a send goes out without connecting first.
  bool Ready() const;
  // False once broken. An idle connection (nothing queued or in flight) that
  // is readable was closed by the peer (it restarted, say): it is broken
  // here, so the caller reopens it instead of failing the next request.
  bool Usable();
  // True if the caller's polls of `p`'s status should receive its response
  // (ReceiveForCaller): a small request of host memory (tcp_inline.h), and
  // one loop thread that sleeps between events (one that spins finds the
  // response as soon, and a poller would only add its own system calls; with
  // several, a poller's re-arm could start a second run of the handler on
  // another loop thread while the first one returns).
  bool CallerMayReceive(const Part& p) const {
    return cfg_.poller_receives && cfg_.inline_max_bytes > 0 && !workers_.loop->Spins() && workers_.loop->OneThread() &&
           SmallForInline(p);
  }
  // From a thread polling a status (its progress hook): reads the whole
  // responses of small requests that have arrived, as the event loop would,
  // if no other thread is reading the socket now. Never waits. A poller
  // thus ends its transfer without waiting for the loop thread to wake up
  // (a few microseconds of a small round trip, what a spinning peer such as
  // UCX saves).
  void ReceiveForCaller();
  // Ends every queued and in-flight request with `code` and `reason`;
  // `path_failed` when the connection itself failed (reset, closed by the
  // peer), so that the transfers may be retried on a fresh one. Idempotent.
  void Break(const std::string& reason, StatusCode code = StatusCode::ERR_BAD_STATE, bool path_failed = false);

 private:
  // Send job: connects if needed, then sends until the queue is empty.
  void SendJob();
  // Sends queued parts until the queue is empty, or after `max_batches`
  // hands the rest to a send job; the caller holds the sender's turn
  // (send_scheduled_).
  void SendQueued(int max_batches);
  // mu_ held: true if `p` may be sent by the submitting thread itself
  // (tcp_inline.h): small, of host memory, nothing else queued or being
  // sent, connected, and it fits the send buffer now.
  bool SendInlineLocked(const Part& p);
  // Small enough for a thread that must not wait (tcp_inline.h).
  bool SmallForInline(const Part& p) const;
  // True if the response at the head of the stream is for a small request
  // of host memory and has arrived whole: the loop thread reads it itself.
  bool ResponseReadyInline();
  // Receive job: reads responses while bytes keep coming.
  void RecvJob();
  // With the reading turn (reading_): reads the whole responses of small
  // requests that are here, at most kInlineMaxPerEvent; false if the
  // connection broke meanwhile.
  bool ReceiveReadyResponses();
  // Hands the reading turn to a receive job (bytes that may need waiting for).
  void PostRecvJob();
  // The reading thread (loop, receive job or poller) is done with the
  // socket: it gives up reading_ and re-arms the loop's watch if `rearm`
  // or if the loop reported the socket meanwhile (event_pending_).
  void DoneReading(bool rearm);
  // Reads one response (its first bytes have arrived); false: broken.
  bool ReceiveOne();
  // A read ended well: its notice to the target (counted in
  // notices_unsent_ by the caller), held by the courier or queued at once.
  void NoticeRead(const Part& read);
  // Notices a broken connection could not send get one more chance on
  // another connection of the peer (the courier); the rest are dropped.
  void HandBack(std::vector<PartPtr> notices);
  // The event loop reported the socket (readable, hung up, or quiet).
  void OnSocketEvent(uint32_t events);
  void SchedulePostLocked();  // mu_ held: a send job if none is pending
  // Fills the wire header and table; acquires write payloads and, for GPU
  // memory, the staging buffers. False if the part was failed instead (its
  // local memory was deregistered, or no buffers could be pinned).
  bool Prepare(Part& p);
  // Writes a batch of prepared parts back to back.
  IoResult SendBatch(const std::vector<PartPtr>& batch);
  // Runs connect_; false (connection broken) if it failed.
  bool Connect();
  void Complete(Part& p, StatusCode code, const std::string& msg, bool path_failed = false);
  // mu_ held: true (result kept for the job using it) if p is busy.
  static bool DeferIfBusy(Part& p, StatusCode code, const std::string& msg, bool path_failed = false);
  // Breaks on a failed I/O result: a timeout is final, any other error
  // (reset, closed) is the path's.
  void BreakOnIo(const IoResult& r, const std::string& timeout_what);
  // mu_ held: a job is done with p's bytes; true if it must now deliver the
  // result kept meanwhile.
  static bool Unbusy(Part& p);
  // The I/O bound of a request: its whole-operation deadline and the
  // connection's inactivity timeout.
  IoDeadline Bound(const Part& p) { return {p.deadline, cfg_.inactivity_timeout_ms, &progress_ms_}; }

  std::function<Socket()> connect_;
  Socket sock_;  // set once by Connect(), under mu_
  bool connected_ = false;
  const std::string peer_key_;
  const TcpConfig cfg_;
  mutable std::mutex mu_;
  std::deque<PartPtr> send_q_;
  std::deque<PartPtr> inflight_;  // sent or being sent, in wire order
  // Last byte moved in either direction (inactivity timeout, see TcpConfig).
  std::atomic<int64_t> progress_ms_{0};
  size_t last_unsent_ = 0;  // BytesUnsent at the last idle report (loop thread only)
  bool broken_ = false;
  bool broken_path_ = false;  // broken by a path failure (Break's path_failed)
  std::string broken_reason_;
  uint64_t next_req_id_ = 1;
  bool send_scheduled_ = false;  // a send job is queued or running
  size_t notices_unsent_ = 0;    // notices about to be queued, queued, or in a batch being written
  bool watched_ = false;         // the socket is on the event loop
  std::shared_ptr<gpu::StagingPool> staging_;
  // Bounce buffers of the sender (GPU write payloads) and of the receiver
  // (GPU read payloads), taken from staging_ on first use under mu_.
  std::unique_ptr<gpu::StagingSet> send_staging_, recv_staging_;
  DataConnWorkers workers_;
  const std::shared_ptr<NoticeCourier> courier_;
  SendRoom room_;  // of sock_, for inline sends (tcp_inline.h); set with it
  // Reused by the receive job.
  std::vector<iovec> recv_iov_;
  // Every read of the socket goes through it, by the thread holding
  // reading_ (the loop in its event, a receive job, or a poller).
  SocketReader reader_{kReadAheadBytes};
  // The socket has a reader: the loop thread in its event, a receive job it
  // handed the socket to, or a poller (ReceiveForCaller). Taken with an
  // exchange; a loop event that finds it taken sets event_pending_ and
  // leaves the watch disarmed for the holder to re-arm (DoneReading).
  std::atomic<bool> reading_{false};
  std::atomic<bool> event_pending_{false};
  std::string recv_msg_;
};

// True when `m` is GPU memory (its bytes go through staging buffers).
inline bool OnGpu(const MemoryDesc& m) { return m.loc == MemoryLocationType::GPU; }

// Appends iovecs covering `segs` of memory at `base`, merging neighbours
// that are adjacent in memory (whatever their other side).
void AppendIovecs(char* base, SegmentSpan segs, bool local_side, std::vector<iovec>* iov);
// Appends the zero padding that follows `n` bytes of a message (see tcp_protocol.h).
void AppendPadding(uint64_t n, std::vector<iovec>* iov);

}  // namespace tcp
}  // namespace mori_torch
