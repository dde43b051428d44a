#include "backends/xgmi/xgmi_backend.h"

#include <unistd.h>

#include <chrono>
#include <cstring>

#include "core/logging.h"
#include "gpu/stream_ops.h"

namespace mori_torch {
namespace xgmi {

XgmiConfig XgmiConfig::FromMap(const BackendConfig& m) {
  constexpr const char* kName = "XgmiBackendConfig";
  CheckConfigKeys(m, kName, {"num_streams", "num_events", "kernel_min_segments", "kernel_max_avg_bytes"});
  XgmiConfig c;
  c.num_streams = ConfigValue(m, kName, "num_streams", c.num_streams, 1, 1024);
  c.num_events = ConfigValue(m, kName, "num_events", c.num_events, 1, 1 << 16);
  c.kernel_min_segments = ConfigValue(m, kName, "kernel_min_segments", c.kernel_min_segments, 1, INT32_MAX);
  c.kernel_max_avg_bytes =
      ConfigValue(m, kName, "kernel_max_avg_bytes", c.kernel_max_avg_bytes, 1, INT64_C(1) << 40);
  return c;
}

// One transfer's completion, shared by the completion thread and the
// status's progress hook (which may outlive the backend, so it holds only
// this object).
struct PendingCopy {
  std::mutex mu;
  StatusPtr status;
  gpu::Event event = nullptr;  // null once released
  int device = -1;
  bool done = false;
  MemoryUse use;

  // Checks the event; ends the status when the copies finished or failed.
  void Poll() {
    gpu::RelaxedCaptureScope relaxed;  // callers' threads must not break a capture elsewhere
    std::lock_guard<std::mutex> lk(mu);
    if (done || !event) return;
    try {
      if (gpu::QueryEvent(event) == 0) return;
      status->Update(StatusCode::SUCCESS);
    } catch (const Error& e) {
      status->Update(StatusCode::ERR_GPU_OP, e.what());
    }
    done = true;
  }
};

XgmiBackend::XgmiBackend(const XgmiConfig& cfg, const BackendContext& ctx) : cfg_(cfg), ctx_(ctx) {
  if (gpu::DeviceCount() == 0) {
    throw Error(StatusCode::ERR_BAD_STATE, gpu::Compiled() ? "create_backend(XGMI): no GPU is visible"
                                                            : "create_backend(XGMI): this build has no GPU support");
  }
  completion_thread_ = std::thread([this] { CompletionLoop(); });
}

XgmiBackend::~XgmiBackend() { Shutdown(); }

bool XgmiBackend::CanServe(const MemoryDesc& local, const MemoryDesc& remote, const EngineDesc& remote_engine) const {
  return local.loc == MemoryLocationType::GPU && remote.loc == MemoryLocationType::GPU &&
         remote_engine.node_id == ctx_.self->node_id;
}

std::shared_ptr<BackendPeer> XgmiBackend::Peer(const EngineDesc& remote) {
  return peers_.GetOrCreate(remote.key, [&] {
    auto p = std::make_shared<XgmiPeer>(this, remote);
    if (shut_.load()) p->Close();
    return p;
  });
}

void XgmiBackend::RemovePeer(const std::string& key) {
  if (auto p = peers_.Take(key)) p->Close();
}

DeviceContext& XgmiBackend::Device(int device) {
  std::lock_guard<std::mutex> lk(dev_mu_);
  auto& dc = devices_[device];
  if (!dc) {
    auto fresh = std::make_unique<DeviceContext>();
    fresh->device = device;
    gpu::WarmUpKernels(device);
    for (int64_t i = 0; i < cfg_.num_streams; ++i) {
      auto lane = std::make_unique<DeviceContext::Lane>();
      lane->stream = gpu::CreateStream(device);
      lane->list_copied = gpu::CreateEvent(device);
      fresh->lanes.push_back(std::move(lane));
    }
    std::lock_guard<std::mutex> ek(event_mu_);
    auto& pool = free_events_[device];
    for (int64_t i = 0; i < cfg_.num_events; ++i) pool.push_back(gpu::CreateEvent(device));
    dc = std::move(fresh);
  }
  return *dc;
}

gpu::Event XgmiBackend::TakeEvent(int device) {
  {
    std::lock_guard<std::mutex> lk(event_mu_);
    auto& pool = free_events_[device];
    if (!pool.empty()) {
      gpu::Event e = pool.back();
      pool.pop_back();
      return e;
    }
  }
  return gpu::CreateEvent(device);  // pool exhausted: grow
}

void XgmiBackend::ReturnEvent(gpu::Event e, int device) {
  std::lock_guard<std::mutex> lk(event_mu_);
  free_events_[device].push_back(e);
}

void XgmiBackend::Run(TransferOp op, uint64_t remote_base) {
  gpu::RelaxedCaptureScope relaxed;  // lane setup allocates: never break a capture elsewhere
  const StatusPtr status = op.status;
  auto pending = std::make_shared<PendingCopy>();
  pending->status = status;
  pending->use = MemoryUse(op.local);
  if (!pending->use) {
    status->Update(StatusCode::ERR_NOT_FOUND, "local memory " + std::to_string(op.local->desc.id) +
                                                  " was deregistered");
    return;
  }
  const int dev = op.local->desc.device_id;
  pending->device = dev;
  const std::vector<Segment> segs = MergeContiguous(op.segs);
  std::vector<gpu::CopySegment> copies;
  copies.reserve(segs.size());
  uint64_t total = 0;
  const uint64_t local_base = op.local->desc.data;
  for (const auto& s : segs) {
    const uint64_t l = local_base + s.local_off, r = remote_base + s.remote_off;
    copies.push_back(op.is_read ? gpu::CopySegment{l, r, s.size} : gpu::CopySegment{r, l, s.size});
    total += s.size;
  }
  try {
    DeviceContext& dc = Device(dev);
    DeviceContext::Lane& lane = *dc.lanes[dc.next.fetch_add(1, std::memory_order_relaxed) % dc.lanes.size()];
    std::lock_guard<std::mutex> lk(lane.mu);
    gpu::SetDevice(dev);
    const bool use_kernel = copies.size() >= static_cast<size_t>(cfg_.kernel_min_segments) &&
                            total / copies.size() < static_cast<uint64_t>(cfg_.kernel_max_avg_bytes);
    if (use_kernel) {
      // The pinned list may be rewritten only once its previous upload ran.
      if (lane.list_pending) {
        while (gpu::QueryEvent(lane.list_copied) == 0) std::this_thread::yield();
        lane.list_pending = false;
      }
      if (lane.capacity < copies.size()) {
        gpu::SynchronizeStream(lane.stream);  // the old device list may still be read
        gpu::PinnedFree(lane.host_list, lane.capacity * sizeof(gpu::CopySegment));
        gpu::DeviceFree(lane.device_list, dev);
        lane.host_list = nullptr;
        lane.device_list = nullptr;
        lane.capacity = 0;
        size_t cap = 1024;
        while (cap < copies.size()) cap *= 2;
        lane.host_list = static_cast<gpu::CopySegment*>(gpu::PinnedAlloc(cap * sizeof(gpu::CopySegment), -1));
        lane.device_list = static_cast<gpu::CopySegment*>(gpu::DeviceAlloc(dev, cap * sizeof(gpu::CopySegment)));
        lane.capacity = cap;
      }
      std::memcpy(lane.host_list, copies.data(), copies.size() * sizeof(gpu::CopySegment));
      gpu::CopyAsync(reinterpret_cast<uint64_t>(lane.device_list), reinterpret_cast<uint64_t>(lane.host_list),
                     copies.size() * sizeof(gpu::CopySegment), lane.stream);
      gpu::RecordEvent(lane.list_copied, lane.stream);
      lane.list_pending = true;
      gpu::LaunchSegmentCopy(lane.device_list, static_cast<uint32_t>(copies.size()), lane.stream);
    } else {
      for (const auto& c : copies) gpu::CopyAsync(c.dst, c.src, c.bytes, lane.stream);
    }
    pending->event = TakeEvent(dev);
    gpu::RecordEvent(pending->event, lane.stream);
  } catch (const Error& e) {
    if (pending->event) ReturnEvent(pending->event, dev);
    status->Update(e.code() == StatusCode::ERR_INVALID_ARGS ? e.code() : StatusCode::ERR_GPU_OP, e.what());
    return;
  }
  status->SetProgressHook([pending] { pending->Poll(); });
  {
    std::lock_guard<std::mutex> lk(pending_mu_);
    pending_.push_back(pending);
  }
  pending_cv_.notify_one();
}

size_t XgmiBackend::Reap() {
  std::deque<std::shared_ptr<PendingCopy>> work;
  {
    std::lock_guard<std::mutex> lk(pending_mu_);
    work.swap(pending_);
  }
  std::deque<std::shared_ptr<PendingCopy>> still;
  for (auto& p : work) {
    p->Poll();
    std::lock_guard<std::mutex> lk(p->mu);
    if (p->done) {
      ReturnEvent(p->event, p->device);
      p->event = nullptr;
      p->use.reset();
    } else {
      still.push_back(std::move(p));
    }
  }
  std::lock_guard<std::mutex> lk(pending_mu_);
  for (auto& p : still) pending_.push_front(std::move(p));
  return pending_.size();
}

void XgmiBackend::CompletionLoop() {
  gpu::RelaxCaptureModeForThisThread();  // event queries must not break a capture elsewhere
  while (true) {
    {
      std::unique_lock<std::mutex> lk(pending_mu_);
      pending_cv_.wait(lk, [&] { return shut_.load() || !pending_.empty(); });
      if (shut_.load()) return;
    }
    if (Reap() > 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void XgmiBackend::Shutdown() {
  if (shut_.exchange(true)) return;
  pending_cv_.notify_all();
  if (completion_thread_.joinable()) completion_thread_.join();
  // Let running copies finish: their memory may be freed once we return.
  std::lock_guard<std::mutex> lk(dev_mu_);
  for (auto& kv : devices_) {
    for (auto& lane : kv.second->lanes) {
      try {
        gpu::SynchronizeStream(lane->stream);
      } catch (const Error& e) {
        MORI_LOG(Error, "XGMI shutdown: " << e.what());
      }
    }
  }
  for (auto& p : pending_) {
    p->Poll();
    std::lock_guard<std::mutex> pk(p->mu);
    if (!p->done) p->status->Update(StatusCode::ERR_BAD_STATE, "XGMI backend was removed or its engine shut down");
    p->done = true;
    p->event = nullptr;  // destroyed with the pools below
    p->use.reset();
  }
  pending_.clear();
  for (auto& p : peers_.TakeAll()) p->Close();
  for (auto& kv : devices_) {
    for (auto& lane : kv.second->lanes) {
      gpu::PinnedFree(lane->host_list, lane->capacity * sizeof(gpu::CopySegment));
      gpu::DeviceFree(lane->device_list, kv.first);
      gpu::DestroyEvent(lane->list_copied, kv.first);
      gpu::DestroyStream(lane->stream, kv.first);
    }
  }
  std::lock_guard<std::mutex> ek(event_mu_);
  for (auto& kv : free_events_) {
    for (auto e : kv.second) gpu::DestroyEvent(e, kv.first);
  }
  free_events_.clear();
}

XgmiPeer::XgmiPeer(XgmiBackend* backend, EngineDesc remote)
    : backend_(backend),
      remote_(std::move(remote)),
      same_process_(remote_.pid == static_cast<int32_t>(getpid()) &&
                    remote_.node_id == backend->ctx().self->node_id) {}

XgmiPeer::~XgmiPeer() { Close(); }

void XgmiPeer::Close() {
  if (closed_.exchange(true)) return;
  std::lock_guard<std::mutex> lk(map_mu_);
  for (auto& kv : mapped_) {
    try {
      gpu::CloseIpcHandle(kv.second.base, kv.second.device);
    } catch (const Error& e) {
      MORI_LOG(Warning, "XGMI: closing the mapping of " << remote_.key << "'s memory " << kv.first << ": "
                                                        << e.what());
    }
  }
  mapped_.clear();
}

uint64_t XgmiPeer::RemoteBase(const MemoryDesc& d, int local_device) {
  if (same_process_) {
    gpu::EnablePeerAccess(local_device, d.device_id);
    return d.data;
  }
  std::lock_guard<std::mutex> lk(map_mu_);
  auto it = mapped_.find(d.id);
  if (it == mapped_.end()) {
    Mapping m;
    m.device = local_device;
    m.base = gpu::OpenIpcHandle(d.ipc_handle, local_device);
    it = mapped_.emplace(d.id, m).first;
  }
  return it->second.base + d.ipc_offset;
}

void XgmiPeer::Submit(TransferOp op) {
  if (closed_.load() || backend_->shut_down()) {
    op.status->Update(StatusCode::ERR_BAD_STATE, "XGMI peer '" + remote_.key + "' is closed");
    return;
  }
  uint64_t base;
  try {
    base = RemoteBase(op.remote, op.local->desc.device_id);
  } catch (const Error& e) {
    op.status->Update(StatusCode::ERR_GPU_OP, "mapping memory " + std::to_string(op.remote.id) + " of engine '" +
                                                  remote_.key + "': " + e.what());
    return;
  }
  backend_->Run(std::move(op), base);
}

}  // namespace xgmi
}  // namespace mori_torch
