// Pinned staging (bounce) buffers for host-driven transports that move GPU
// memory: a StagingSet is `depth` chunks of page-locked host memory (anonymous
// mmap + host registration, on the GPU's NUMA node where known) with a copy
// stream and one event per chunk on each device it serves, so the copy of one
// chunk overlaps the network I/O of another. A StagingPool keeps idle sets
// for reuse: pinning is slow, connections come and go.
//
// Vendor-free: built on gpu_runtime.h only. One thread uses a set at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "gpu/gpu_runtime.h"

namespace mori_torch {
namespace gpu {

class StagingSet {
 public:
  // Allocates and pins all chunks now; if one fails, frees those already
  // made (nothing stays pinned) and throws Error(ERR_GPU_OP).
  StagingSet(uint64_t chunk_bytes, int depth, int numa_node);
  ~StagingSet();
  StagingSet(const StagingSet&) = delete;
  StagingSet& operator=(const StagingSet&) = delete;

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  int depth() const { return static_cast<int>(chunks_.size()); }
  char* chunk(int i) const { return static_cast<char*>(chunks_[i].ptr); }

  // Most pieces one chunk's copy takes.
  static constexpr size_t kMaxPieces = 1024;
  // Entries of a chunk's kernel list (pieces cut to 4 KiB); a chunk that
  // needs more goes to the copy engines.
  static constexpr size_t kListEntries = 2048;
  struct Piece {
    uint64_t dev_ptr;  // device memory of `device`
    uint64_t at;       // offset in the chunk
    uint64_t bytes;
  };
  enum class Direction { kDeviceToChunk, kChunkToDevice };
  // Issues the copies between chunk `i` and device memory, asynchronously on
  // the set's stream for `device`, then seals the chunk: many small pieces
  // go as one gather/scatter kernel launch (its list in pinned memory),
  // few as copy-engine copies.
  void Copy(int i, const std::vector<Piece>& pieces, Direction dir, int device);
  // Waits for chunk `i`'s sealed copies (no-op when none are pending).
  void Wait(int i);
  // Waits for everything issued; used before reuse or on error paths so no
  // copy still runs into or out of a chunk.
  void WaitAll();

 private:
  struct Chunk {
    void* ptr = nullptr;
    uint64_t dev_ptr = 0;         // the chunk as kernels see it
    CopySegment* list = nullptr;  // the kernel's segment list (pinned)
    uint64_t list_dev_ptr = 0;
    Event sealed = nullptr;  // event of the device that last copied, or null
  };
  struct Lane {  // per device
    int device = -1;
    Stream stream = nullptr;
    std::vector<Event> events;  // one per chunk
  };
  Lane& LaneOf(int device);

  uint64_t chunk_bytes_;
  std::vector<Chunk> chunks_;
  void* lists_ = nullptr;  // one pinned block holding every chunk's list
  size_t lists_bytes_ = 0;
  std::vector<Lane> lanes_;
};

class StagingPool {
 public:
  StagingPool(uint64_t chunk_bytes, int depth, size_t max_idle)
      : chunk_bytes_(chunk_bytes), depth_(depth), max_idle_(max_idle) {}
  // An idle set, or a new one on `device`'s NUMA node; throws like StagingSet.
  std::unique_ptr<StagingSet> Take(int device);
  // Returns a set (after its copies finished); frees it if enough are idle.
  void Give(std::unique_ptr<StagingSet> set);
  // Frees every idle set; sets given back afterwards are freed at once.
  void Close();

 private:
  const uint64_t chunk_bytes_;
  const int depth_;
  const size_t max_idle_;
  std::mutex mu_;
  bool closed_ = false;
  std::vector<std::unique_ptr<StagingSet>> idle_;
};

}  // namespace gpu
}  // namespace mori_torch
