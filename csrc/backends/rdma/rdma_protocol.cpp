#include "backends/rdma/rdma_protocol.h"

#include "core/control_plane.h"

namespace mori_torch {
namespace rdma {

std::vector<uint8_t> CallBackend(int fd, const std::vector<uint8_t>& request, int timeout_ms,
                                 const std::string& where) {
  IoResult r = WriteFrame(fd, FrameType::BackendRequest, request, timeout_ms);
  Frame reply;
  if (r.ok) r = ReadFrame(fd, &reply, timeout_ms, timeout_ms);
  if (!r.ok) throw Error(StatusCode::ERR_BAD_STATE, where + ": " + r.error);
  if (reply.type == FrameType::Error) throw DecodeErrorPayload(reply, where);
  if (reply.type != FrameType::BackendReply) {
    throw Error(StatusCode::ERR_BAD_STATE,
                where + ": unexpected reply frame type " + std::to_string(static_cast<int>(reply.type)));
  }
  return std::move(reply.payload);
}

}  // namespace rdma
}  // namespace mori_torch
