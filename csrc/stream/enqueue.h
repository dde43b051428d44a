// The one entry point of stream-ordered transfers (docs/ARCHITECTURE.md,
// "Stream-ordered ops"), torch-free:
// the torch ops (csrc/torch/ops_*.cpp) are thin adapters onto it, and C++
// users call it directly with a CUDA/HIP stream.
//
// GPU-peer sessions (XGMI) launch their copy kernel on the stream.
// Host-driven sessions (TCP, RDMA) ring a doorbell (doorbell.h): block lists
// reach the host through the slot (the stream copies device lists into it),
// local GPU pages are packed into the slot's pinned staging by a kernel on
// the stream before the doorbell (writes) and unpacked from it after the
// wait (reads), so the progress thread only moves host bytes and writes
// flags. Host memory moves straight from and into its registration.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "core/session.h"
#include "stream/stream_driver.h"
#include "stream/stream_errors.h"

namespace mori_torch {

struct StreamTransfer {
  std::shared_ptr<Session> session;
  // Where errors found after the call (on the stream, on the progress
  // thread) wait until checked.
  std::shared_ptr<StreamErrors> errors;
  bool is_read = false;
  // The local bytes the stream's work touches: the session's registration,
  // or a same-sized copy of it on the same device (torch.compile may hand
  // the op a copy when it cannot reinplace).
  uint64_t local_base = 0;
  uint64_t local_size = 0;
  bool local_on_device = false;
  // count, scalars, offset_scale, uniform_size and size_stride; the list
  // pointers are taken from `lists` below.
  gpu::StreamCopyArgs segs;
  // Block lists: local offsets (or pages), remote offsets (or pages), sizes;
  // null when absent. On device: read by the stream when it gets there
  // (every graph replay reads that replay's values). On the host: read now,
  // which a graph capture cannot record (refused while capturing).
  std::array<const int64_t*, 3> lists{{nullptr, nullptr, nullptr}};
  std::array<bool, 3> list_on_device{{false, false, false}};
  std::array<const char*, 3> list_names{{"local_offsets", "remote_offsets", "sizes"}};
};

// Enqueues `t` on `stream`; throws Error (ERR_INVALID_ARGS naming the
// argument, ERR_GPU_OP for a failed launch) when it cannot.
void EnqueueOnStream(const StreamTransfer& t, StreamDriver& stream);
void EnqueueOnStream(const StreamTransfer& t, gpu::Stream stream);

// Work that must not happen during a graph capture, done now for `s`:
// remote mappings, backend registrations, kernel loading, pooled slots.
void PrepareForStream(Session& s);

// The transfer now, on the calling thread (lists in host memory): the CPU
// path of the ops. Throws Error with the transfer's message when it fails.
void RunOnHost(const StreamTransfer& t);

// Staging bytes a slot reserves for batches whose sizes live on the device
// (unknown when the op is enqueued): min(local size, this).
constexpr uint64_t kMaxDeviceSizedStaging = uint64_t{256} << 20;

}  // namespace mori_torch
