// Target side of one initiator's RDMA data connection: answers Connect (makes
// the partner QPs, with notice buffers) and MemKey (registers the memory on
// our rails, bounds = the registration, and returns the rkeys) until the
// connection closes, then tears the QPs down.
#pragma once

#include <memory>

#include "backends/rdma/rdma_backend.h"

namespace mori_torch {
namespace rdma {

void ServeRdmaConnection(const std::shared_ptr<RdmaShared>& shared, const EngineDesc& peer, int fd);

}  // namespace rdma
}  // namespace mori_torch
