// Per-engine transfer counters, per remote engine and backend: transfers,
// bytes, errors by status code, in flight, and a latency histogram with fixed
// power-of-two buckets. The hot path touches only relaxed atomics of the
// pair's own counters (found through lookups the engine does anyway); a
// snapshot sums them without stopping anybody, so it may be a few transfers
// behind while they run.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "core/types.h"

namespace mori_torch {

// Bucket i counts latencies under 2^i microseconds (and at least 2^(i-1)
// for i > 0); the last bucket has no upper bound.
constexpr int kLatencyBuckets = 28;
// Errors are counted by status code value; codes beyond this share the last slot.
constexpr int kStatusCodeSlots = 32;

// A plain copy of the counters (a snapshot, or the sum of several).
struct TransferCountsSnapshot {
  uint64_t reads = 0, writes = 0;              // submitted, rejected ones included
  uint64_t bytes_read = 0, bytes_written = 0;  // of transfers that succeeded
  uint64_t succeeded = 0;
  std::array<uint64_t, kStatusCodeSlots> errors{};  // by status code
  int64_t in_flight = 0;
  std::array<uint64_t, kLatencyBuckets> latency{};  // submit to end, ended transfers
  uint64_t latency_sum_ns = 0;

  void Add(const TransferCountsSnapshot& o);
  uint64_t Transfers() const { return reads + writes; }
  uint64_t Errors() const;
  // As a JSON object (see TransferStats::ToJson for the fields).
  std::string ToJson() const;
};

class TransferCounters {
 public:
  // A transfer handed to a backend: in flight until End.
  void Start(bool is_read) {
    (is_read ? reads_ : writes_).fetch_add(1, std::memory_order_relaxed);
    in_flight_.fetch_add(1, std::memory_order_relaxed);
  }
  // A transfer refused before it started (bad arguments, nothing to serve it).
  void Rejected(bool is_read, StatusCode code) {
    (is_read ? reads_ : writes_).fetch_add(1, std::memory_order_relaxed);
    errors_[Slot(code)].fetch_add(1, std::memory_order_relaxed);
  }
  // A started transfer reached its first terminal code after elapsed_ns.
  void End(bool is_read, uint64_t bytes, StatusCode code, int64_t elapsed_ns);

  TransferCountsSnapshot Snapshot() const;

  static int LatencyBucket(int64_t elapsed_ns);
  static int Slot(StatusCode code) {
    const int c = static_cast<int>(code);
    return c < 0 ? 0 : (c >= kStatusCodeSlots ? kStatusCodeSlots - 1 : c);
  }

 private:
  using Counter = std::atomic<uint64_t>;
  // Submitting threads write the first line, backend threads the rest.
  alignas(64) Counter reads_{0};
  Counter writes_{0};
  std::atomic<int64_t> in_flight_{0};
  alignas(64) Counter bytes_read_{0};
  Counter bytes_written_{0};
  Counter succeeded_{0};
  Counter latency_sum_ns_{0};
  std::array<Counter, kStatusCodeSlots> errors_{};
  std::array<Counter, kLatencyBuckets> latency_{};
};

// What a transfer carries to its end: whose counters, which way, how many
// bytes, since when (TransferStatus calls End on its first terminal code).
struct TransferRecord {
  std::shared_ptr<TransferCounters> counters;
  bool is_read = false;
  uint64_t bytes = 0;
  int64_t start_ns = 0;
  uint64_t trace_range = 0;  // gpu::TraceRangeStart's id, 0 for none
};

// False when MORI_TORCH_STATS=0 (read once): transfers skip the counters
// (benchmarks/bench_stats.py measures what they cost).
bool StatsEnabled();

// Steady-clock nanoseconds.
int64_t StatsNowNs();

// One engine's counters: one TransferCounters per (remote engine key, backend
// type), kept for the engine's life (a remote that leaves keeps its history),
// plus one for transfers refused before a backend was chosen.
class TransferStats {
 public:
  static constexpr int kBackendSlots = 4;  // indexed by BackendType
  struct PeerCounters {
    std::array<TransferCounters, kBackendSlots> by_backend;
  };

  // The counters of remote engine `key`, created on first use. Callers keep
  // the pointer (the engine's remote table, sessions) so transfers skip this
  // lookup.
  std::shared_ptr<PeerCounters> ForPeer(const std::string& key);
  // The counters of one pair, sharing ownership with its PeerCounters;
  // null (transfers not counted) when MORI_TORCH_STATS=0.
  static std::shared_ptr<TransferCounters> Of(const std::shared_ptr<PeerCounters>& peer, BackendType type);
  TransferCounters& Unrouted() { return unrouted_; }

  // {"engine": ..., "total": C, "backends": {"TCP": C, ...},
  //  "peers": {key: {"TCP": C, ...}}, "unrouted": C,
  //  "latency_bounds_us": [1, 2, 4, ...]} where C is
  // {"reads", "writes", "transfers", "bytes_read", "bytes_written", "bytes",
  //  "succeeded", "errors": {"ERR_...": n}, "in_flight",
  //  "latency": {"buckets": [n per bound], "count", "sum_ns"}}.
  // Backends and peers with no transfers are left out.
  std::string ToJson(const std::string& engine_key) const;

 private:
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<PeerCounters>> peers_;
  TransferCounters unrouted_;
};

}  // namespace mori_torch
