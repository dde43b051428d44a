#include "core/backend.h"

namespace mori_torch {

void BackendPeer::LaunchOnStream(const LocalMemory&, const MemoryDesc&, gpu::StreamCopyArgs, gpu::Stream) {
  throw Error(StatusCode::ERR_BAD_STATE, "this backend cannot launch transfers on a GPU stream");
}

}  // namespace mori_torch
