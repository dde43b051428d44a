#include "gpu/staging.h"

#include <cstdlib>
#include <string>

#include "core/types.h"

namespace mori_torch {
namespace gpu {
namespace {

// Test hook: MORI_TORCH_FAIL_PINNED_CHUNK=k makes the k-th chunk of every
// new set fail to pin, so tests can check that the ones before it are freed.
int InjectedFailureAt() {
  const char* v = std::getenv("MORI_TORCH_FAIL_PINNED_CHUNK");
  return v ? std::atoi(v) : 0;
}

}  // namespace

StagingSet::StagingSet(uint64_t chunk_bytes, int depth, int numa_node) : chunk_bytes_(chunk_bytes) {
  if (chunk_bytes == 0 || depth < 1) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "staging set needs chunk_bytes > 0 and depth >= 1, got " +
                                                  std::to_string(chunk_bytes) + " and " + std::to_string(depth));
  }
  const int fail_at = InjectedFailureAt();
  chunks_.reserve(static_cast<size_t>(depth));
  try {
    for (int i = 0; i < depth; ++i) {
      if (fail_at == i + 1) {
        throw Error(StatusCode::ERR_GPU_OP,
                    "pinning staging chunk " + std::to_string(i + 1) + " failed (MORI_TORCH_FAIL_PINNED_CHUNK)");
      }
      chunks_.push_back({PinnedAlloc(chunk_bytes, numa_node), nullptr});
    }
  } catch (...) {
    for (auto& c : chunks_) PinnedFree(c.ptr, chunk_bytes_);
    chunks_.clear();
    throw;
  }
}

StagingSet::~StagingSet() {
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
}

StagingSet::Lane& StagingSet::LaneOf(int device) {
  for (auto& l : lanes_) {
    if (l.device == device) return l;
  }
  RelaxCaptureModeForThisThread();
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

void StagingSet::CopyFromDevice(int i, uint64_t at, uint64_t dev_ptr, uint64_t bytes, int device) {
  CopyAsync(reinterpret_cast<uint64_t>(chunk(i)) + at, dev_ptr, bytes, LaneOf(device).stream);
}

void StagingSet::CopyToDevice(int i, uint64_t at, uint64_t dev_ptr, uint64_t bytes, int device) {
  CopyAsync(dev_ptr, reinterpret_cast<uint64_t>(chunk(i)) + at, bytes, LaneOf(device).stream);
}

void StagingSet::Seal(int i, int device) {
  Lane& l = LaneOf(device);
  RecordEvent(l.events[i], l.stream);
  chunks_[i].sealed = l.events[i];
}

void StagingSet::Wait(int i) {
  Event e = chunks_[i].sealed;
  if (!e) return;
  chunks_[i].sealed = nullptr;
  SynchronizeEvent(e);
}

void StagingSet::WaitAll() {
  for (auto& c : chunks_) c.sealed = nullptr;
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
  if (idle_.size() < max_idle_) idle_.push_back(std::move(set));
}

void StagingPool::Clear() {
  std::vector<std::unique_ptr<StagingSet>> drop;
  std::lock_guard<std::mutex> lk(mu_);
  drop.swap(idle_);
}

}  // namespace gpu
}  // namespace mori_torch
