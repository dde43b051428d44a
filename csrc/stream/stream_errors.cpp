#include "stream/stream_errors.h"

#include <sys/mman.h>

#include <cstring>

namespace mori_torch {

void* AllocHostWords(size_t bytes, bool* pinned) {
  void* p = nullptr;
  *pinned = gpu::DeviceCount() > 0;
  if (*pinned) {
    gpu::RelaxedCaptureScope relaxed;  // may run while this thread captures a graph
    p = gpu::PinnedAlloc(bytes, -1);
  } else {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw Error(StatusCode::ERR_BAD_STATE, "mmap of " + std::to_string(bytes) + " bytes failed");
  }
  std::memset(p, 0, bytes);
  return p;
}

void FreeHostWords(void* p, size_t bytes, bool pinned) {
  if (!p) return;
  if (pinned) {
    gpu::PinnedFree(p, bytes);
  } else {
    munmap(p, bytes);
  }
}

StreamErrors::StreamErrors() {
  host_record_ = static_cast<gpu::StreamError*>(AllocHostWords(sizeof(gpu::StreamError), &pinned_));
  if (pinned_) device_record_ = reinterpret_cast<gpu::StreamError*>(gpu::DevicePointerOfPinned(host_record_));
}

StreamErrors::~StreamErrors() { FreeHostWords(host_record_, sizeof(gpu::StreamError), pinned_); }

void StreamErrors::Record(StatusCode code, const std::string& message) {
  std::lock_guard<std::mutex> lk(mu_);
  if (code_ != StatusCode::SUCCESS) return;
  code_ = code;
  message_ = message;
}

std::string StreamErrors::Take(StatusCode* code) {
  std::lock_guard<std::mutex> lk(mu_);
  volatile gpu::StreamError* r = host_record_;
  if (code_ == StatusCode::SUCCESS && r->code == gpu::kStreamErrorOutOfRange) {
    code_ = StatusCode::ERR_INVALID_ARGS;
    message_ = "segment " + std::to_string(r->index) +
               " out of range (local_offset=" + std::to_string(r->local_offset) +
               ", remote_offset=" + std::to_string(r->remote_offset) + ", size=" + std::to_string(r->size) +
               "): the kernel moved no byte of it";
  }
  r->code = 0;
  *code = code_;
  std::string m = std::move(message_);
  code_ = StatusCode::SUCCESS;
  message_.clear();
  return m;
}

}  // namespace mori_torch
