#include "core/backend.h"

#include "gpu/trace_ranges.h"

namespace mori_torch {

void BackendPeer::LaunchOnStream(const LocalMemory&, const MemoryDesc&, gpu::StreamCopyArgs, gpu::Stream) {
  throw Error(StatusCode::ERR_BAD_STATE, "this backend cannot launch transfers on a GPU stream");
}

void Backend::SubmitGroup(std::vector<PeerOp> ops) {
  for (PeerOp& p : ops) p.peer->Submit(std::move(p.op));
}

void AttachRecord(TransferOp& op, const std::shared_ptr<TransferCounters>& counters) {
  TransferRecord r;
  r.trace_range = gpu::TraceRangeStart(op.is_read ? "mori.read" : "mori.write");
  if (counters) {
    r.counters = counters;
    r.is_read = op.is_read;
    r.bytes = op.segs->total_bytes;
    r.start_ns = StatsNowNs();
    counters->Start(op.is_read);
  }
  // Before any backend sees it: the status may end on a backend thread
  // before Submit returns.
  if (r.counters || r.trace_range) op.status->SetRecord(std::move(r));
}

}  // namespace mori_torch
