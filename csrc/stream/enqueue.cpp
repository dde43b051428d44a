#include "stream/enqueue.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "stream/doorbell.h"

namespace mori_torch {
namespace {

constexpr size_t kReservedSlots = 4;
constexpr size_t kReservedEntries = 4096;

[[noreturn]] void InvalidArgs(const std::string& msg) { throw Error(StatusCode::ERR_INVALID_ARGS, msg); }

bool HasList(const StreamTransfer& t, int k) { return t.lists[k] != nullptr; }

// Entries of list k: count, or one size for every segment.
size_t ListEntries(const StreamTransfer& t, int k) {
  if (k == 2 && t.segs.size_stride == 0) return 1;
  return static_cast<size_t>(t.segs.count);
}

void CheckListsFor(const StreamTransfer& t, bool capturing, bool need_device) {
  for (int k = 0; k < 3; ++k) {
    if (!HasList(t, k) || t.list_on_device[k]) continue;
    if (capturing) {
      InvalidArgs(std::string("under CUDA graph capture the block lists must be GPU tensors (a graph replay reads "
                              "them); ") +
                  t.list_names[k] + " is host memory");
    }
    if (need_device) {
      InvalidArgs(std::string("this session's backend copies on the GPU and reads its lists there; ") +
                  t.list_names[k] + " is host memory");
    }
  }
}

// Bytes of staging the transfer can need: exact when the sizes are known
// now, else bounded by the local tensor (no valid segment exceeds it).
uint64_t StagingBytes(const StreamTransfer& t) {
  const auto count = static_cast<uint64_t>(t.segs.count);
  auto clamp = [&](int64_t v) { return std::min<uint64_t>(v < 0 ? 0 : static_cast<uint64_t>(v), t.local_size); };
  if (!HasList(t, 2)) return count * clamp(t.segs.uniform_size);
  if (t.list_on_device[2]) return std::min<uint64_t>(t.local_size, kMaxDeviceSizedStaging);
  uint64_t total = 0;
  for (int64_t i = 0; i < t.segs.count; ++i) total += clamp(t.lists[2][i * t.segs.size_stride]);
  return total;
}

void LaunchOnPeer(const StreamTransfer& t, StreamDriver& stream) {
  gpu::StreamCopyArgs a = t.segs;
  a.local_offsets = t.lists[0];
  a.remote_offsets = t.lists[1];
  a.sizes = t.lists[2];
  a.local_base = t.local_base;
  a.local_size = t.local_size;
  a.error = t.errors ? t.errors->device_record() : nullptr;
  if (!stream.is_gpu_stream()) InvalidArgs("this session's backend copies on a GPU stream; none was given");
  const Session& s = *t.session;
  s.peer()->LaunchOnStream(*s.local(), s.remote_desc(), a, stream.native());
}

// A slot captured into a graph lives as long as the graph: a user object
// the graph owns retires the slot's lease when the graph is destroyed, and
// the progress thread then frees the slot. Without graph user objects (HIP
// 5.2) the slot keeps no lease and is watched for the life of the process.
void TieToCapturedGraph(DoorbellSlot& slot, StreamDriver& stream) {
  auto lease = std::make_shared<SlotLease>();
  auto* context = new std::shared_ptr<SlotLease>(lease);
  bool tied = false;
  try {
    tied = stream.ReleaseWithGraph(&SlotLease::ReleaseCallback, context);
  } catch (const Error&) {
    tied = false;
  }
  if (!tied) {
    delete context;
    return;
  }
  slot.lease = std::move(lease);
}

// The slot's device scratch: packed pages, then the lists and the failed
// flag as the kernels read them. Kernels read only device memory: every
// thread of the copy kernel reads its segment's entries, and loads from
// host-mapped memory cost a PCIe round trip each (measured 9 us per 4 KiB
// page on H200 when the lists and flag stayed in the pinned slot).
struct ScratchLayout {
  size_t lists = 0;  // offset of 3 lists of `entries` int64 (local, sizes, packed)
  size_t flag = 0;
  size_t bytes = 0;
};

ScratchLayout LayoutOf(const DoorbellSlot& slot) {
  ScratchLayout l;
  l.lists = (slot.staging_bytes() + 255) / 256 * 256;
  l.flag = l.lists + 3 * slot.entries() * sizeof(int64_t);
  l.bytes = l.flag + 64;
  return l;
}

int64_t* ScratchList(const DoorbellSlot& slot, int which) {
  const ScratchLayout l = LayoutOf(slot);
  return reinterpret_cast<int64_t*>(static_cast<char*>(slot.scratch_) + l.lists) + which * slot.entries();
}

// The kernel arguments that move local pages to (pack) or from (unpack) the
// slot's device scratch; the DMA engine moves the packed bytes between
// scratch and the pinned staging. Device lists are read where they are (a
// graph replay sees that replay's values); host lists were copied into the
// scratch by the stream.
gpu::StreamCopyArgs StagingCopy(const StreamTransfer& t, const DoorbellSlot& slot, StreamDriver& stream) {
  gpu::StreamCopyArgs a = t.segs;
  a.local_base = t.local_base;
  a.local_size = t.local_size;
  a.remote_base = reinterpret_cast<uint64_t>(slot.scratch_);
  a.remote_size = slot.staging_bytes();
  a.remote_packed = true;
  auto on_device = [&](int k, int scratch_list) -> const int64_t* {
    if (!HasList(t, k)) return nullptr;
    if (t.list_on_device[k]) return t.lists[k];
    int64_t* dst = ScratchList(slot, scratch_list);
    stream.Copy(dst, slot.list(k), ListEntries(t, k) * sizeof(int64_t));
    return dst;
  };
  a.local_offsets = on_device(0, 0);
  a.remote_offsets = nullptr;
  a.sizes = on_device(2, 1);
  a.packed_offsets = HasList(t, 2) ? ScratchList(slot, 2) : nullptr;
  a.error = t.errors ? t.errors->device_record() : nullptr;
  return a;
}

void RingDoorbell(const StreamTransfer& t, StreamDriver& stream, bool capturing, bool staged) {
  auto& service = DoorbellService::Instance();
  const size_t entries = HasList(t, 0) || HasList(t, 1) || HasList(t, 2) ? static_cast<size_t>(t.segs.count) : 0;
  const uint64_t staging_bytes = staged ? StagingBytes(t) : 0;
  const int domain = staged ? stream.scratch_domain() : -2;
  std::shared_ptr<DoorbellSlot> slot = service.Acquire(entries, staging_bytes, domain);
  if (staged && !slot->scratch_) {
    slot->scratch_ = stream.AllocScratch(LayoutOf(*slot).bytes);
    slot->scratch_domain_ = domain;
    slot->free_scratch_ = stream.scratch_free();
  }
  slot->session = t.session;
  slot->errors = t.errors;
  slot->is_read = t.is_read;
  slot->persistent = capturing;
  slot->staged = staged;
  slot->local_size = t.local_size;
  slot->segs = t.segs;
  slot->segs.local_offsets = HasList(t, 0) ? slot->list(0) : nullptr;
  slot->segs.remote_offsets = HasList(t, 1) ? slot->list(1) : nullptr;
  slot->segs.sizes = HasList(t, 2) ? slot->list(2) : nullptr;
  slot->lease.reset();
  if (capturing) TieToCapturedGraph(*slot, stream);
  bool enqueued = false;
  try {
    for (int k = 0; k < 3; ++k) {
      if (!HasList(t, k)) continue;
      const size_t bytes = ListEntries(t, k) * sizeof(int64_t);
      if (t.list_on_device[k]) {
        enqueued = true;
        stream.Copy(slot->list(k), t.lists[k], bytes);
      } else if (bytes) {
        std::memcpy(slot->list(k), t.lists[k], bytes);
      }
    }
    gpu::StreamCopyArgs staging;
    if (staged) {
      staging = StagingCopy(t, *slot, stream);
      if (staging.packed_offsets) {
        enqueued = true;
        stream.PackOffsets(staging.sizes, staging.size_stride, staging.count,
                           const_cast<int64_t*>(staging.packed_offsets));
      }
      if (!t.is_read) {
        enqueued = true;
        staging.is_read = false;  // local -> scratch -> staging
        stream.CopySegments(staging);
        if (staging_bytes) stream.Copy(slot->staging(), slot->scratch_, staging_bytes);
      }
    }
    enqueued = true;
    stream.WriteFlag(slot->ring(), 1);
    stream.WaitFlag(slot->done(), 1);
    if (staged && t.is_read) {
      if (staging_bytes) stream.Copy(slot->scratch_, slot->staging(), staging_bytes);
      staging.is_read = true;  // staging -> scratch -> local, unless the transfer failed
      auto* flag = reinterpret_cast<uint32_t*>(static_cast<char*>(slot->scratch_) + LayoutOf(*slot).flag);
      stream.Copy(flag, slot->failed(), sizeof(uint32_t));
      staging.skip_flag = flag;
      stream.CopySegments(staging);
    }
    // Last: the slot is reused (one-shot) or rung again (graph) only after
    // the stream is done with its lists and staging.
    stream.WriteFlag(slot->done(), 0);
  } catch (const Error&) {
    // The stream may still touch the slot: keep it watched for good.
    if (enqueued) {
      slot->persistent = true;
      service.Watch(slot);
    }
    throw;
  }
  service.Watch(std::move(slot));
}

}  // namespace

void EnqueueOnStream(const StreamTransfer& t, StreamDriver& stream) {
  if (!t.session) InvalidArgs("stream-ordered transfer without a session");
  if (t.segs.count < 0) InvalidArgs("negative segment count " + std::to_string(t.segs.count));
  const bool capturing = stream.Capturing();
  Session& s = *t.session;
  const std::shared_ptr<BackendPeer> peer = s.peer();  // one routing decision for the whole enqueue
  const bool on_peer = peer->RunsOnStream();
  CheckListsFor(t, capturing, on_peer);
  if (on_peer) return LaunchOnPeer(t, stream);
  const bool is_registration = t.local_base == s.local()->desc.data;
  if (!t.local_on_device && !is_registration) {
    InvalidArgs(
        "local host memory must be the session's registration on a stream (a copy runs on the host: "
        "RunOnHost)");
  }
  peer->CheckStreamWait(s.remote_desc());
  const bool staged = t.local_on_device && !(is_registration && peer->PostsFromDeviceMemory(*s.local()));
  RingDoorbell(t, stream, capturing, staged);
}

void EnqueueOnStream(const StreamTransfer& t, gpu::Stream stream) {
  GpuStreamDriver driver(stream);
  EnqueueOnStream(t, driver);
}

void PrepareForStream(Session& s) {
  if (gpu::DeviceCount() == 0) return;
  const auto& local = *s.local();
  s.peer()->PrepareStream(local, s.remote_desc());
  const int dev = local.desc.loc == MemoryLocationType::GPU ? local.desc.device_id : gpu::CurrentDevice();
  gpu::WarmUpStreamKernels(dev);
  gpu::WarmUpKernels(dev);
  DoorbellService::Instance().Reserve(kReservedSlots, kReservedEntries);
}

namespace {

// Copies the local segments (byte offsets) between `copy`, host memory laid
// out like the registration, and the registration itself; segments outside
// it are skipped (the transfer refuses them).
void StageSegments(const LocalMemory& reg, char* copy, const std::vector<int64_t>& lo, const std::vector<int64_t>& sz,
                   bool to_copy) {
  char* base = reg.Base();
  for (size_t i = 0; i < lo.size(); ++i) {
    if (!gpu::InsideRange(lo[i], sz[i], reg.desc.size)) continue;
    const size_t n = static_cast<size_t>(sz[i]);
    if (to_copy) {
      std::memcpy(copy + lo[i], base + lo[i], n);
    } else {
      std::memcpy(base + lo[i], copy + lo[i], n);
    }
  }
}

}  // namespace

void RunOnHost(const StreamTransfer& t) {
  if (!t.session) InvalidArgs("transfer without a session");
  if (t.segs.count <= 0) return;
  gpu::StreamCopyArgs a = t.segs;
  a.local_offsets = t.lists[0];
  a.remote_offsets = t.lists[1];
  a.sizes = t.lists[2];
  std::vector<int64_t> lo, ro, sz;
  std::string msg;
  StatusCode code = ExpandSegments(a, &lo, &ro, &sz, &msg);
  if (code != StatusCode::SUCCESS) throw Error(code, msg);
  Session& s = *t.session;
  const LocalMemory& reg = *s.local();
  const bool staged = t.local_base != reg.desc.data;
  auto* copy = reinterpret_cast<char*>(t.local_base);
  if (staged && !t.is_read) StageSegments(reg, copy, lo, sz, false);
  const TransferUid uid = s.AllocateTransferUid();
  StatusPtr st = t.is_read ? s.BatchRead(lo, ro, sz, uid) : s.BatchWrite(lo, ro, sz, uid);
  st->Wait();
  code = st->Code();
  if (code != StatusCode::SUCCESS) throw Error(code, st->Message());
  if (staged && t.is_read) StageSegments(reg, copy, lo, sz, true);
}

}  // namespace mori_torch
