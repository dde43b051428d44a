// Buffers for the int64 tensors that offset lists are converted into
// (mori_torch._C.int64_tensor, once per list and call). A fresh tensor of a
// 16,384-entry list is 128 KiB: above glibc's mmap threshold, or freed at the
// top of the heap and trimmed, so each call could fault its pages in again
// (measured: about 2.5x the conversion's time with every allocation mapped
// anew). These buffers are reused, their pages stay mapped and warm.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "core/transfer_args.h"

namespace mori_torch {
namespace bind {

// A 1-D CPU int64 tensor of `n` entries, uninitialized. Its memory comes from
// a small process-wide pool and goes back to it when the tensor is freed, so
// a live tensor never shares memory with another. Larger lists than the
// pool keeps get a plain tensor.
at::Tensor PooledInt64Tensor(int64_t n);

// Offsets and sizes passed as int64 tensors are read in place, without a
// per-element conversion (block tables usually are tensors already); device
// tensors are copied to the host first.
struct HostInt64 {
  at::Tensor host;  // keeps the values alive while the span is used
  Int64Span span() const { return {host.data_ptr<int64_t>(), static_cast<size_t>(host.numel())}; }
};
// c10::TypeError (not int64) or c10::ValueError (not 1-D) naming `name`.
void CheckInt64Vector(const at::Tensor& t, const char* name);
// A checked tensor's values, contiguous on the host: a device tensor is
// copied (which waits for the work queued before it: callers release the
// GIL around this).
HostInt64 OnHost(const at::Tensor& t);
// Both, for the TorchScript methods (which run without the GIL).
HostInt64 ToHostInt64(const at::Tensor& t, const char* name);

}  // namespace bind
}  // namespace mori_torch
