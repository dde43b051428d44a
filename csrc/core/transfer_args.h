// Argument checks shared by engine-level and session transfers: list
// lengths, signs and bounds against both registrations, with messages that
// name the argument, index and values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/descriptors.h"
#include "core/segments.h"
#include "core/transfer_status.h"

namespace mori_torch {

// Builds the segment list of one transfer; returns SUCCESS or
// ERR_INVALID_ARGS with *msg set.
StatusCode BuildSegments(const std::vector<int64_t>& local_offsets, const std::vector<int64_t>& remote_offsets,
                         const std::vector<int64_t>& sizes, const MemoryDesc& local, const MemoryDesc& remote,
                         std::vector<Segment>* out, std::string* msg);

}  // namespace mori_torch
