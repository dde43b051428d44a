#include "base/config_table.h"

#include <strings.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "base/error.h"

namespace mori_torch {
namespace config {
namespace {

constexpr int64_t kTiB = INT64_C(1) << 40;
constexpr int64_t kI32 = INT32_MAX;

// Rows: scope, name, kind, default, min, max, text default, choices, doc,
// overridden key. Keep each scope's rows together: the README lists them in
// this order. A new setting is one new row (tests/python/test_config.py
// fails on a MORI_* name in the sources that has none).
Entry Int(const char* scope, const char* name, int64_t def, int64_t min, int64_t max, const char* doc,
          const char* overrides = "") {
  return {scope, name, Kind::Int, def, min, max, "", "", doc, overrides};
}
Entry Bool(const char* scope, const char* name, bool def, const char* doc, const char* overrides = "") {
  return {scope, name, Kind::Bool, def ? 1 : 0, 0, 1, "", "", doc, overrides};
}
Entry Choice(const char* scope, const char* name, int64_t def, const char* choices, const char* doc,
             const char* overrides = "") {
  return {scope, name, Kind::Choice, def, 0, 0, "", choices, doc, overrides};
}
Entry Text(const char* scope, const char* name, const char* def, const char* doc) {
  return {scope, name, Kind::Text, 0, 0, 0, def, "", doc, ""};
}

const std::vector<Entry>& Rows() {
  static const char* const E = kEnv;
  static const char* const Eng = "IOEngineConfig";
  static const char* const Tcp = "TcpBackendConfig";
  static const char* const Rdma = "RdmaBackendConfig";
  static const char* const Xgmi = "XgmiBackendConfig";
  static const std::vector<Entry> rows = {
      // Environment: the engine and its control plane.
      Text(E, "MORI_TORCH_SECRET", "",
           "Shared secret every peer must prove (HMAC-SHA256) when IOEngineConfig(secret=...) is not given; "
           "unset, the engine serves anyone who can reach it."),
      Text(E, "MORI_TORCH_NODE_ID", "",
           "Identity of this machine in engine descriptors (peers on the same node use XGMI); default: the "
           "kernel's boot id, else the hostname."),
      Text(E, "MORI_IO_NODE_ID", "", "MORI-IO's name for MORI_TORCH_NODE_ID, read when that is unset."),
      Int(E, "MORI_TORCH_FRAME_TIMEOUT_MS", 5000, 1, INT64_C(3600000),
          "Control plane: how long a peer may take to finish a frame it started, and to send its Hello."),
      Choice(E, "MORI_TORCH_LOG_LEVEL", 3, "trace,debug,info,warning,error,critical,off",
             "Lowest level of the native log (stderr); a bad value keeps the default and says so once."),
      Text(E, "MORI_TORCH_LOG", "",
           "Per-subsystem log levels, read after MORI_TORCH_LOG_LEVEL: a level and/or subsystem=level pairs, "
           "comma-separated (info,tcp=debug); subsystems core, engine, ctrl, loop, tcp, rdma, xgmi, stream, gpu, "
           "torch. A bad value is ignored and said once."),
      Bool(E, "MORI_TORCH_NVTX", false,
           "Profiler ranges (NVTX on CUDA, roctx on ROCm) around transfers and ops, as IOEngineConfig(nvtx=True)."),
      Bool(E, "MORI_TORCH_STATS", true,
           "Transfer counters (IOEngine.stats()); 0 switches them off, to measure what they cost."),
      Text(E, "MORI_TORCH_LIBCRYPTO", "libcrypto.so.3", "OpenSSL 3 libcrypto to load for the shared-secret handshake."),
      // Environment: GPU streams and staging.
      Choice(E, "MORI_TORCH_STREAM_FLAGS", 0, "auto,spin",
             "Stream-ordered ops: 'spin' forces spin kernels instead of the driver's stream memory operations."),
      Int(E, "MORI_TORCH_LOOP_SPIN_US", -1, -1, 1000000,
          "How long an event loop keeps polling (yielding) after handling events before it sleeps (us); 0: "
          "sleep at once; -1: 50 where this process may use 16 or more CPUs (affinity and cgroup quota), else "
          "0. 50 cuts small TCP "
          "round trips where cores are spare; on busy cores it costs milliseconds."),
      Int(E, "MORI_TORCH_SUBMIT_HELPERS", -1, -1, 64,
          "Helper threads that read and check long batches' offset lists alongside the submitting thread "
          "(4,096 segments or more), and write the XGMI copy kernel's list; 0: none; -1: none below 8 usable "
          "CPUs, else one per 2 CPUs beyond the first 2, at most 7."),
      Int(E, "MORI_TORCH_HELPER_SPIN_US", 200, 0, 1000000,
          "How long those helpers keep polling (yielding) after a batch before they sleep (us), so that the "
          "next batch of a burst finds them awake; while batches come less than 1 ms apart they poll through "
          "1.5 times the idle gap between them (at most 1 ms); 0: never poll."),
      Int(E, "MORI_TORCH_DOORBELL_SPIN_US", 2000, 0, 10000000,
          "Stream-ordered ops: how long the doorbell thread spins after activity before it sleeps (us)."),
      Int(E, "MORI_TORCH_FAIL_PINNED_CHUNK", 0, 0, kI32,
          "Test hook: k > 0 makes the k-th chunk of every new pinned staging set fail to pin."),
      Int(E, "MORI_TORCH_FAIL_IPC_OPENS", 0, 0, kI32,
          "Test hook: the next N XGMI mappings of a peer's memory fail like a refused IPC open (failover tests)."),
      // Environment: RDMA devices (mori_torch's and MORI's names).
      Text(E, "MORI_TORCH_IBVERBS_LIB", "libibverbs.so.1", "rdma-core verbs library to load."),
      Text(E, "MORI_TORCH_RDMA_DEVICES", "",
           "RDMA devices to use, comma-separated, in rail order; '^a,b': every device but a and b (default: "
           "every active device, rails in name order)."),
      Text(E, "MORI_RDMA_DEVICES", "",
           "MORI's name for MORI_TORCH_RDMA_DEVICES (as SGLang sets it), read when that "
           "is unset."),
      Text(E, "MORI_RDMA_DEVICE", "", "mori_torch's earlier name for MORI_RDMA_DEVICES, read when both are unset."),
      Int(E, "MORI_TORCH_RDMA_GID_INDEX", -1, 0, 65535,
          "GID index on every RDMA port when RdmaBackendConfig.gid_index is -1 (default: the IPv4-mapped "
          "RoCE v2 GID)."),
      Int(E, "MORI_IB_GID_INDEX", -1, 0, 65535, "MORI's name for MORI_TORCH_RDMA_GID_INDEX, read when that is unset."),
      Int(E, "MORI_RDMA_GID_INDEX", -1, 0, 65535,
          "mori_torch's earlier name for MORI_IB_GID_INDEX, read when both are unset."),
      // Environment: MORI-IO's overrides of RdmaBackendConfig, applied at create_backend before validation.
      Bool(E, "MORI_IO_ENABLE_NOTIFICATION", true, "Overrides RdmaBackendConfig.enable_notification.",
           "RdmaBackendConfig.enable_notification"),
      Bool(E, "MORI_IO_ENABLE_CHUNKING", false, "Overrides RdmaBackendConfig.enable_transfer_chunking.",
           "RdmaBackendConfig.enable_transfer_chunking"),
      Int(E, "MORI_IO_CHUNK_BYTES", 65536, 1, kTiB, "Overrides RdmaBackendConfig.chunk_bytes.",
          "RdmaBackendConfig.chunk_bytes"),
      Int(E, "MORI_IO_MAX_CHUNKS", 64, 1, kI32, "Overrides RdmaBackendConfig.max_chunks_per_transfer.",
          "RdmaBackendConfig.max_chunks_per_transfer"),
      Int(E, "MORI_IO_NUM_NICS_PER_TRANSFER", 1, 1, kI32, "Overrides RdmaBackendConfig.num_nics_per_transfer.",
          "RdmaBackendConfig.num_nics_per_transfer"),
      Int(E, "MORI_IO_QP_PER_TRANSFER", 1, 1, kI32, "Overrides RdmaBackendConfig.qp_per_transfer.",
          "RdmaBackendConfig.qp_per_transfer"),
      Int(E, "MORI_IO_POST_BATCH_SIZE", -1, INT64_MIN, INT64_MAX, "Overrides RdmaBackendConfig.post_batch_size.",
          "RdmaBackendConfig.post_batch_size"),
      Int(E, "MORI_IO_NUM_WORKER_THREADS", -1, 1, kI32, "Overrides RdmaBackendConfig.num_worker_threads.",
          "RdmaBackendConfig.num_worker_threads"),
      Choice(E, "MORI_IO_POLL_CQ_MODE", 0, "POLLING,EVENT", "Overrides RdmaBackendConfig.poll_cq_mode.",
             "RdmaBackendConfig.poll_cq_mode"),
      // Environment: packaging (read by Python before the library loads).
      Bool(E, "MORI_TORCH_MORI_ALIAS", false,
           "Makes `import mori` load mori-torch (read by the installed mori_torch_alias.pth at start-up)."),
      Bool(E, "MORI_TORCH_FORCE_CPU", false, "Build time (setup.py): build without GPU support."),

      // IOEngineConfig (host and secret are strings; listed for completeness).
      Text(Eng, "host", "", "Address the control plane listens on; \"\" listens on 127.0.0.1 only."),
      Int(Eng, "port", 0, 0, 65535, "Control-plane port; 0 binds a free one."),
      Text(Eng, "secret", "", "Shared secret every peer must prove; None takes MORI_TORCH_SECRET."),
      Int(Eng, "metrics_port", -1, -1, 65535,
          "Serve IOEngine.stats() for Prometheus at http://host:port/metrics (needs prometheus_client); 0 picks "
          "a free port, -1: no endpoint."),
      Bool(Eng, "nvtx", false, "Profiler ranges around transfers and ops, process-wide (as MORI_TORCH_NVTX=1)."),
      Bool(Eng, "failover", true,
           "Retry transfers whose path breaks over a fresh connection, and fail over between backends "
           "(docs/FAILOVER.md); off: a broken path fails its transfers."),
      Int(Eng, "retry_attempts", 4, 1, 64, "Attempts in all of a transfer whose path breaks (failover on)."),
      Int(Eng, "retry_budget_ms", 30000, 0, kTiB,
          "No retry starts later than this after submission (nor past the backend's op_timeout_ms)."),

      // TcpBackendConfig: MORI's TCP branch, plus mori_torch extensions.
      Int(Tcp, "sock_sndbuf_bytes", 32 << 20, 0, kI32, "SO_SNDBUF of data connections (0: the kernel's)."),
      Int(Tcp, "sock_rcvbuf_bytes", 32 << 20, 0, kI32, "SO_RCVBUF of data connections (0: the kernel's)."),
      Int(Tcp, "op_timeout_ms", 30000, 1, kTiB, "A transfer not finished this long after submission fails."),
      Bool(Tcp, "enable_keepalive", true, "TCP keepalive on data connections."),
      Int(Tcp, "keepalive_idle_sec", 30, 1, 1 << 20, "TCP_KEEPIDLE."),
      Int(Tcp, "keepalive_intvl_sec", 10, 1, 1 << 20, "TCP_KEEPINTVL."),
      Int(Tcp, "keepalive_cnt", 3, 1, 1 << 10, "TCP_KEEPCNT."),
      Bool(Tcp, "enable_ctrl_nodelay", true,
           "TCP_NODELAY on the backend's connections, which carry the transfer requests (both ends set it "
           "from their own config); off lets Nagle's algorithm hold small writes back."),
      Int(Tcp, "num_data_conns", 8, 1, 64, "Data connections per peer."),
      Int(Tcp, "striping_threshold_bytes", 64 << 10, 1, kTiB,
          "Transfers of at least this many bytes are striped across the data connections."),
      Int(Tcp, "connect_timeout_ms", 5000, 1, 1 << 30, "Bound on connecting to a peer (and at most op_timeout_ms)."),
      Bool(Tcp, "enable_notification", true, "Record inbound completion notices on the target."),
      Int(Tcp, "staging_chunk_bytes", 512 << 10, 4096, INT64_C(1) << 30,
          "GPU memory: bytes of one pinned staging chunk."),
      Int(Tcp, "staging_depth", 4, 2, 16, "GPU memory: staging chunks in flight per connection and direction."),
      Int(Tcp, "inactivity_timeout_ms", 10000, 1, kTiB,
          "A transfer whose connection moves no byte for this long fails (a slow but live link does not)."),
      Int(Tcp, "serve_threads", 0, 0, 256, "Threads serving inbound requests; 0: the core count, clamped to 4..16."),
      Int(Tcp, "inline_max_bytes", 64 << 10, 0, 1 << 30,
          "Host-memory requests up to this size are sent by the submitting thread and received and served by "
          "the event loop when all their bytes are there, without a hand-off to a worker (0: always hand off)."),
      Bool(Tcp, "poller_receives", true,
           "Where the event loop sleeps between events (MORI_TORCH_LOOP_SPIN_US 0), a thread polling a small "
           "host-memory transfer's status reads its response itself once it is all there."),
      Int(Tcp, "notice_delay_us", -1, -1, 10000000,
          "A read's completion notice to the target waits up to this long to ride on the next request to that "
          "peer, in the same system call (0: sent on its own at once; -1: 1000 where the event loop spins, "
          "MORI_TORCH_LOOP_SPIN_US, else 0)."),

      // RdmaBackendConfig: MORI-IO's fields (its own messages for its checks), plus extensions.
      Int(Rdma, "qp_per_transfer", 1, 1, 64, "RC QPs per rail and peer."),
      Int(Rdma, "post_batch_size", -1, -1, 1 << 20,
          "Work requests posted per chain (-1: one chain per QP; 0 is an error)."),
      Int(Rdma, "num_worker_threads", -1, -1, 64, "Completion threads (-1: one; 0 is an error)."),
      Choice(Rdma, "poll_cq_mode", 0, "POLLING,EVENT", "Completion threads poll, or block on completion channels."),
      Bool(Rdma, "enable_notification", true, "Completion notices to the target (a 16-byte SEND per QP used)."),
      Int(Rdma, "notif_per_qp", 1024, 0, UINT32_MAX, "Receive buffers per QP for completion notices."),
      Bool(Rdma, "enable_transfer_chunking", false, "Cut segments at chunk_bytes."),
      Int(Rdma, "chunk_bytes", 65536, 0, kTiB, "Chunk size with chunking (>= 4096)."),
      Int(Rdma, "max_chunks_per_transfer", 64, INT32_MIN, INT32_MAX, "MORI-IO's field; must be >= 1."),
      Int(Rdma, "num_nics_per_transfer", 1, INT32_MIN, INT32_MAX, "Rails (RDMA devices) a connection uses; >= 1."),
      Int(Rdma, "gid_index", -1, -1, 65535,
          "GID index (-1: MORI_TORCH_RDMA_GID_INDEX, else the port's IPv4-mapped RoCE v2 GID)."),
      Int(Rdma, "sq_depth", 512, 2, 1 << 16, "Send work requests per QP (clamped to the device's max_qp_wr)."),
      Int(Rdma, "sq_full_timeout_ms", 10000, 0, kTiB, "How long a chain waits for send-queue room, then fails."),
      Int(Rdma, "connect_timeout_ms", 5000, 1, 1 << 30, "Bound on setting up a peer's connection."),
      Int(Rdma, "inactivity_timeout_ms", 30000, 1, kTiB,
          "A connection whose QP has work in flight and completes none of it for this long is dropped: its "
          "transfers are retried over a fresh one (failover on) or fail."),

      // XgmiBackendConfig.
      Int(Xgmi, "num_streams", 64, 1, 1024, "Copy streams in the pool."),
      Int(Xgmi, "num_events", 64, 1, 1 << 16, "Completion events in the pool."),
      Int(Xgmi, "kernel_min_segments", 8, 1, INT32_MAX,
          "Batches of at least this many merged segments may use the gather/scatter kernel..."),
      Int(Xgmi, "kernel_max_avg_bytes", 8 << 20, 1, kTiB,
          "...when they average fewer bytes than this; others go to the copy engines."),
  };
  return rows;
}

Error BadEnv(const Entry& e, const char* v, const std::string& want) {
  return Error(StatusCode::ERR_INVALID_ARGS, std::string(e.name) + "='" + v + "' is not " + want);
}

// "a, b, c" names of a Choice.
std::vector<std::string> ChoiceNames(const Entry& e) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* p = e.choices;; ++p) {
    if (*p == ',' || *p == '\0') {
      out.push_back(cur);
      cur.clear();
      if (*p == '\0') break;
    } else {
      cur += *p;
    }
  }
  return out;
}

int64_t ParseInt(const Entry& e, const char* v) {
  const std::string want = "an integer in [" + std::to_string(e.min) + ", " + std::to_string(e.max) + "]";
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || n < e.min || n > e.max) throw BadEnv(e, v, want);
  return n;
}

int64_t ParseBool(const Entry& e, const char* v) {
  for (const char* t : {"1", "true", "yes", "on"}) {
    if (strcasecmp(v, t) == 0) return 1;
  }
  for (const char* f : {"0", "false", "no", "off"}) {
    if (strcasecmp(v, f) == 0) return 0;
  }
  throw BadEnv(e, v, "a boolean (1/0, true/false, yes/no, on/off)");
}

int64_t ParseChoice(const Entry& e, const char* v) {
  const std::vector<std::string> names = ChoiceNames(e);
  std::string list;
  for (size_t i = 0; i < names.size(); ++i) {
    if (strcasecmp(v, names[i].c_str()) == 0 || std::to_string(i) == v) return static_cast<int64_t>(i);
    list += (i ? ", " : "") + names[i];
  }
  throw BadEnv(e, v, "one of " + list);
}

const Entry& EnvEntry(const char* name, std::initializer_list<Kind> kinds) {
  const Entry& e = Lookup(kEnv, name);
  for (Kind k : kinds) {
    if (e.kind == k) return e;
  }
  throw std::logic_error(std::string("config table: ") + name + " is not read as this kind");
}

const char* RawEnv(const char* name) {
  const char* v = std::getenv(name);  // the one getenv of the library
  return v && *v ? v : nullptr;
}

}  // namespace

const std::vector<Entry>& Table() { return Rows(); }

const Entry& Lookup(const char* scope, const std::string& name) {
  for (const Entry& e : Rows()) {
    if (name == e.name && std::strcmp(scope, e.scope) == 0) return e;
  }
  throw std::logic_error("config table: " + std::string(scope) + " '" + name + "' is not declared");
}

bool EnvIsSet(const char* name) {
  Lookup(kEnv, name);
  return RawEnv(name) != nullptr;
}

int64_t EnvInt(const char* name) {
  const Entry& e = EnvEntry(name, {Kind::Int, Kind::Choice});
  const char* v = RawEnv(name);
  if (!v) return e.def;
  return e.kind == Kind::Int ? ParseInt(e, v) : ParseChoice(e, v);
}

bool EnvBool(const char* name) {
  const Entry& e = EnvEntry(name, {Kind::Bool});
  const char* v = RawEnv(name);
  return (v ? ParseBool(e, v) : e.def) != 0;
}

std::string EnvText(const char* name) {
  const Entry& e = EnvEntry(name, {Kind::Text});
  const char* v = RawEnv(name);
  return v ? v : e.text_def;
}

void CheckKnownKeys(const std::map<std::string, int64_t>& given, const char* scope) {
  for (const auto& kv : given) {
    bool known = false;
    for (const Entry& e : Rows()) known = known || (kv.first == e.name && std::strcmp(scope, e.scope) == 0);
    if (!known) {
      throw Error(StatusCode::ERR_INVALID_ARGS, std::string(scope) + " config: unknown field '" + kv.first + "'");
    }
  }
}

int64_t Value(const std::map<std::string, int64_t>& given, const char* scope, const char* key) {
  const Entry& e = Lookup(scope, key);
  auto it = given.find(key);
  const int64_t v = it == given.end() ? e.def : it->second;
  const int64_t min = e.kind == Kind::Int ? e.min : 0;
  const int64_t max = e.kind == Kind::Int    ? e.max
                      : e.kind == Kind::Bool ? 1
                                             : static_cast<int64_t>(ChoiceNames(e).size()) - 1;
  if (v < min || v > max) {
    throw Error(StatusCode::ERR_INVALID_ARGS, std::string(scope) + " config: " + key + "=" + std::to_string(v) +
                                                  " out of range [" + std::to_string(min) + ", " + std::to_string(max) +
                                                  "]");
  }
  return v;
}

}  // namespace config
}  // namespace mori_torch
