// torch.ops.mori.*: transfers as custom ops (DESIGN §1.3, §5), for eager
// code, torch.compile(fullgraph=True) and captured CUDA graphs.
//
// Sessions reach the ops as int handles (session_handle): an int is a plain
// constant to torch.compile and CUDA graphs, where a custom-class argument
// would need a fake class and flattening support.
//
// All tensors on the CPU: a synchronous transfer through the engine; errors
// raise. Any tensor on a GPU: the transfer is ordered on that device's
// current stream. GPU-peer sessions (XGMI) launch one bounds-checked copy
// kernel that reads the block lists when it runs; host-driven sessions (TCP)
// ring a doorbell (core/stream_doorbell.h) and hold the stream until the
// transfer ended. Errors found after the op returned wait in the session's
// StreamErrors until check_errors raises them.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "core/stream_doorbell.h"
#include "torch/classes.h"

namespace mori_torch {
namespace bind {
namespace {

// What an op keeps per session handle.
struct OpSession {
  std::shared_ptr<Session> session;
  std::shared_ptr<StreamErrors> errors;
};

class HandleRegistry {
 public:
  int64_t HandleOf(const std::shared_ptr<Session>& s) {
    std::unique_lock<std::shared_mutex> lk(mu_);
    auto it = by_session_.find(s.get());
    if (it != by_session_.end()) return it->second;
    auto os = std::make_shared<OpSession>();
    os->session = s;
    os->errors = std::make_shared<StreamErrors>();
    const int64_t h = next_++;
    by_handle_[h] = std::move(os);
    by_session_[s.get()] = h;
    return h;
  }

  std::shared_ptr<OpSession> Find(int64_t h, const char* op) {
    std::shared_lock<std::shared_mutex> lk(mu_);
    auto it = by_handle_.find(h);
    if (it == by_handle_.end()) {
      throw Error(StatusCode::ERR_NOT_FOUND, std::string(op) + ": session handle " + std::to_string(h) +
                                                 " is unknown or released; get one from mori_torch.ops.session_handle");
    }
    return it->second;
  }

  bool Release(int64_t h) {
    std::unique_lock<std::shared_mutex> lk(mu_);
    auto it = by_handle_.find(h);
    if (it == by_handle_.end()) return false;
    by_session_.erase(it->second->session.get());
    by_handle_.erase(it);
    return true;
  }

 private:
  std::shared_mutex mu_;
  std::unordered_map<int64_t, std::shared_ptr<OpSession>> by_handle_;
  std::unordered_map<const Session*, int64_t> by_session_;
  int64_t next_ = 1;
};

HandleRegistry& Handles() {
  static HandleRegistry r;
  return r;
}

constexpr size_t kReservedSlots = 4;
constexpr size_t kReservedEntries = 4096;

int64_t SessionHandle(const SessionRef& s) {
  TORCH_CHECK_VALUE(s && s->s, "mori.session_handle: session is None");
  try {
    const int64_t h = Handles().HandleOf(s->s);
    // Work that must not happen during a graph capture, done now.
    if (gpu::DeviceCount() > 0) {
      const auto& local = *s->s->local();
      if (s->s->peer().RunsOnStream()) s->s->peer().PrepareStream(local, s->s->remote_desc());
      const int dev = local.desc.loc == MemoryLocationType::GPU ? local.desc.device_id : gpu::CurrentDevice();
      gpu::WarmUpStreamKernels(dev);
      gpu::WarmUpKernels(dev);  // the TCP staging copies of GPU memory may run while a stream waits
      DoorbellService::Instance().Reserve(kReservedSlots, kReservedEntries);
    }
    return h;
  } catch (const Error& e) {
    Rethrow(e);
  }
}

void ReleaseSessionHandle(int64_t h) {
  TORCH_CHECK_VALUE(Handles().Release(h), "mori.release_session_handle: session handle ", std::to_string(h),
                    " is unknown or already released");
}

void CheckErrors(int64_t h) {
  try {
    auto os = Handles().Find(h, "mori.check_errors");
    StatusCode code;
    std::string msg = os->errors->Take(&code);
    if (code != StatusCode::SUCCESS) throw Error(code, "stream-ordered transfer: " + msg);
  } catch (const Error& e) {
    Rethrow(e);
  }
}

// The arguments of one transfer op, parsed once for both implementations.
struct OpCall {
  const char* name;
  bool is_read;
  std::shared_ptr<OpSession> os;
  at::Tensor local;
  // Block lists (local offsets, remote offsets, sizes); undefined when the
  // op takes scalars (read/write) or the sizes are implied (pages).
  std::array<at::Tensor, 3> lists;
  std::array<const char*, 3> list_names{{"", "", ""}};  // argument names, for errors
  gpu::StreamCopyArgs segs;  // scalars, count, scale; pointers set per path
};

std::string Num(int64_t v) { return std::to_string(v); }

void CheckList(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": ", name, " must be an int64 tensor, got ",
                   c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got ", Num(t.dim()), " dimensions");
}

// `local` is the session's local registration or a tensor of its size and
// device: torch.compile (when it cannot reinplace) and opcheck hand the op a
// copy. Kernels then move bytes into the copy directly; host paths stage the
// segments through the registered memory (StageSegments).
void CheckLocal(const OpCall& c) {
  const MemoryDesc& d = c.os->session->local()->desc;
  const auto bytes = static_cast<uint64_t>(c.local.nbytes());
  const bool gpu_mem = d.loc == MemoryLocationType::GPU;
  TORCH_CHECK_VALUE(bytes == d.size && c.local.is_contiguous(), c.name,
                    ": local must be the contiguous tensor registered for this session (", Num(d.size),
                    " bytes) or a copy of it; got ", Num(bytes), " bytes",
                    c.local.is_contiguous() ? "" : ", not contiguous");
  TORCH_CHECK_VALUE(c.local.is_cpu() != gpu_mem && (!gpu_mem || c.local.device().index() == d.device_id), c.name,
                    ": local tensor is on ", c.local.device().str(), " but the session's local memory is ",
                    gpu_mem ? "on GPU " + Num(d.device_id) : std::string("host memory"));
}

bool IsRegistered(const OpCall& c) {
  return reinterpret_cast<uint64_t>(c.local.data_ptr()) == c.os->session->local()->desc.data;
}

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

OpCall Parse(const char* name, bool is_read, int64_t handle, const at::Tensor& local) {
  OpCall c{name, is_read, nullptr, local, {}, {}};
  try {
    c.os = Handles().Find(handle, name);
  } catch (const Error& e) {
    Rethrow(e);
  }
  CheckLocal(c);
  c.segs.is_read = is_read;
  return c;
}

OpCall ParseSingle(const char* name, bool is_read, int64_t handle, const at::Tensor& local, int64_t lo, int64_t ro,
                   int64_t size) {
  OpCall c = Parse(name, is_read, handle, local);
  c.segs.local_offset = lo;
  c.segs.remote_offset = ro;
  c.segs.uniform_size = size;
  c.segs.count = 1;
  return c;
}

OpCall ParseBatch(const char* name, bool is_read, int64_t handle, const at::Tensor& local, const at::Tensor& lo,
                  const at::Tensor& ro, const at::Tensor& sizes) {
  OpCall c = Parse(name, is_read, handle, local);
  CheckList(name, "local_offsets", lo);
  CheckList(name, "remote_offsets", ro);
  CheckList(name, "sizes", sizes);
  const int64_t n = lo.numel();
  TORCH_CHECK_VALUE(ro.numel() == n && (sizes.numel() == n || sizes.numel() == 1), name,
                    ": mismatched list lengths: local_offsets has ", Num(n), ", remote_offsets has ", Num(ro.numel()),
                    ", sizes has ", Num(sizes.numel()), " (sizes may also hold one value for all)");
  c.lists = {lo, ro, sizes};
  c.list_names = {{"local_offsets", "remote_offsets", "sizes"}};
  c.segs.count = n;
  c.segs.size_stride = sizes.numel() == 1 ? 0 : 1;
  return c;
}

OpCall ParsePages(const char* name, bool is_read, int64_t handle, const at::Tensor& local, const at::Tensor& lp,
                  const at::Tensor& rp, int64_t page_bytes) {
  OpCall c = Parse(name, is_read, handle, local);
  CheckList(name, "local_pages", lp);
  CheckList(name, "remote_pages", rp);
  TORCH_CHECK_VALUE(lp.numel() == rp.numel(), name, ": mismatched list lengths: local_pages has ", Num(lp.numel()),
                    ", remote_pages has ", Num(rp.numel()));
  TORCH_CHECK_VALUE(page_bytes > 0, name, ": page_bytes must be positive, got ", Num(page_bytes));
  c.lists[0] = lp;
  c.lists[1] = rp;
  c.list_names = {{"local_pages", "remote_pages", ""}};
  c.segs.count = lp.numel();
  c.segs.offset_scale = page_bytes;
  c.segs.uniform_size = page_bytes;
  return c;
}

// Points segs at the lists (host or device memory, whichever `lists` holds).
void PointAt(gpu::StreamCopyArgs* segs, const std::array<at::Tensor, 3>& lists) {
  segs->local_offsets = lists[0].defined() ? lists[0].data_ptr<int64_t>() : nullptr;
  segs->remote_offsets = lists[1].defined() ? lists[1].data_ptr<int64_t>() : nullptr;
  segs->sizes = lists[2].defined() ? lists[2].data_ptr<int64_t>() : nullptr;
}

// ---------------------------------------------------------------------------
// CPU: a synchronous transfer through the engine.

void RunOnHost(OpCall c) {
  std::array<at::Tensor, 3> host;
  for (size_t k = 0; k < 3; ++k) {
    if (c.lists[k].defined()) host[k] = c.lists[k].contiguous();
  }
  PointAt(&c.segs, host);
  if (c.segs.count == 0) return;
  try {
    std::vector<int64_t> lo, ro, sz;
    std::string msg;
    StatusCode code = ExpandSegments(c.segs, &lo, &ro, &sz, &msg);
    if (code != StatusCode::SUCCESS) throw Error(code, std::string(c.name) + ": " + msg);
    Session& s = *c.os->session;
    const bool staged = !IsRegistered(c);
    const LocalMemory& reg = *s.local();
    auto* copy = static_cast<char*>(c.local.data_ptr());
    if (staged && !c.is_read) StageSegments(reg, copy, lo, sz, false);
    const TransferUid uid = s.AllocateTransferUid();
    StatusPtr st = c.is_read ? s.BatchRead(lo, ro, sz, uid) : s.BatchWrite(lo, ro, sz, uid);
    st->Wait();
    code = st->Code();
    if (code != StatusCode::SUCCESS) throw Error(code, std::string(c.name) + ": " + st->Message());
    if (staged && c.is_read) StageSegments(reg, copy, lo, sz, true);
  } catch (const Error& e) {
    Rethrow(e);
  }
}

// ---------------------------------------------------------------------------
// GPU: ordered on the current stream.

c10::Device StreamDevice(const OpCall& c) {
  if (c.local.is_cuda()) return c.local.device();
  for (const auto& t : c.lists) {
    if (t.defined() && t.is_cuda()) return t.device();
  }
  TORCH_CHECK(false, c.name, ": no GPU tensor among the arguments");
}

gpu::Stream CurrentStream(c10::Device d) {
  c10::impl::VirtualGuardImpl impl(d.type());
  return impl.getStream(d).native_handle();
}

// Under graph capture every block list must be a GPU tensor: the graph reads
// it at replay time. A CPU list would be copied (GPU peers) or snapshotted
// (doorbells) once, at capture, and every replay would silently reuse the
// captured values. Raised before anything is enqueued, for every backend.
void CheckCapturableLists(const OpCall& c, bool capturing) {
  if (!capturing) return;
  for (size_t k = 0; k < 3; ++k) {
    const at::Tensor& t = c.lists[k];
    TORCH_CHECK_VALUE(!t.defined() || t.is_cuda(), c.name, ": under CUDA graph capture the block lists must be GPU ",
                      "tensors (a graph replay reads them); ", c.list_names[k], " is a CPU tensor");
  }
}

// The lists as contiguous tensors on `dev` (a CPU list is copied, which a
// graph capture cannot record: CheckCapturableLists refused it).
std::array<at::Tensor, 3> ListsOnDevice(const OpCall& c, c10::Device dev, bool capturing) {
  CheckCapturableLists(c, capturing);
  std::array<at::Tensor, 3> on_device;
  for (size_t k = 0; k < 3; ++k) {
    const at::Tensor& t = c.lists[k];
    if (!t.defined()) continue;
    on_device[k] = t.to(dev).contiguous();
  }
  return on_device;
}

void LaunchOnDevice(OpCall& c, c10::Device dev, gpu::Stream stream, bool capturing) {
  TORCH_CHECK_VALUE(c.local.is_cuda(), c.name, ": this session's backend copies between GPUs; local must be on a GPU");
  const std::array<at::Tensor, 3> on_device = ListsOnDevice(c, dev, capturing);
  PointAt(&c.segs, on_device);
  c.segs.local_base = reinterpret_cast<uint64_t>(c.local.data_ptr());
  c.segs.local_size = static_cast<uint64_t>(c.local.nbytes());
  c.segs.error = c.os->errors->device_record();
  const Session& s = *c.os->session;
  try {
    s.peer().LaunchOnStream(*s.local(), s.remote_desc(), c.segs, stream);
  } catch (const Error& e) {
    Rethrow(e);
  }
}

// For a GPU copy of the registration (torch.compile could not reinplace):
// a copy kernel on the stream moving the op's local segments between the
// copy and the registration, before a write's doorbell or after a read's.
class GpuStaging {
 public:
  GpuStaging(const OpCall& c, c10::Device dev, bool capturing) : lists_(ListsOnDevice(c, dev, capturing)) {
    args_ = c.segs;
    PointAt(&args_, lists_);
    args_.remote_offsets = args_.local_offsets;  // the same offsets on both sides
    args_.remote_offset = args_.local_offset;
    const MemoryDesc& reg = c.os->session->local()->desc;
    args_.local_base = reg.data;
    args_.local_size = reg.size;
    args_.remote_base = reinterpret_cast<uint64_t>(c.local.data_ptr());
    args_.remote_size = static_cast<uint64_t>(c.local.nbytes());
    args_.error = c.os->errors->device_record();
  }
  void ToRegistration(gpu::Stream s) { Launch(true, s); }
  void ToCopy(gpu::Stream s) { Launch(false, s); }

 private:
  void Launch(bool into_registration, gpu::Stream s) {
    args_.is_read = into_registration;  // "read" moves remote (the copy) into local (the registration)
    try {
      gpu::LaunchStreamCopy(args_, s);
    } catch (const Error& e) {
      Rethrow(e);
    }
  }
  std::array<at::Tensor, 3> lists_;
  gpu::StreamCopyArgs args_;
};

// A slot captured into a graph lives as long as the graph: a user object
// the graph owns retires the slot's lease when the graph is destroyed, and
// the progress thread then frees the slot. Without graph user objects (HIP
// 5.2) the slot keeps no lease and is watched for the life of the process.
void TieToCapturedGraph(DoorbellSlot& slot, gpu::Stream stream) {
  auto lease = std::make_shared<SlotLease>();
  auto* context = new std::shared_ptr<SlotLease>(lease);
  bool tied = false;
  try {
    tied = gpu::ReleaseWithCapturedGraph(stream, &SlotLease::ReleaseCallback, context);
  } catch (const Error&) {
    tied = false;
  }
  if (!tied) {
    delete context;
    return;
  }
  slot.lease = std::move(lease);
}

// GPU memory over a host-driven backend: the transfer behind the doorbell
// needs CUDA calls of its own (the backend's staging copies). With lazy
// module loading, a kernel loaded for the first time while the stream waits
// here blocks those calls until the wait ends, which it then never does
// (shared/notes/GPU_FACTS.md). Said once per process, with the ways out.
void WarnIfLazyLoadingCanStall(const OpCall& c) {
#if !defined(USE_ROCM)
  static const bool eager = [] {
    const char* mode = std::getenv("CUDA_MODULE_LOADING");  // read by CUDA once, at start-up
    return mode && std::strcmp(mode, "EAGER") == 0;
  }();
  if (eager || c.os->session->local()->desc.loc != MemoryLocationType::GPU) return;
  TORCH_WARN_ONCE(c.name, ": a stream-ordered transfer of GPU memory over a host-driven backend (TCP/RDMA) ",
                  "needs CUDA calls while the stream waits for it. With lazy module loading (CUDA's default), ",
                  "the first launch of a kernel not loaded yet, made while such a transfer is pending, can stall ",
                  "the process for good: run each step's kernels once before its first transfer (a warm-up ",
                  "step), or set CUDA_MODULE_LOADING=EAGER before CUDA starts.");
#endif
}

void RingDoorbell(OpCall& c, c10::Device dev, gpu::Stream stream, bool capturing) {
  WarnIfLazyLoadingCanStall(c);
  std::unique_ptr<GpuStaging> staging;
  if (!IsRegistered(c)) {
    staging = std::make_unique<GpuStaging>(c, dev, capturing);
    if (!c.is_read) staging->ToRegistration(stream);
  }
  auto& service = DoorbellService::Instance();
  const size_t entries = c.segs.local_offsets || c.lists[0].defined() ? static_cast<size_t>(c.segs.count) : 0;
  std::shared_ptr<DoorbellSlot> slot;
  try {
    slot = service.Acquire(entries);
  } catch (const Error& e) {
    Rethrow(e);
  }
  slot->session = c.os->session;
  slot->errors = c.os->errors;
  slot->is_read = c.is_read;
  slot->persistent = capturing;
  slot->segs = c.segs;
  slot->lease.reset();
  if (capturing) TieToCapturedGraph(*slot, stream);
  bool enqueued = false;
  try {
    // Lists: host values now (eager only: CheckCapturableLists refused CPU
    // lists under capture), device values copied by the stream (so a graph
    // replay stages that replay's block table).
    std::array<at::Tensor, 3> keep;
    for (int k = 0; k < 3; ++k) {
      const at::Tensor& t = c.lists[k];
      if (!t.defined()) continue;
      keep[k] = t.contiguous();
      const size_t bytes = static_cast<size_t>(keep[k].numel()) * sizeof(int64_t);
      if (keep[k].is_cuda()) {
        enqueued = true;
        gpu::CopyAsync(reinterpret_cast<uint64_t>(slot->list(k)), reinterpret_cast<uint64_t>(keep[k].data_ptr()),
                       bytes, stream);
      } else if (bytes) {
        std::memcpy(slot->list(k), keep[k].data_ptr(), bytes);
      }
    }
    slot->segs.local_offsets = c.lists[0].defined() ? slot->list(0) : nullptr;
    slot->segs.remote_offsets = c.lists[1].defined() ? slot->list(1) : nullptr;
    slot->segs.sizes = c.lists[2].defined() ? slot->list(2) : nullptr;
    enqueued = true;
    gpu::StreamWriteFlag(stream, slot->ring(), 1);
    gpu::StreamWaitFlag(stream, slot->done(), 1);
    gpu::StreamWriteFlag(stream, slot->done(), 0);
  } catch (const Error& e) {
    // The stream may still touch the slot: keep it watched for good.
    if (enqueued) {
      slot->persistent = true;
      service.Watch(slot);
    }
    Rethrow(e);
  }
  service.Watch(std::move(slot));
  if (staging && c.is_read) staging->ToCopy(stream);
}

void RunOnStream(OpCall c) {
  const c10::Device dev = StreamDevice(c);
  c10::DeviceGuard guard(dev);
  const gpu::Stream stream = CurrentStream(dev);
  bool capturing = false;
  try {
    capturing = gpu::StreamIsCapturing(stream);
  } catch (const Error& e) {
    Rethrow(e);
  }
  CheckCapturableLists(c, capturing);
  if (c.os->session->peer().RunsOnStream()) {
    LaunchOnDevice(c, dev, stream, capturing);
  } else if (c.local.is_cpu() && !IsRegistered(c)) {
    // A host copy of the registration (torch.compile could not reinplace):
    // host code the compiler placed after the op reads it unordered with the
    // stream, so this op completes on the host, after the stream's work.
    TORCH_CHECK_VALUE(!capturing, c.name,
                      ": under CUDA graph capture, local must be the registered tensor itself");
    try {
      gpu::SynchronizeStream(stream);
    } catch (const Error& e) {
      Rethrow(e);
    }
    for (auto& t : c.lists) {
      if (t.defined()) t = t.cpu();
    }
    RunOnHost(std::move(c));
  } else {
    RingDoorbell(c, dev, stream, capturing);
  }
}

// ---------------------------------------------------------------------------
// Op bodies: one per schema, parameterized by where they run.

template <void (*Run)(OpCall)>
struct Impl {
  static void Read(int64_t h, at::Tensor& local, int64_t lo, int64_t ro, int64_t size) {
    Run(ParseSingle("mori.read", true, h, local, lo, ro, size));
  }
  static void Write(int64_t h, const at::Tensor& local, int64_t lo, int64_t ro, int64_t size) {
    Run(ParseSingle("mori.write", false, h, local, lo, ro, size));
  }
  static void BatchRead(int64_t h, at::Tensor& local, const at::Tensor& lo, const at::Tensor& ro,
                        const at::Tensor& sizes) {
    Run(ParseBatch("mori.batch_read", true, h, local, lo, ro, sizes));
  }
  static void BatchWrite(int64_t h, const at::Tensor& local, const at::Tensor& lo, const at::Tensor& ro,
                         const at::Tensor& sizes) {
    Run(ParseBatch("mori.batch_write", false, h, local, lo, ro, sizes));
  }
  static void ReadPages(int64_t h, at::Tensor& local, const at::Tensor& lp, const at::Tensor& rp, int64_t page) {
    Run(ParsePages("mori.read_pages", true, h, local, lp, rp, page));
  }
  static void WritePages(int64_t h, const at::Tensor& local, const at::Tensor& lp, const at::Tensor& rp,
                         int64_t page) {
    Run(ParsePages("mori.write_pages", false, h, local, lp, rp, page));
  }

  static void Register(torch::Library& m) {
    m.impl("read", &Read);
    m.impl("write", &Write);
    m.impl("batch_read", &BatchRead);
    m.impl("batch_write", &BatchWrite);
    m.impl("read_pages", &ReadPages);
    m.impl("write_pages", &WritePages);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(mori, m) {
  m.def("session_handle(__torch__.torch.classes.mori.Session session) -> int", &SessionHandle);
  m.def("release_session_handle(int session) -> ()", &ReleaseSessionHandle);
  m.def("check_errors(int session) -> ()", &CheckErrors);
  m.def("stream_flag_mechanism() -> str", [] { return gpu::StreamFlagMechanism(); });
  m.def("doorbell_slots_watched() -> int",
        [] { return static_cast<int64_t>(DoorbellService::Instance().Watched()); });
  m.def("doorbell_slots_captured() -> int",
        [] { return static_cast<int64_t>(DoorbellService::Instance().Leased()); });
  m.def("read(int session, Tensor(a!) local, int local_offset, int remote_offset, int size) -> ()");
  m.def("write(int session, Tensor local, int local_offset, int remote_offset, int size) -> ()");
  m.def("batch_read(int session, Tensor(a!) local, Tensor local_offsets, Tensor remote_offsets, Tensor sizes) -> ()");
  m.def("batch_write(int session, Tensor local, Tensor local_offsets, Tensor remote_offsets, Tensor sizes) -> ()");
  m.def("read_pages(int session, Tensor(a!) local, Tensor local_pages, Tensor remote_pages, int page_bytes) -> ()");
  m.def("write_pages(int session, Tensor local, Tensor local_pages, Tensor remote_pages, int page_bytes) -> ()");
}

TORCH_LIBRARY_IMPL(mori, CPU, m) { Impl<RunOnHost>::Register(m); }

#if MORI_WITH_GPU
TORCH_LIBRARY_IMPL(mori, CUDA, m) { Impl<RunOnStream>::Register(m); }
#endif

}  // namespace bind
}  // namespace mori_torch
