// RdmaBackendConfig: MORI-IO's field names, defaults and validation messages,
// plus a few mori_torch extensions (documented below, all optional).
#pragma once

#include <cstdint>
#include <string>

#include "core/backend.h"

namespace mori_torch {
namespace rdma {

enum class PollCqMode : int { POLLING = 0, EVENT = 1 };

// FromMap sets every field; defaults, ranges and docs: base/config_table.cpp.
struct RdmaConfig {
  int64_t qp_per_transfer{};
  int64_t post_batch_size{};     // -1: ceil(work requests / QPs), one chain per QP
  int64_t num_worker_threads{};  // completion threads; -1: one
  PollCqMode poll_cq_mode{};
  bool enable_notification{};
  int64_t notif_per_qp{};  // receive buffers per QP for completion notices
  bool enable_transfer_chunking{};
  int64_t chunk_bytes{};
  int64_t max_chunks_per_transfer{};
  int64_t num_nics_per_transfer{};
  // mori_torch extensions.
  int64_t gid_index{};  // -1: env MORI_TORCH_RDMA_GID_INDEX / MORI_IB_GID_INDEX, else the IPv4-mapped RoCE v2 GID
  int64_t sq_depth{};   // send work requests per QP
  int64_t sq_full_timeout_ms{};  // how long a chain waits for send-queue room
  int64_t connect_timeout_ms{};
  int64_t inactivity_timeout_ms{};  // a QP with work in flight that completes nothing this long is dropped

  static RdmaConfig FromMap(const BackendConfig& m);
  int CompletionThreads() const { return num_worker_threads < 1 ? 1 : static_cast<int>(num_worker_threads); }
};

}  // namespace rdma
}  // namespace mori_torch
