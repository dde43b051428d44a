#include "gpu/staging.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "base/config_table.h"
#include "base/error.h"
#include "gpu/stream_ops.h"

namespace mori_torch {
namespace gpu {
namespace {

// Test hook: MORI_TORCH_FAIL_PINNED_CHUNK=k makes the k-th chunk of every
// new set fail to pin, so tests can check that the ones before it are freed.
int InjectedFailureAt() { return static_cast<int>(config::EnvInt("MORI_TORCH_FAIL_PINNED_CHUNK")); }

}  // namespace

StagingSet::StagingSet(uint64_t chunk_bytes, int depth, int numa_node) : chunk_bytes_(chunk_bytes) {
  if (chunk_bytes == 0 || depth < 1) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "staging set needs chunk_bytes > 0 and depth >= 1, got " +
                                                  std::to_string(chunk_bytes) + " and " + std::to_string(depth));
  }
  const int fail_at = InjectedFailureAt();
  // Built on a connection's thread at its first GPU transfer, maybe while
  // another thread captures a CUDA graph: host registration must not break it.
  RelaxedCaptureScope relaxed;
  chunks_.reserve(static_cast<size_t>(depth));
  lists_bytes_ = static_cast<size_t>(depth) * kListEntries * sizeof(CopySegment);
  try {
    for (int i = 0; i < depth; ++i) {
      if (fail_at == i + 1) {
        throw Error(StatusCode::ERR_GPU_OP,
                    "pinning staging chunk " + std::to_string(i + 1) + " failed (MORI_TORCH_FAIL_PINNED_CHUNK)");
      }
      Chunk c;
      c.ptr = PinnedAlloc(chunk_bytes, numa_node);
      chunks_.push_back(c);
      chunks_.back().dev_ptr = DevicePointerOfPinned(c.ptr);
    }
    lists_ = PinnedAlloc(lists_bytes_, numa_node);
    for (int i = 0; i < depth; ++i) {
      chunks_[i].list = static_cast<CopySegment*>(lists_) + static_cast<size_t>(i) * kListEntries;
      chunks_[i].list_dev_ptr = DevicePointerOfPinned(chunks_[i].list);
    }
  } catch (...) {
    for (auto& c : chunks_) PinnedFree(c.ptr, chunk_bytes_);
    chunks_.clear();
    PinnedFree(lists_, lists_bytes_);
    throw;
  }
}

StagingSet::~StagingSet() {
  RelaxedCaptureScope relaxed;  // freeing pinned memory must not break a capture elsewhere
  try {
    WaitAll();
  } catch (const Error&) {
    // A device error leaves nothing to wait for; free regardless.
  }
  for (auto& l : lanes_) {
    for (Event e : l.events) DestroyEvent(e, l.device);
    DestroyStream(l.stream, l.device);
  }
  for (auto& c : chunks_) PinnedFree(c.ptr, chunk_bytes_);
  PinnedFree(lists_, lists_bytes_);
}

StagingSet::Lane& StagingSet::LaneOf(int device) {
  for (auto& l : lanes_) {
    if (l.device == device) return l;
  }
  WarmUpKernels(device);  // before any stream of this process waits on host memory
  Lane l;
  l.device = device;
  l.stream = CreateStream(device);
  try {
    for (size_t i = 0; i < chunks_.size(); ++i) l.events.push_back(CreateEvent(device));
  } catch (...) {
    for (Event e : l.events) DestroyEvent(e, device);
    DestroyStream(l.stream, device);
    throw;
  }
  lanes_.push_back(std::move(l));
  return lanes_.back();
}

void StagingSet::Copy(int i, const std::vector<Piece>& pieces, Direction dir, int device) {
  // Below this many pieces, copy-engine copies beat a kernel launch.
  constexpr size_t kKernelMinPieces = 8;
  // The kernel copies each list entry with one group of threads: pieces are
  // cut to 4 KiB (half a group's pass) so that many groups share a chunk.
  constexpr uint64_t kEntryBytes = 4096;
  // A set moves between threads (pooled), and any of them may copy or wait
  // while a user thread captures a graph: no call here may break that capture.
  RelaxedCaptureScope relaxed;
  Lane& l = LaneOf(device);
  Chunk& c = chunks_[i];
  const bool to_chunk = dir == Direction::kDeviceToChunk;
  size_t entries = 0;
  if (pieces.size() >= kKernelMinPieces) {
    for (const auto& p : pieces) entries += (p.bytes + kEntryBytes - 1) / kEntryBytes;
  }
  if (entries != 0 && entries <= kListEntries) {
    size_t k = 0;
    for (const auto& p : pieces) {
      for (uint64_t off = 0; off < p.bytes; off += kEntryBytes, ++k) {
        const uint64_t host = c.dev_ptr + p.at + off;
        const uint64_t dev = p.dev_ptr + off;
        c.list[k] = {to_chunk ? host : dev, to_chunk ? dev : host, std::min(kEntryBytes, p.bytes - off)};
      }
    }
    DeviceScope on(device);
    LaunchSegmentCopy(reinterpret_cast<const CopySegment*>(c.list_dev_ptr), static_cast<uint32_t>(k), l.stream);
  } else {
    const uint64_t host = reinterpret_cast<uint64_t>(c.ptr);
    for (const auto& p : pieces) {
      if (to_chunk) {
        CopyAsync(host + p.at, p.dev_ptr, p.bytes, l.stream);
      } else {
        CopyAsync(p.dev_ptr, host + p.at, p.bytes, l.stream);
      }
    }
  }
  RecordEvent(l.events[i], l.stream);
  c.sealed = l.events[i];
}

void StagingSet::Wait(int i) {
  Event e = chunks_[i].sealed;
  if (!e) return;
  chunks_[i].sealed = nullptr;
  RelaxedCaptureScope relaxed;  // a wait during another thread's global-mode capture would invalidate it
  SynchronizeEvent(e);
}

void StagingSet::WaitAll() {
  for (auto& c : chunks_) c.sealed = nullptr;
  RelaxedCaptureScope relaxed;
  for (auto& l : lanes_) SynchronizeStream(l.stream);
}

std::unique_ptr<StagingSet> StagingPool::Take(int device) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!idle_.empty()) {
      auto s = std::move(idle_.back());
      idle_.pop_back();
      return s;
    }
  }
  DeviceScope on(device);  // the pinning below acts on the current device's context
  return std::make_unique<StagingSet>(chunk_bytes_, depth_, NumaNodeOf(device));
}

void StagingPool::Give(std::unique_ptr<StagingSet> set) {
  if (!set) return;
  try {
    set->WaitAll();
  } catch (const Error&) {
    return;  // a set whose copies failed is not reused
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (!closed_ && idle_.size() < max_idle_) idle_.push_back(std::move(set));
}

void StagingPool::Close() {
  std::vector<std::unique_ptr<StagingSet>> drop;
  std::lock_guard<std::mutex> lk(mu_);
  closed_ = true;
  drop.swap(idle_);
}

}  // namespace gpu
}  // namespace mori_torch
