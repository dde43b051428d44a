#include "core/backend.h"

#include <algorithm>

#include "gpu/trace_ranges.h"

namespace mori_torch {

void BackendPeer::LaunchOnStream(const LocalMemory&, const MemoryDesc&, gpu::StreamCopyArgs, gpu::Stream) {
  throw Error(StatusCode::ERR_BAD_STATE, "this backend cannot launch transfers on a GPU stream");
}

void SubmitCounted(BackendPeer& peer, TransferOp op, const std::shared_ptr<TransferCounters>& counters) {
  TransferRecord r;
  r.trace_range = gpu::TraceRangeStart(op.is_read ? "mori.read" : "mori.write");
  if (counters) {
    r.counters = counters;
    r.is_read = op.is_read;
    r.bytes = TotalBytes(op.segs);
    r.start_ns = StatsNowNs();
    counters->Start(op.is_read);
  }
  // Before the backend sees it: the status may end on a backend thread
  // before Submit returns.
  if (r.counters || r.trace_range) op.status->SetRecord(std::move(r));
  peer.Submit(std::move(op));
}

int64_t ConfigValue(const BackendConfig& config, const char* backend, const std::string& name, int64_t def,
                    int64_t min, int64_t max) {
  auto it = config.find(name);
  int64_t v = it == config.end() ? def : it->second;
  if (v < min || v > max) {
    throw Error(StatusCode::ERR_INVALID_ARGS, std::string(backend) + " config: " + name + "=" + std::to_string(v) +
                                                  " out of range [" + std::to_string(min) + ", " +
                                                  std::to_string(max) + "]");
  }
  return v;
}

void CheckConfigKeys(const BackendConfig& config, const char* backend, const std::vector<std::string>& known) {
  for (const auto& kv : config) {
    if (std::find(known.begin(), known.end(), kv.first) == known.end()) {
      throw Error(StatusCode::ERR_INVALID_ARGS, std::string(backend) + " config: unknown field '" + kv.first + "'");
    }
  }
}

}  // namespace mori_torch
