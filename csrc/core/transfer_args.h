// Argument checks shared by engine-level and session transfers: list
// lengths, signs and bounds against both registrations, with messages that
// name the argument, index and values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/descriptors.h"
#include "core/segments.h"
#include "core/transfer_status.h"

namespace mori_torch {

// A read-only view of int64 values: a std::vector, one scalar, or the data of
// a caller's tensor, so that offsets and sizes reach the checks uncopied.
struct Int64Span {
  const int64_t* data = nullptr;
  size_t size = 0;
  Int64Span() = default;
  Int64Span(const int64_t* d, size_t n) : data(d), size(n) {}
  Int64Span(const std::vector<int64_t>& v) : data(v.data()), size(v.size()) {}  // NOLINT: implicit on purpose
  // A braced list lives until the end of the call it is written in, which
  // is as long as a span parameter is used.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
  Int64Span(std::initializer_list<int64_t> l) : data(l.begin()), size(l.size()) {}  // NOLINT
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
};

// Builds the segment list of one transfer, with its byte count and largest
// segment: neighbours contiguous on both sides are merged when at least one
// segment in 8 continues its predecessor or some segment is empty (empty
// segments are always dropped), else the list stays as given. Returns
// SUCCESS, or ERR_INVALID_ARGS with *msg set (and *out empty). One tight
// pass over the arrays when all is well; the message for a bad segment is
// built only on failure.
StatusCode BuildSegments(Int64Span local_offsets, Int64Span remote_offsets, Int64Span sizes, const MemoryDesc& local,
                         const MemoryDesc& remote, SegmentBatch* out, std::string* msg);

}  // namespace mori_torch
