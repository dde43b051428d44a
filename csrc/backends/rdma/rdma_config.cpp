#include "backends/rdma/rdma_config.h"

namespace mori_torch {
namespace rdma {

RdmaConfig RdmaConfig::FromMap(const BackendConfig& m) {
  constexpr const char* kName = "RdmaBackendConfig";
  CheckConfigKeys(m, kName,
                  {"qp_per_transfer", "post_batch_size", "num_worker_threads", "poll_cq_mode", "enable_notification",
                   "notif_per_qp", "enable_transfer_chunking", "chunk_bytes", "max_chunks_per_transfer",
                   "num_nics_per_transfer", "gid_index", "sq_depth", "sq_full_timeout_ms", "connect_timeout_ms"});
  RdmaConfig c;
  constexpr int64_t kBig = INT64_C(1) << 40;
  // MORI-IO's own checks first, with its messages (users match on them).
  c.enable_notification = ConfigValue(m, kName, "enable_notification", c.enable_notification, 0, 1) != 0;
  c.notif_per_qp = ConfigValue(m, kName, "notif_per_qp", c.notif_per_qp, 0, UINT32_MAX);
  if (c.enable_notification && c.notif_per_qp == 0) {
    throw Error(StatusCode::ERR_BAD_STATE,
                "Invalid RDMA config: notifPerQp must be >= 1 when notification is enabled");
  }
  c.max_chunks_per_transfer = ConfigValue(m, kName, "max_chunks_per_transfer", c.max_chunks_per_transfer, INT32_MIN,
                                          INT32_MAX);
  if (c.max_chunks_per_transfer < 1) {
    throw Error(StatusCode::ERR_BAD_STATE, "Invalid RDMA config: maxChunksPerTransfer must be >= 1");
  }
  c.num_nics_per_transfer = ConfigValue(m, kName, "num_nics_per_transfer", c.num_nics_per_transfer, INT32_MIN,
                                        INT32_MAX);
  if (c.num_nics_per_transfer < 1) {
    throw Error(StatusCode::ERR_BAD_STATE, "Invalid RDMA config: numNicsPerTransfer must be >= 1");
  }
  c.enable_transfer_chunking =
      ConfigValue(m, kName, "enable_transfer_chunking", c.enable_transfer_chunking, 0, 1) != 0;
  c.chunk_bytes = ConfigValue(m, kName, "chunk_bytes", c.chunk_bytes, 0, kBig);
  if (c.enable_transfer_chunking && c.chunk_bytes < 4096) {
    throw Error(StatusCode::ERR_BAD_STATE,
                "Invalid RDMA config: chunkBytes must be >= 4096 when chunking is enabled");
  }
  // Our own range checks for the rest (Error names the field and value).
  c.qp_per_transfer = ConfigValue(m, kName, "qp_per_transfer", c.qp_per_transfer, 1, 64);
  c.post_batch_size = ConfigValue(m, kName, "post_batch_size", c.post_batch_size, -1, 1 << 20);
  if (c.post_batch_size == 0) {
    throw Error(StatusCode::ERR_INVALID_ARGS, std::string(kName) + " config: post_batch_size=0 (use -1 or >= 1)");
  }
  c.num_worker_threads = ConfigValue(m, kName, "num_worker_threads", c.num_worker_threads, -1, 64);
  if (c.num_worker_threads == 0) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                std::string(kName) + " config: num_worker_threads=0 (use -1 or >= 1)");
  }
  c.poll_cq_mode = static_cast<PollCqMode>(ConfigValue(m, kName, "poll_cq_mode", 0, 0, 1));
  c.gid_index = ConfigValue(m, kName, "gid_index", c.gid_index, -1, 65535);
  c.sq_depth = ConfigValue(m, kName, "sq_depth", c.sq_depth, 2, 1 << 16);
  c.sq_full_timeout_ms = ConfigValue(m, kName, "sq_full_timeout_ms", c.sq_full_timeout_ms, 0, kBig);
  c.connect_timeout_ms = ConfigValue(m, kName, "connect_timeout_ms", c.connect_timeout_ms, 1, 1 << 30);
  return c;
}

}  // namespace rdma
}  // namespace mori_torch
