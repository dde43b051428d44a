// TcpBackendConfig: the field names and defaults of MORI's TCP backend branch.
#pragma once

#include <cstdint>

#include "core/backend.h"

namespace mori_torch {
namespace tcp {

// FromMap sets every field; defaults, ranges and docs: base/config_table.cpp.
struct TcpConfig {
  int64_t sock_sndbuf_bytes{};
  int64_t sock_rcvbuf_bytes{};
  // Whole operation: a transfer not finished this long after submission fails.
  int64_t op_timeout_ms{};
  // mori_torch extension: a connection that moves no byte for this long while
  // a transfer waits on it fails that transfer (and the connection), long
  // before op_timeout_ms. A slow but live link (loss, delay) keeps moving
  // bytes and is not cut off by it; raise op_timeout_ms for long transfers.
  int64_t inactivity_timeout_ms{};
  bool enable_keepalive{};
  int64_t keepalive_idle_sec{};
  int64_t keepalive_intvl_sec{};
  int64_t keepalive_cnt{};
  bool enable_ctrl_nodelay{};
  int64_t num_data_conns{};
  int64_t striping_threshold_bytes{};
  int64_t connect_timeout_ms{};
  // mori_torch extension: record inbound completion notices on the target.
  bool enable_notification{};
  // mori_torch extension: pinned staging for GPU memory, per connection and
  // direction: `staging_depth` chunks of `staging_chunk_bytes` in flight.
  int64_t staging_chunk_bytes{};  // measured best on H200 (docs/BENCHMARK.md)
  int64_t staging_depth{};
  // mori_torch extension: threads serving inbound data requests (the target
  // side), whatever the number of connections; 0 picks from the core count.
  int64_t serve_threads{};
  // mori_torch extension: requests of host memory up to this size skip the
  // worker hand-offs (backends/tcp/tcp_inline.h); 0: never.
  int64_t inline_max_bytes{};
  // mori_torch extension: a poller of a small transfer's status reads its
  // response (DataConn::ReceiveForCaller) where the loop does not spin.
  bool poller_receives{};
  // mori_torch extension: a read's completion notice waits up to this long
  // to ride on the next request to the peer (tcp_notices.h); 0: sent at
  // once; -1: NoticeDelayUs() picks by whether the event loop spins.
  int64_t notice_delay_us{};

  static TcpConfig FromMap(const BackendConfig& m);
};

}  // namespace tcp
}  // namespace mori_torch
