#include "core/types.h"

namespace mori_torch {

const char* BackendTypeName(BackendType t) {
  switch (t) {
    case BackendType::XGMI:
      return "XGMI";
    case BackendType::RDMA:
      return "RDMA";
    case BackendType::TCP:
      return "TCP";
    default:
      return "Unknown";
  }
}

const char* MemoryLocationName(MemoryLocationType t) {
  switch (t) {
    case MemoryLocationType::CPU:
      return "CPU";
    case MemoryLocationType::GPU:
      return "GPU";
    default:
      return "Unknown";
  }
}

}  // namespace mori_torch
