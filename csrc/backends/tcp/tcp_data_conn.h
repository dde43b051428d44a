// Initiator side of one TCP data connection. The sender thread first opens
// the connection (so submitting never waits on the network), then writes queued
// requests back to back (several per sendmsg, payload gathered straight from
// registered memory); a receiver thread reads the in-order responses (and
// read payloads, scattered straight into registered memory). Any I/O error or
// timeout breaks the connection and ends every request on it with an error.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backends/tcp/tcp_config.h"
#include "backends/tcp/tcp_protocol.h"
#include "core/memory_registry.h"
#include "core/net.h"
#include "core/segments.h"
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
  std::shared_ptr<TransferTracker> tracker;  // null for notices
  Deadline deadline;

  // Filled by the sender.
  RequestHeader hdr{};
  std::vector<WireSegment> table;
  MemoryUse use;  // write payload source, held while it is sent
};
using PartPtr = std::shared_ptr<Part>;

class DataConn {
 public:
  // `connect` opens the socket (throws Error); it runs on the sender thread,
  // and requests queued meanwhile fail with its error if it throws.
  // `staging` lends pinned bounce buffers for GPU memory.
  DataConn(std::function<Socket()> connect, std::string peer_key, const TcpConfig& cfg,
           std::shared_ptr<gpu::StagingPool> staging);
  ~DataConn();  // breaks the connection (ending its requests) and joins
  DataConn(const DataConn&) = delete;
  DataConn& operator=(const DataConn&) = delete;

  // Queues a request; on a broken connection the request fails at once.
  void Enqueue(PartPtr p);
  bool Broken() const;
  // False once broken. An idle connection (nothing queued or in flight) that
  // is readable was closed by the peer (it restarted, say): it is broken
  // here, so the caller reopens it instead of failing the next request.
  bool Usable();
  // Ends every queued and in-flight request with `code` and `reason`. Idempotent.
  void Break(const std::string& reason, StatusCode code = StatusCode::ERR_BAD_STATE);

 private:
  void SendLoop();
  void RecvLoop();
  // Fills the wire header and table; acquires write payloads and, for GPU
  // memory, the staging buffers. False if the part was failed instead (its
  // local memory was deregistered, or no buffers could be pinned).
  bool Prepare(Part& p);
  // Writes a batch of prepared parts back to back.
  IoResult SendBatch(const std::vector<PartPtr>& batch);
  // Runs connect_; false (connection broken) if it failed.
  bool Connect();
  void Complete(Part& p, StatusCode code, const std::string& msg);

  std::function<Socket()> connect_;
  Socket sock_;  // set once by Connect(), under mu_
  bool connected_ = false;
  const std::string peer_key_;
  const TcpConfig cfg_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<PartPtr> send_q_;
  std::deque<PartPtr> inflight_;  // sent or being sent, in wire order
  bool broken_ = false;
  std::string broken_reason_;
  uint64_t next_req_id_ = 1;
  std::shared_ptr<gpu::StagingPool> staging_;
  // Bounce buffers of the sender (GPU write payloads) and of the receiver
  // (GPU read payloads), taken from staging_ on first use under mu_.
  std::unique_ptr<gpu::StagingSet> send_staging_, recv_staging_;
  std::thread sender_, receiver_;
};

// True when `m` is GPU memory (its bytes go through staging buffers).
inline bool OnGpu(const MemoryDesc& m) { return m.loc == MemoryLocationType::GPU; }

// Appends iovecs covering `segs` of memory at `base`, merging neighbours
// that are adjacent in memory (whatever their other side).
void AppendIovecs(char* base, const std::vector<Segment>& segs, bool local_side, std::vector<iovec>* iov);
// Appends the zero padding that follows `n` bytes of a message (see tcp_protocol.h).
void AppendPadding(uint64_t n, std::vector<iovec>* iov);

}  // namespace tcp
}  // namespace mori_torch
