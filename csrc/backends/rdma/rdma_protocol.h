// The RDMA backend's requests on its data connection (BackendRequest /
// BackendReply frames after the Hello). One connection per initiator and
// target engine pair: it sets up the QPs, hands out remote keys, and stays
// open as the liveness signal (either side closing it tears the QPs down).
//
//   Connect   u8 op=1, u8 notify, u32 notice buffers per QP, u32 n, n x QpInfo
//       reply u32 n, n x QpInfo (the target's QP i pairs with the initiator's QP i)
//   MemKey    u8 op=2, u64 memory id, u64 target incarnation, 16-byte memory token
//       reply u64 address, u64 size, u32 n, n x u32 rkey (by the target's rail)
// Failures are answered with an Error frame (code + message).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/frame.h"
#include "core/types.h"

namespace mori_torch {
namespace rdma {

enum class RdmaOp : uint8_t { Connect = 1, MemKey = 2 };

constexpr uint32_t kMaxQpsPerConnection = 1024;
constexpr uint32_t kMaxNoticeBuffersPerQp = 1 << 16;

// Sends a request and returns the reply payload; an Error frame or a broken
// connection becomes a thrown Error naming `where`.
std::vector<uint8_t> CallBackend(int fd, const std::vector<uint8_t>& request, int timeout_ms, const std::string& where);

}  // namespace rdma
}  // namespace mori_torch
