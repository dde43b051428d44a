// Tensor -> pointer adapters shared by the CPU and CUDA implementations of
// torch.ops.mori.* (schemas in ops_schema.cpp): argument checks with
// torch's error types, then a StreamTransfer for csrc/stream.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <memory>

#include "gpu/trace_ranges.h"
#include "stream/enqueue.h"
#include "stream/handle_registry.h"

namespace mori_torch {
namespace bind {

// The arguments of one transfer op, parsed once for both implementations.
struct OpCall {
  const char* name;
  std::shared_ptr<StreamSession> ss;
  at::Tensor local;
  // Block lists (local offsets, remote offsets, sizes); undefined when the
  // op takes scalars (read/write) or the sizes are implied (pages).
  std::array<at::Tensor, 3> lists;
  StreamTransfer t;  // pointers filled in by the implementation
};

OpCall ParseSingle(const char* name, bool is_read, int64_t handle, const at::Tensor& local, int64_t lo, int64_t ro,
                   int64_t size);
OpCall ParseBatch(const char* name, bool is_read, int64_t handle, const at::Tensor& local, const at::Tensor& lo,
                  const at::Tensor& ro, const at::Tensor& sizes);
OpCall ParsePages(const char* name, bool is_read, int64_t handle, const at::Tensor& local, const at::Tensor& lp,
                  const at::Tensor& rp, int64_t page_bytes);

// Points c.t at the lists, made contiguous (kept alive in c.lists).
void PointAtLists(OpCall& c);
// True when `local` is the session's registration itself.
bool IsRegistered(const OpCall& c);

// One impl per schema, parameterized by where the op runs.
template <void (*Run)(OpCall)>
struct OpImpls {
  // The op's host side inside a profiler range named after it (off unless
  // enabled: gpu/trace_ranges.h).
  static void Traced(OpCall c) {
    gpu::ScopedTraceRange range(c.name);
    Run(std::move(c));
  }
  static void Read(int64_t h, at::Tensor& local, int64_t lo, int64_t ro, int64_t size) {
    Traced(ParseSingle("mori.read", true, h, local, lo, ro, size));
  }
  static void Write(int64_t h, const at::Tensor& local, int64_t lo, int64_t ro, int64_t size) {
    Traced(ParseSingle("mori.write", false, h, local, lo, ro, size));
  }
  static void BatchRead(int64_t h, at::Tensor& local, const at::Tensor& lo, const at::Tensor& ro,
                        const at::Tensor& sizes) {
    Traced(ParseBatch("mori.batch_read", true, h, local, lo, ro, sizes));
  }
  static void BatchWrite(int64_t h, const at::Tensor& local, const at::Tensor& lo, const at::Tensor& ro,
                         const at::Tensor& sizes) {
    Traced(ParseBatch("mori.batch_write", false, h, local, lo, ro, sizes));
  }
  static void ReadPages(int64_t h, at::Tensor& local, const at::Tensor& lp, const at::Tensor& rp, int64_t page) {
    Traced(ParsePages("mori.read_pages", true, h, local, lp, rp, page));
  }
  static void WritePages(int64_t h, const at::Tensor& local, const at::Tensor& lp, const at::Tensor& rp, int64_t page) {
    Traced(ParsePages("mori.write_pages", false, h, local, lp, rp, page));
  }
  static void Register(torch::Library& m) {
    m.impl("read", &Read);
    m.impl("write", &Write);
    m.impl("batch_read", &BatchRead);
    m.impl("batch_write", &BatchWrite);
    m.impl("read_pages", &ReadPages);
    m.impl("write_pages", &WritePages);
  }
};

}  // namespace bind
}  // namespace mori_torch
