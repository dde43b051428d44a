#include "backends/tcp/tcp_config.h"

#include "base/config_table.h"

namespace mori_torch {
namespace tcp {

TcpConfig TcpConfig::FromMap(const BackendConfig& m) {
  constexpr const char* kName = "TcpBackendConfig";  // defaults and ranges: base/config_table.cpp
  config::CheckKnownKeys(m, kName);
  auto get = [&](const char* key) { return config::Value(m, kName, key); };
  TcpConfig c;
  c.sock_sndbuf_bytes = get("sock_sndbuf_bytes");
  c.sock_rcvbuf_bytes = get("sock_rcvbuf_bytes");
  c.op_timeout_ms = get("op_timeout_ms");
  c.inactivity_timeout_ms = get("inactivity_timeout_ms");
  c.enable_keepalive = get("enable_keepalive") != 0;
  c.keepalive_idle_sec = get("keepalive_idle_sec");
  c.keepalive_intvl_sec = get("keepalive_intvl_sec");
  c.keepalive_cnt = get("keepalive_cnt");
  c.enable_ctrl_nodelay = get("enable_ctrl_nodelay") != 0;
  c.num_data_conns = get("num_data_conns");
  c.striping_threshold_bytes = get("striping_threshold_bytes");
  c.connect_timeout_ms = get("connect_timeout_ms");
  c.enable_notification = get("enable_notification") != 0;
  c.staging_chunk_bytes = get("staging_chunk_bytes");
  c.staging_depth = get("staging_depth");
  c.serve_threads = get("serve_threads");
  c.inline_max_bytes = get("inline_max_bytes");
  c.poller_receives = get("poller_receives") != 0;
  c.notice_delay_us = get("notice_delay_us");
  return c;
}

}  // namespace tcp
}  // namespace mori_torch
