// Errors of stream-ordered transfers, which end after the op returned (on
// the GPU, or on the doorbell's progress thread): kept per session until the
// caller checks. The record kernels write lives in pinned, device-mapped
// host memory, so checking needs no CUDA call.
#pragma once

#include <mutex>
#include <string>

#include "core/types.h"
#include "gpu/stream_ops.h"

namespace mori_torch {

class StreamErrors {
 public:
  StreamErrors();
  ~StreamErrors();
  StreamErrors(const StreamErrors&) = delete;
  StreamErrors& operator=(const StreamErrors&) = delete;

  // Device address for kernels (nullptr without a GPU).
  gpu::StreamError* device_record() const { return device_record_; }
  // Keeps the first error until Take.
  void Record(StatusCode code, const std::string& message);
  // The pending error ("" when none), cleared by the call; *code is set
  // to its status code.
  std::string Take(StatusCode* code);

 private:
  gpu::StreamError* host_record_ = nullptr;
  gpu::StreamError* device_record_ = nullptr;
  bool pinned_ = false;
  std::mutex mu_;
  StatusCode code_ = StatusCode::SUCCESS;
  std::string message_;
};

// Host memory a GPU can reach when one is present (PinnedAlloc), plain
// page-aligned memory otherwise, zero-filled. Freed with FreeHostWords.
void* AllocHostWords(size_t bytes, bool* pinned);
void FreeHostWords(void* p, size_t bytes, bool pinned);

}  // namespace mori_torch
