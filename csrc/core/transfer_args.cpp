#include "core/transfer_args.h"

#include "core/memory_registry.h"

namespace mori_torch {

StatusCode BuildSegments(const std::vector<int64_t>& local_offsets, const std::vector<int64_t>& remote_offsets,
                         const std::vector<int64_t>& sizes, const MemoryDesc& local, const MemoryDesc& remote,
                         std::vector<Segment>* out, std::string* msg) {
  const size_t n = sizes.size();
  if (local_offsets.size() != n || remote_offsets.size() != n) {
    *msg = "mismatched list lengths: local_offsets has " + std::to_string(local_offsets.size()) +
           ", remote_offsets has " + std::to_string(remote_offsets.size()) + ", sizes has " + std::to_string(n);
    return StatusCode::ERR_INVALID_ARGS;
  }
  out->clear();
  out->reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t lo = local_offsets[i], ro = remote_offsets[i], sz = sizes[i];
    if (lo < 0 || ro < 0 || sz < 0) {
      *msg = "negative value in segment " + std::to_string(i) + ": local_offset=" + std::to_string(lo) +
             ", remote_offset=" + std::to_string(ro) + ", size=" + std::to_string(sz);
      return StatusCode::ERR_INVALID_ARGS;
    }
    std::string e = CheckRange(local, static_cast<uint64_t>(lo), static_cast<uint64_t>(sz), "local");
    if (e.empty()) e = CheckRange(remote, static_cast<uint64_t>(ro), static_cast<uint64_t>(sz), "remote");
    if (!e.empty()) {
      *msg = (n > 1 ? "segment " + std::to_string(i) + ": " : std::string()) + e;
      return StatusCode::ERR_INVALID_ARGS;
    }
    out->push_back({static_cast<uint64_t>(lo), static_cast<uint64_t>(ro), static_cast<uint64_t>(sz)});
  }
  return StatusCode::SUCCESS;
}

}  // namespace mori_torch
