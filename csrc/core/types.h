// Enums and ids of the layers above the GPU shim (the error type lives in
// base/error.h). Integer values match MORI-IO's (users compare them), so
// never renumber.
#pragma once

#include <cstdint>
#include <string>

#include "base/error.h"

namespace mori_torch {

enum class BackendType : int { Unknown = 0, XGMI = 1, RDMA = 2, TCP = 3 };
enum class MemoryLocationType : int { Unknown = 0, CPU = 1, GPU = 2 };

using MemoryId = uint64_t;
using TransferUid = uint64_t;

const char* BackendTypeName(BackendType t);
const char* MemoryLocationName(MemoryLocationType t);

}  // namespace mori_torch
