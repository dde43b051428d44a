#include "backends/tcp/tcp_config.h"

namespace mori_torch {
namespace tcp {

TcpConfig TcpConfig::FromMap(const BackendConfig& m) {
  constexpr const char* kName = "TcpBackendConfig";
  CheckConfigKeys(m, kName,
                  {"sock_sndbuf_bytes", "sock_rcvbuf_bytes", "op_timeout_ms", "enable_keepalive",
                   "keepalive_idle_sec", "keepalive_intvl_sec", "keepalive_cnt", "enable_ctrl_nodelay",
                   "num_data_conns", "striping_threshold_bytes", "connect_timeout_ms", "enable_notification",
                   "staging_chunk_bytes", "staging_depth", "inactivity_timeout_ms",
                   "serve_threads"});
  TcpConfig c;
  constexpr int64_t kInt = INT32_MAX;
  c.sock_sndbuf_bytes = ConfigValue(m, kName, "sock_sndbuf_bytes", c.sock_sndbuf_bytes, 0, kInt);
  c.sock_rcvbuf_bytes = ConfigValue(m, kName, "sock_rcvbuf_bytes", c.sock_rcvbuf_bytes, 0, kInt);
  c.op_timeout_ms = ConfigValue(m, kName, "op_timeout_ms", c.op_timeout_ms, 1, INT64_C(1) << 40);
  c.enable_keepalive = ConfigValue(m, kName, "enable_keepalive", c.enable_keepalive, 0, 1) != 0;
  c.keepalive_idle_sec = ConfigValue(m, kName, "keepalive_idle_sec", c.keepalive_idle_sec, 1, 1 << 20);
  c.keepalive_intvl_sec = ConfigValue(m, kName, "keepalive_intvl_sec", c.keepalive_intvl_sec, 1, 1 << 20);
  c.inactivity_timeout_ms =
      ConfigValue(m, kName, "inactivity_timeout_ms", c.inactivity_timeout_ms, 1, INT64_C(1) << 40);
  c.keepalive_cnt = ConfigValue(m, kName, "keepalive_cnt", c.keepalive_cnt, 1, 1 << 10);
  c.enable_ctrl_nodelay = ConfigValue(m, kName, "enable_ctrl_nodelay", c.enable_ctrl_nodelay, 0, 1) != 0;
  c.num_data_conns = ConfigValue(m, kName, "num_data_conns", c.num_data_conns, 1, 64);
  c.striping_threshold_bytes =
      ConfigValue(m, kName, "striping_threshold_bytes", c.striping_threshold_bytes, 1, INT64_C(1) << 40);
  c.connect_timeout_ms = ConfigValue(m, kName, "connect_timeout_ms", c.connect_timeout_ms, 1, 1 << 30);
  c.enable_notification = ConfigValue(m, kName, "enable_notification", c.enable_notification, 0, 1) != 0;
  c.staging_chunk_bytes = ConfigValue(m, kName, "staging_chunk_bytes", c.staging_chunk_bytes, 4096, INT64_C(1) << 30);
  c.staging_depth = ConfigValue(m, kName, "staging_depth", c.staging_depth, 2, 16);
  c.serve_threads = ConfigValue(m, kName, "serve_threads", c.serve_threads, 0, 256);
  return c;
}

}  // namespace tcp
}  // namespace mori_torch
