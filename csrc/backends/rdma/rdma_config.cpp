#include "backends/rdma/rdma_config.h"

#include <cstring>

#include "base/config_table.h"

namespace mori_torch {
namespace rdma {
namespace {

constexpr const char* kName = "RdmaBackendConfig";  // defaults and ranges: base/config_table.cpp

// MORI-IO's environment overrides (deployment scripts set them): each
// replaces the config key it names (its table entry's `overrides`) before
// validation.
BackendConfig WithEnvOverrides(BackendConfig m) {
  const std::string prefix = std::string(kName) + ".";
  for (const config::Entry& e : config::Table()) {
    if (std::strcmp(e.scope, config::kEnv) != 0 || std::strncmp(e.overrides, prefix.c_str(), prefix.size()) != 0 ||
        !config::EnvIsSet(e.name)) {
      continue;
    }
    m[e.overrides + prefix.size()] = e.kind == config::Kind::Bool ? config::EnvBool(e.name) : config::EnvInt(e.name);
  }
  return m;
}

}  // namespace

RdmaConfig RdmaConfig::FromMap(const BackendConfig& given) {
  const BackendConfig m = WithEnvOverrides(given);
  config::CheckKnownKeys(m, kName);
  auto get = [&](const char* key) { return config::Value(m, kName, key); };
  RdmaConfig c;
  // MORI-IO's own checks first, with its messages (users match on them).
  c.enable_notification = get("enable_notification") != 0;
  c.notif_per_qp = get("notif_per_qp");
  if (c.enable_notification && c.notif_per_qp == 0) {
    throw Error(StatusCode::ERR_BAD_STATE, "Invalid RDMA config: notifPerQp must be >= 1 when notification is enabled");
  }
  c.max_chunks_per_transfer = get("max_chunks_per_transfer");
  if (c.max_chunks_per_transfer < 1) {
    throw Error(StatusCode::ERR_BAD_STATE, "Invalid RDMA config: maxChunksPerTransfer must be >= 1");
  }
  c.num_nics_per_transfer = get("num_nics_per_transfer");
  if (c.num_nics_per_transfer < 1) {
    throw Error(StatusCode::ERR_BAD_STATE, "Invalid RDMA config: numNicsPerTransfer must be >= 1");
  }
  c.enable_transfer_chunking = get("enable_transfer_chunking") != 0;
  c.chunk_bytes = get("chunk_bytes");
  if (c.enable_transfer_chunking && c.chunk_bytes < 4096) {
    throw Error(StatusCode::ERR_BAD_STATE, "Invalid RDMA config: chunkBytes must be >= 4096 when chunking is enabled");
  }
  // Our own range checks for the rest (Error names the field and value).
  c.qp_per_transfer = get("qp_per_transfer");
  c.post_batch_size = get("post_batch_size");
  if (c.post_batch_size == 0) {
    throw Error(StatusCode::ERR_INVALID_ARGS, std::string(kName) + " config: post_batch_size=0 (use -1 or >= 1)");
  }
  c.num_worker_threads = get("num_worker_threads");
  if (c.num_worker_threads == 0) {
    throw Error(StatusCode::ERR_INVALID_ARGS, std::string(kName) + " config: num_worker_threads=0 (use -1 or >= 1)");
  }
  c.poll_cq_mode = static_cast<PollCqMode>(get("poll_cq_mode"));
  c.gid_index = get("gid_index");
  c.sq_depth = get("sq_depth");
  c.sq_full_timeout_ms = get("sq_full_timeout_ms");
  c.connect_timeout_ms = get("connect_timeout_ms");
  c.inactivity_timeout_ms = get("inactivity_timeout_ms");
  return c;
}

}  // namespace rdma
}  // namespace mori_torch
