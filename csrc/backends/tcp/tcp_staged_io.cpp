#include "backends/tcp/tcp_staged_io.h"

#include <algorithm>

#include "core/types.h"

namespace mori_torch {
namespace tcp {
namespace {

using Piece = gpu::StagingSet::Piece;

// Walks a segment list in payload order, a chunk at a time. Pieces that are
// adjacent in device memory are handed out as one copy.
class ChunkWalker {
 public:
  explicit ChunkWalker(const DeviceBytes& d) : d_(d) {}

  // Fills *pieces with the next at most `cap` payload bytes, cut into at
  // most StagingSet::kMaxPieces pieces; returns the chunk's byte count (0 at
  // the end of the payload).
  uint64_t Next(uint64_t cap, std::vector<Piece>* pieces) {
    const auto& segs = *d_.segs;
    pieces->clear();
    uint64_t filled = 0;
    while (filled < cap && seg_ < segs.size()) {
      const Segment& s = segs[seg_];
      const uint64_t n = std::min(cap - filled, s.size - in_seg_);
      const uint64_t ptr = d_.base + (d_.local_side ? s.local_off : s.remote_off) + in_seg_;
      if (!pieces->empty() && pieces->back().dev_ptr + pieces->back().bytes == ptr) {
        pieces->back().bytes += n;
      } else if (pieces->size() < gpu::StagingSet::kMaxPieces) {
        pieces->push_back({ptr, filled, n});
      } else {
        break;  // the list is full: the chunk ends here
      }
      filled += n;
      in_seg_ += n;
      if (in_seg_ == s.size) {
        ++seg_;
        in_seg_ = 0;
      }
    }
    return filled;
  }

 private:
  const DeviceBytes& d_;
  size_t seg_ = 0;
  uint64_t in_seg_ = 0;
};

// Waits for whatever a failed pipeline left running in `st`, so no copy
// touches a chunk after it goes back to the pool.
void Drain(gpu::StagingSet& st) {
  try {
    st.WaitAll();
  } catch (const Error&) {
  }
}

}  // namespace

IoResult SendStaged(int fd, gpu::StagingSet& st, const DeviceBytes& src, const IoDeadline& deadline) {
  ChunkWalker walk(src);
  const int depth = st.depth();
  std::vector<uint64_t> len(static_cast<size_t>(depth), 0);
  std::vector<Piece> pieces;
  // Starts the device-to-host copies of the next chunk into slot b.
  auto fill = [&](int b) {
    len[b] = walk.Next(st.chunk_bytes(), &pieces);
    if (len[b] != 0) st.Copy(b, pieces, gpu::StagingSet::Direction::kDeviceToChunk, src.device);
    return len[b] != 0;
  };
  try {
    uint64_t issued = 0;
    while (issued < static_cast<uint64_t>(depth) && fill(static_cast<int>(issued))) ++issued;
    for (uint64_t i = 0; i < issued; ++i) {
      const int b = static_cast<int>(i % depth);
      st.Wait(b);
      IoResult r = WriteFull(fd, st.chunk(b), len[b], deadline);
      if (!r.ok) {
        Drain(st);
        return r;
      }
      if (fill(b)) ++issued;
    }
  } catch (const Error& e) {
    Drain(st);
    return IoResult::Fail(std::string("GPU copy for TCP send failed: ") + e.what());
  }
  return IoResult::Ok();
}

IoResult RecvStaged(SocketReader& in, gpu::StagingSet& st, const DeviceBytes& dst, const IoDeadline& deadline,
                    std::string* gpu_error) {
  ChunkWalker walk(dst);
  const int depth = st.depth();
  std::vector<Piece> pieces;
  for (uint64_t i = 0;; ++i) {
    const int b = static_cast<int>(i % depth);
    try {
      if (gpu_error->empty()) st.Wait(b);  // its previous host-to-device copies read the slot
    } catch (const Error& e) {
      *gpu_error = e.what();
      Drain(st);
    }
    // Walk first to learn the chunk's size; copies start once its bytes are in.
    const uint64_t n = walk.Next(st.chunk_bytes(), &pieces);
    if (n == 0) break;
    IoResult r = in.ReadFull(st.chunk(b), n, deadline);
    if (!r.ok) {
      Drain(st);
      return r;
    }
    if (!gpu_error->empty()) continue;  // keep the stream in step, copy nothing
    if (dst.fenced && PeerAbandoned(in.fd())) {
      Drain(st);
      return IoResult::Fail("fenced: the peer abandoned the connection; nothing more is written");
    }
    try {
      st.Copy(b, pieces, gpu::StagingSet::Direction::kChunkToDevice, dst.device);
    } catch (const Error& e) {
      *gpu_error = e.what();
      Drain(st);
    }
  }
  if (gpu_error->empty()) {
    try {
      st.WaitAll();  // the payload is in place before the caller reports success
    } catch (const Error& e) {
      *gpu_error = e.what();
    }
  }
  return IoResult::Ok();
}

}  // namespace tcp
}  // namespace mori_torch
