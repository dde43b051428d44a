#include "backends/rdma/rdma_config.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <strings.h>

namespace mori_torch {
namespace rdma {
namespace {

enum class EnvKind { Bool, Positive, AnyInt, PollMode };

int64_t ParseEnv(const char* var, const char* v, EnvKind kind) {
  auto bad = [&](const char* want) {
    return Error(StatusCode::ERR_INVALID_ARGS,
                 std::string(var) + "='" + v + "' is not " + want + " (environment override of RdmaBackendConfig)");
  };
  if (kind == EnvKind::Bool) {
    for (const char* t : {"1", "true", "yes", "on"}) {
      if (strcasecmp(v, t) == 0) return 1;
    }
    for (const char* f : {"0", "false", "no", "off"}) {
      if (strcasecmp(v, f) == 0) return 0;
    }
    throw bad("a boolean (1/0, true/false, yes/no, on/off)");
  }
  if (kind == EnvKind::PollMode) {
    if (strcasecmp(v, "POLLING") == 0 || std::strcmp(v, "0") == 0) return 0;
    if (strcasecmp(v, "EVENT") == 0 || std::strcmp(v, "1") == 0) return 1;
    throw bad("POLLING or EVENT");
  }
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0') throw bad("an integer");
  if (kind == EnvKind::Positive && n < 1) throw bad("a positive integer");
  return n;
}

// MORI-IO's environment overrides (deployment scripts set them): each
// replaces the config field it names before validation.
BackendConfig WithEnvOverrides(BackendConfig m) {
  struct Override {
    const char* var;
    const char* key;
    EnvKind kind;
  };
  static const Override kOverrides[] = {
      {"MORI_IO_ENABLE_NOTIFICATION", "enable_notification", EnvKind::Bool},
      {"MORI_IO_ENABLE_CHUNKING", "enable_transfer_chunking", EnvKind::Bool},
      {"MORI_IO_CHUNK_BYTES", "chunk_bytes", EnvKind::Positive},
      {"MORI_IO_MAX_CHUNKS", "max_chunks_per_transfer", EnvKind::Positive},
      {"MORI_IO_NUM_NICS_PER_TRANSFER", "num_nics_per_transfer", EnvKind::Positive},
      {"MORI_IO_QP_PER_TRANSFER", "qp_per_transfer", EnvKind::Positive},
      {"MORI_IO_POST_BATCH_SIZE", "post_batch_size", EnvKind::AnyInt},
      {"MORI_IO_NUM_WORKER_THREADS", "num_worker_threads", EnvKind::Positive},
      {"MORI_IO_POLL_CQ_MODE", "poll_cq_mode", EnvKind::PollMode},
  };
  for (const Override& o : kOverrides) {
    const char* v = std::getenv(o.var);
    if (v && *v) m[o.key] = ParseEnv(o.var, v, o.kind);
  }
  return m;
}

}  // namespace

RdmaConfig RdmaConfig::FromMap(const BackendConfig& given) {
  constexpr const char* kName = "RdmaBackendConfig";
  const BackendConfig m = WithEnvOverrides(given);
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
