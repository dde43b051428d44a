// GPU memory over TCP: a payload moves between a socket and device memory
// through a pinned StagingSet, chunk by chunk, so that the device copy of
// one chunk overlaps the socket I/O of the others (sending: device-to-host
// copies run ahead of send; receiving: host-to-device copies trail recv).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/net.h"
#include "core/segments.h"
#include "core/socket_reader.h"
#include "gpu/staging.h"

namespace mori_torch {
namespace tcp {

// Where the payload lives: device memory of `device` at `base`; segment
// offsets are taken from the local or the remote side of each Segment.
struct DeviceBytes {
  uint64_t base = 0;
  int device = -1;
  const std::vector<Segment>* segs = nullptr;
  bool local_side = true;
  // Receiving: nothing is copied to the device once the peer abandoned the
  // connection (the target's write fence, tcp_protocol.h).
  bool fenced = false;
};

// Sends the payload. A device error fails the result (the stream is then
// out of step: the caller drops the connection).
IoResult SendStaged(int fd, gpu::StagingSet& st, const DeviceBytes& src, const IoDeadline& deadline);

// Receives the payload from `in` (its buffered bytes first). A device error
// does not fail the result: the rest of the payload is still read (the
// stream stays in step) and the error is put in *gpu_error.
IoResult RecvStaged(SocketReader& in, gpu::StagingSet& st, const DeviceBytes& dst, const IoDeadline& deadline,
                    std::string* gpu_error);

}  // namespace tcp
}  // namespace mori_torch
