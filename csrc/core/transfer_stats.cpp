#include "core/transfer_stats.h"

#include <chrono>
#include <cstdio>

#include "base/config_table.h"

namespace mori_torch {
namespace {

// A JSON string literal of `s` (peer keys are the user's: quote everything
// JSON requires; bytes >= 0x80 pass through as they are).
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string CodeName(int slot) {
  const char* name = StatusCodeName(static_cast<StatusCode>(slot));
  // Unnamed codes come back as "UNKNOWN" (or similar): keep them apart.
  std::string n = name ? name : "";
  if (n.rfind("ERR_", 0) != 0) n = "CODE_" + std::to_string(slot);
  return n;
}

}  // namespace

bool StatsEnabled() {
  static const bool on = [] {
    try {
      return config::EnvBool("MORI_TORCH_STATS");
    } catch (const Error& e) {  // read on the first transfer: never throw there
      std::fprintf(stderr, "mori_torch: %s; transfer counters stay on\n", e.what());
      return true;
    }
  }();
  return on;
}

int64_t StatsNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int TransferCounters::LatencyBucket(int64_t elapsed_ns) {
  const uint64_t us = elapsed_ns > 0 ? static_cast<uint64_t>(elapsed_ns) / 1000 : 0;
  const int width = us == 0 ? 0 : 64 - __builtin_clzll(us);  // bucket i: under 2^i us
  return width < kLatencyBuckets ? width : kLatencyBuckets - 1;
}

void TransferCounters::End(bool is_read, uint64_t bytes, StatusCode code, int64_t elapsed_ns) {
  if (code == StatusCode::SUCCESS) {
    succeeded_.fetch_add(1, std::memory_order_relaxed);
    (is_read ? bytes_read_ : bytes_written_).fetch_add(bytes, std::memory_order_relaxed);
  } else {
    errors_[Slot(code)].fetch_add(1, std::memory_order_relaxed);
  }
  latency_[LatencyBucket(elapsed_ns)].fetch_add(1, std::memory_order_relaxed);
  latency_sum_ns_.fetch_add(elapsed_ns > 0 ? static_cast<uint64_t>(elapsed_ns) : 0, std::memory_order_relaxed);
  in_flight_.fetch_sub(1, std::memory_order_relaxed);
}

TransferCountsSnapshot TransferCounters::Snapshot() const {
  TransferCountsSnapshot s;
  s.reads = reads_.load(std::memory_order_relaxed);
  s.writes = writes_.load(std::memory_order_relaxed);
  s.bytes_read = bytes_read_.load(std::memory_order_relaxed);
  s.bytes_written = bytes_written_.load(std::memory_order_relaxed);
  s.succeeded = succeeded_.load(std::memory_order_relaxed);
  s.in_flight = in_flight_.load(std::memory_order_relaxed);
  s.latency_sum_ns = latency_sum_ns_.load(std::memory_order_relaxed);
  for (int i = 0; i < kStatusCodeSlots; ++i) s.errors[i] = errors_[i].load(std::memory_order_relaxed);
  for (int i = 0; i < kLatencyBuckets; ++i) s.latency[i] = latency_[i].load(std::memory_order_relaxed);
  return s;
}

void TransferCountsSnapshot::Add(const TransferCountsSnapshot& o) {
  reads += o.reads;
  writes += o.writes;
  bytes_read += o.bytes_read;
  bytes_written += o.bytes_written;
  succeeded += o.succeeded;
  in_flight += o.in_flight;
  latency_sum_ns += o.latency_sum_ns;
  for (int i = 0; i < kStatusCodeSlots; ++i) errors[i] += o.errors[i];
  for (int i = 0; i < kLatencyBuckets; ++i) latency[i] += o.latency[i];
}

uint64_t TransferCountsSnapshot::Errors() const {
  uint64_t n = 0;
  for (uint64_t e : errors) n += e;
  return n;
}

std::string TransferCountsSnapshot::ToJson() const {
  auto num = [](uint64_t v) { return std::to_string(v); };
  std::string errs, buckets;
  for (int i = 0; i < kStatusCodeSlots; ++i) {
    if (!errors[i]) continue;
    errs += (errs.empty() ? "" : ", ") + JsonString(CodeName(i)) + ": " + num(errors[i]);
  }
  uint64_t ended = 0;
  for (int i = 0; i < kLatencyBuckets; ++i) {
    buckets += (i ? ", " : "") + num(latency[i]);
    ended += latency[i];
  }
  return "{\"reads\": " + num(reads) + ", \"writes\": " + num(writes) + ", \"transfers\": " + num(Transfers()) +
         ", \"bytes_read\": " + num(bytes_read) + ", \"bytes_written\": " + num(bytes_written) +
         ", \"bytes\": " + num(bytes_read + bytes_written) + ", \"succeeded\": " + num(succeeded) + ", \"errors\": {" +
         errs + "}, \"in_flight\": " + std::to_string(in_flight) + ", \"latency\": {\"buckets\": [" + buckets +
         "], \"count\": " + num(ended) + ", \"sum_ns\": " + num(latency_sum_ns) + "}}";
}

std::shared_ptr<TransferStats::PeerCounters> TransferStats::ForPeer(const std::string& key) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& p = peers_[key];
  if (!p) p = std::make_shared<PeerCounters>();
  return p;
}

std::shared_ptr<TransferCounters> TransferStats::Of(const std::shared_ptr<PeerCounters>& peer, BackendType type) {
  const int i = static_cast<int>(type);
  if (!peer || i < 0 || i >= kBackendSlots || !StatsEnabled()) return nullptr;
  return std::shared_ptr<TransferCounters>(peer, &peer->by_backend[i]);  // aliasing: owns the peer's block
}

std::string TransferStats::ToJson(const std::string& engine_key) const {
  std::map<std::string, std::shared_ptr<PeerCounters>> peers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    peers = peers_;
  }
  TransferCountsSnapshot total = unrouted_.Snapshot();
  const TransferCountsSnapshot unrouted = total;
  std::array<TransferCountsSnapshot, kBackendSlots> per_backend;
  std::string peers_json;
  for (const auto& kv : peers) {
    std::string entry;
    for (int b = 0; b < kBackendSlots; ++b) {
      TransferCountsSnapshot s = kv.second->by_backend[b].Snapshot();
      if (s.Transfers() == 0) continue;
      per_backend[b].Add(s);
      total.Add(s);
      entry +=
          (entry.empty() ? "" : ", ") + JsonString(BackendTypeName(static_cast<BackendType>(b))) + ": " + s.ToJson();
    }
    if (!entry.empty()) peers_json += (peers_json.empty() ? "" : ", ") + JsonString(kv.first) + ": {" + entry + "}";
  }
  std::string backends_json;
  for (int b = 0; b < kBackendSlots; ++b) {
    if (per_backend[b].Transfers() == 0) continue;
    backends_json += (backends_json.empty() ? "" : ", ") + JsonString(BackendTypeName(static_cast<BackendType>(b))) +
                     ": " + per_backend[b].ToJson();
  }
  std::string bounds;
  for (int i = 0; i + 1 < kLatencyBuckets; ++i) bounds += (i ? ", " : "") + std::to_string(uint64_t{1} << i);
  return "{\"engine\": " + JsonString(engine_key) + ", \"total\": " + total.ToJson() + ", \"backends\": {" +
         backends_json + "}, \"peers\": {" + peers_json + "}, \"unrouted\": " + unrouted.ToJson() +
         ", \"latency_bounds_us\": [" + bounds + "]}";
}

}  // namespace mori_torch
