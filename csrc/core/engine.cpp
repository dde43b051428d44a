#include "core/engine.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>

#include "base/config_table.h"
#include "core/crypto.h"
#include "core/logging.h"
#include "core/transfer_args.h"
#include "gpu/gpu_runtime.h"

namespace mori_torch {
namespace {

// Fastest first: the first backend that can serve a pair takes it.
constexpr BackendType kPreference[] = {BackendType::XGMI, BackendType::RDMA, BackendType::TCP};

bool ValidBackendType(BackendType t) {
  return t == BackendType::XGMI || t == BackendType::RDMA || t == BackendType::TCP;
}

// NUMA node of the page holding `p`, -1 if unknown (move_pages with no
// target nodes only queries).
int NumaNodeOf(uint64_t p) {
  void* page = reinterpret_cast<void*>(p & ~static_cast<uint64_t>(sysconf(_SC_PAGESIZE) - 1));
  int status = -1;
  if (syscall(SYS_move_pages, 0, 1, &page, nullptr, &status, 0) != 0 || status < 0) return -1;
  return status;
}

// Loopback hosts; anything else (0.0.0.0 included) is reachable by others.
bool IsLoopbackHost(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

Incarnation NewIncarnation() {
  Incarnation i = 0;
  while (i == 0) crypto::SecureRandom(&i, sizeof i);  // 0 means "unknown" in descriptors
  return i;
}

bool PageMapped(uint64_t p) {
  const uint64_t page_size = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  unsigned char vec = 0;
  return mincore(reinterpret_cast<void*>(p & ~(page_size - 1)), 1, &vec) == 0;
}

}  // namespace

Engine::Engine(const std::string& key, const EngineConfig& cfg)
    : cfg_(cfg), next_uid_(std::make_shared<std::atomic<uint64_t>>(0)) {
  if (key.empty()) throw Error(StatusCode::ERR_INVALID_ARGS, "IOEngine: key must not be empty");
  if (key.size() > 1024) throw Error(StatusCode::ERR_INVALID_ARGS, "IOEngine: key longer than 1024 bytes");
  desc_.key = key;
  desc_.node_id = DefaultNodeId();
  desc_.hostname = LocalHostname();
  desc_.host = cfg.host.empty() ? "127.0.0.1" : cfg.host;
  desc_.pid = static_cast<int32_t>(getpid());
  desc_.incarnation = NewIncarnation();
  local_mark_ = std::make_unique<LocalEngineMark>(desc_.incarnation);
  memory_.SetOwner(desc_.key, desc_.incarnation);
  self_counters_ = stats_.ForPeer(desc_.key);
  cfg_.secret = auth::ResolveSecret(cfg.secret);
  cfg_.control.secret = cfg_.secret;
  ctx_.self = &desc_;
  ctx_.secret = cfg_.secret;
  ctx_.memory = &memory_;
  ctx_.notices = &notices_;
  ctx_.ask_owner = [this](const MemoryDesc& d, FrameType type) { LookupRemoteMemory(d, type); };
  ctx_.knows_engine = [this](const EngineDesc& peer) { return KnowsEngine(peer); };
  ctx_.connect_timeout_ms = cfg_.connect_timeout_ms;
  ctx_.services = &services_;
  loop_ = std::make_unique<EventLoop>(cfg_.loop_threads);
  ctx_.loop = loop_.get();
  if (config::EnvIsSet("MORI_TORCH_FRAME_TIMEOUT_MS")) {
    const int ms = static_cast<int>(config::EnvInt("MORI_TORCH_FRAME_TIMEOUT_MS"));
    cfg_.control.frame_timeout_ms = cfg_.control.hello_timeout_ms = ms;
  }
  driver_ = std::make_shared<RetryDriver>(cfg_.retry, cfg_.failover);
  driver_->SetRouter([this](const MemoryDesc& local, const MemoryDesc& remote, TransferPath* path, std::string* msg) {
    return PickPath(local, remote, path, msg);
  });
  services_ = MakeEngineServices(ctx_);
  server_ = std::make_unique<ControlPlaneServer>(this, cfg_.control, loop_.get());
  desc_.port = server_->Start(desc_.host, cfg.port);
  MORI_LOG(Info, "engine '" << key << "' listening on " << desc_.host << ":" << desc_.port
                            << (cfg_.secret.empty() ? "" : " (peers must prove the shared secret)"));
  if (cfg_.secret.empty() && !IsLoopbackHost(desc_.host)) {
    MORI_LOG(Warning,
             "engine '" << key << "' listens on " << desc_.host << ":" << desc_.port
                        << " without a secret: anyone who can reach it can read and write the memory "
                           "it registers; set IOEngineConfig(secret=...) or MORI_TORCH_SECRET on every engine");
  }
}

Engine::~Engine() { Shutdown(); }

void Engine::Shutdown() {
  if (shut_down_.exchange(true)) return;
  // Inbound connections first: they call into backends and memory.
  server_->Stop();
  // No retry starts from here on (the router calls into this engine).
  driver_->Shutdown();
  std::array<std::shared_ptr<Backend>, 4> backends;
  {
    std::unique_lock<std::shared_mutex> lk(backends_mu_);
    backends.swap(backends_);
  }
  for (auto& b : backends) {
    if (b) b->Shutdown();
  }
  // Peers that mapped our memory must stop writing into it, since this
  // process may reuse it once the engine is gone: the removal hooks (XGMI's
  // memory ownership) take it back.
  memory_.Clear();
  for (auto& s : services_) s->Shutdown();
  loop_->Stop();
}

void Engine::CheckAlive(const char* what) const {
  if (shut_down_.load())
    throw Error(StatusCode::ERR_BAD_STATE, std::string(what) + ": engine '" + desc_.key + "' is shut down");
}

std::shared_ptr<Backend> Engine::BackendOf(BackendType type) const {
  std::shared_lock<std::shared_mutex> lk(backends_mu_);
  return backends_[static_cast<int>(type)];
}

void Engine::ForEachBackend(const std::function<void(Backend&)>& fn) const {
  for (auto t : kPreference) {
    if (auto b = BackendOf(t)) fn(*b);
  }
}

bool Engine::HasBackend(BackendType type) const { return ValidBackendType(type) && BackendOf(type) != nullptr; }

void Engine::CreateBackend(BackendType type, const BackendConfig& config) {
  if (!ValidBackendType(type)) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "create_backend: unknown backend type " + std::to_string(static_cast<int>(type)));
  }
  CheckAlive("create_backend");
  std::unique_lock<std::shared_mutex> lk(backends_mu_);
  auto& slot = backends_[static_cast<int>(type)];
  if (slot) {
    MORI_LOG(Warning, "create_backend: backend " << BackendTypeName(type) << " already exists on engine '" << desc_.key
                                                 << "'; keeping it");
    return;
  }
  slot = MakeBackend(type, config, ctx_);
}

void Engine::RemoveBackend(BackendType type) {
  CheckAlive("remove_backend");
  if (!ValidBackendType(type)) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "remove_backend: unknown backend type " + std::to_string(static_cast<int>(type)));
  }
  std::shared_ptr<Backend> b;
  {
    std::unique_lock<std::shared_mutex> lk(backends_mu_);
    b.swap(backends_[static_cast<int>(type)]);
  }
  if (b) b->Shutdown();
}

void Engine::RegisterRemoteEngine(const EngineDesc& desc) {
  CheckAlive("register_remote_engine");
  if (desc.key.empty()) throw Error(StatusCode::ERR_INVALID_ARGS, "register_remote_engine: empty engine key");
  std::unique_lock<std::shared_mutex> lk(remotes_mu_);
  auto it = remotes_.find(desc.key);
  if (it != remotes_.end() && it->second.desc != desc) {
    MORI_LOG(Info, "register_remote_engine: '" << desc.key << "' re-registered with a new descriptor");
    control_clients_.erase(desc.key);
    lk.unlock();
    ForEachBackend([&](Backend& b) { b.RemovePeer(desc.key, "remote engine '" + desc.key + "' was re-registered"); });
    lk.lock();
  }
  remotes_[desc.key] = Remote{desc, stats_.ForPeer(desc.key)};
}

void Engine::DeregisterRemoteEngine(const EngineDesc& desc, const std::string& reason) {
  CheckAlive("deregister_remote_engine");
  {
    std::unique_lock<std::shared_mutex> lk(remotes_mu_);
    if (remotes_.erase(desc.key) == 0) {
      throw Error(StatusCode::ERR_NOT_FOUND, "deregister_remote_engine: engine '" + desc.key + "' is not registered");
    }
    control_clients_.erase(desc.key);
  }
  const std::string why = reason.empty() ? "remote engine '" + desc.key + "' was deregistered"
                                         : "remote engine '" + desc.key + "': " + reason;
  ForEachBackend([&](Backend& b) { b.RemovePeer(desc.key, why); });
}

MemoryDesc Engine::RegisterMemory(uint64_t ptr, int64_t size, int device_id, MemoryLocationType loc) {
  CheckAlive("register_memory");
  if (ptr == 0) throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: ptr is 0 (null pointer)");
  if (size <= 0) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: size must be positive, got " + std::to_string(size));
  }
  if (ptr + static_cast<uint64_t>(size) < ptr) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: ptr + size overflows");
  }
  MemoryDesc d;
  d.engine_key = desc_.key;
  d.incarnation = desc_.incarnation;
  d.data = ptr;
  d.size = static_cast<uint64_t>(size);
  d.loc = loc;
  switch (loc) {
    case MemoryLocationType::CPU:
      if (!PageMapped(ptr) || !PageMapped(ptr + static_cast<uint64_t>(size) - 1)) {
        throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: host range [" + std::to_string(ptr) + ", +" +
                                                      std::to_string(size) + ") is not mapped in this process");
      }
      d.device_id = -1;
      d.numa_node = NumaNodeOf(ptr);
      break;
    case MemoryLocationType::GPU: {
      gpu::DeviceRange r = gpu::DescribeDeviceRange(ptr, static_cast<uint64_t>(size));
      if (device_id >= 0 && device_id != r.device) {
        throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: device_id " + std::to_string(device_id) +
                                                      " does not match the memory's device " +
                                                      std::to_string(r.device));
      }
      d.device_id = r.device;
      d.device_bus_id = r.bus_id;
      // IPC handles name whole allocations: publish the base's handle and
      // where the range sits in it (torch's caching allocator sub-allocates).
      gpu::DeviceScope on_device(r.device);  // the handle comes from the memory's context
      d.ipc_handle = gpu::IpcHandleOf(r.alloc_base);
      d.ipc_offset = ptr - r.alloc_base;
      d.numa_node = -1;
      break;
    }
    default:
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "register_memory: mem_loc " + std::to_string(static_cast<int>(loc)) + " is not CPU(1) or GPU(2)");
  }
  return memory_.Add(std::move(d))->desc;
}

void Engine::DeregisterMemory(const MemoryDesc& desc) {
  CheckAlive("deregister_memory");
  if (desc.engine_key != desc_.key) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "deregister_memory: memory " + std::to_string(desc.id) +
                                                  " belongs to engine '" + desc.engine_key + "', not '" + desc_.key +
                                                  "'");
  }
  auto m = memory_.Find(desc.id, desc.token);
  if (!m || m->desc.data != desc.data || m->desc.size != desc.size) {
    throw Error(StatusCode::ERR_NOT_FOUND, "deregister_memory: memory " + std::to_string(desc.id) +
                                               " is not registered with engine '" + desc_.key + "'");
  }
  // Retires it (waits for local I/O); the removal hooks then take it back
  // from every engine that mapped it: when this returns, no peer writes
  // into it any more.
  memory_.Remove(desc.id);
}

std::shared_ptr<ControlClient> Engine::ClientFor(const std::string& engine_key) {
  std::unique_lock<std::shared_mutex> lk(remotes_mu_);
  auto it = remotes_.find(engine_key);
  if (it == remotes_.end()) {
    throw Error(StatusCode::ERR_NOT_FOUND,
                "remote engine '" + engine_key + "' is not registered; call register_remote_engine first");
  }
  auto& c = control_clients_[engine_key];
  if (!c) c = std::make_shared<ControlClient>(desc_, it->second.desc, cfg_.connect_timeout_ms, cfg_.secret);
  return c;
}

void Engine::LookupRemoteMemory(const MemoryDesc& desc, FrameType type) {
  Frame reply = ClientFor(desc.engine_key)->Call(type, EncodeMemoryRef(desc));
  if (reply.type != FrameType::MemLookupReply) {
    throw Error(StatusCode::ERR_BAD_STATE, "engine '" + desc.engine_key +
                                               "' answered a memory lookup with frame type " +
                                               std::to_string(static_cast<int>(reply.type)));
  }
  MemoryDesc there = MemoryDesc::Unpack(reply.payload.data(), reply.payload.size());
  if (there.data != desc.data || there.size != desc.size || there.loc != desc.loc) {
    throw Error(StatusCode::ERR_NOT_FOUND, "remote memory " + std::to_string(desc.id) + " of engine '" +
                                               desc.engine_key + "' no longer matches its descriptor");
  }
}

void Engine::ValidateRemoteMemory(const MemoryDesc& desc) {
  CheckAlive("validate_remote_memory");
  if (desc.engine_key == desc_.key) return;  // our own memory: checked locally
  LookupRemoteMemory(desc, FrameType::MemLookup);
}

bool Engine::KnowsEngine(const EngineDesc& peer) const {
  if (peer == desc_) return true;
  std::shared_lock<std::shared_mutex> lk(remotes_mu_);
  auto it = remotes_.find(peer.key);
  return it != remotes_.end() && it->second.desc == peer;
}

StatusCode Engine::Resolve(const MemoryDesc& local, const MemoryDesc& remote, Route* route, std::string* msg) {
  if (shut_down_.load()) {
    *msg = "engine '" + desc_.key + "' is shut down";
    return StatusCode::ERR_BAD_STATE;
  }
  if (local.engine_key != desc_.key) {
    *msg = "local memory " + std::to_string(local.id) + " belongs to engine '" + local.engine_key + "', not '" +
           desc_.key + "'";
    return StatusCode::ERR_INVALID_ARGS;
  }
  route->local = memory_.Find(local.id, local.token);
  if (!route->local || route->local->desc.data != local.data || route->local->desc.size != local.size) {
    *msg = "local memory " + std::to_string(local.id) + " is not registered with engine '" + desc_.key +
           "' (deregistered?)";
    return StatusCode::ERR_NOT_FOUND;
  }
  return PickPath(local, remote, &route->path, msg);
}

StatusCode Engine::PickPath(const MemoryDesc& local, const MemoryDesc& remote, TransferPath* path, std::string* msg) {
  if (shut_down_.load()) {
    *msg = "engine '" + desc_.key + "' is shut down";
    return StatusCode::ERR_BAD_STATE;
  }
  EngineDesc remote_engine;
  std::shared_ptr<TransferStats::PeerCounters> counters;
  {
    std::shared_lock<std::shared_mutex> lk(remotes_mu_);
    auto it = remotes_.find(remote.engine_key);
    if (it != remotes_.end()) {
      remote_engine = it->second.desc;
      counters = it->second.counters;
    } else if (remote.engine_key == desc_.key) {
      remote_engine = desc_;
      counters = self_counters_;
    } else {
      *msg = "remote engine '" + remote.engine_key + "' is not registered; call register_remote_engine first";
      return StatusCode::ERR_NOT_FOUND;
    }
  }
  PathHealth& health = driver_->health();
  std::shared_ptr<Backend> chosen, first_capable;
  int capable = 0;
  for (auto t : kPreference) {
    auto b = BackendOf(t);
    if (!b || !b->CanServe(local, remote, remote_engine)) continue;
    ++capable;
    if (!first_capable) first_capable = b;
    // Asked only until one is chosen: asking claims a due probe.
    if (!chosen && health.Usable(remote_engine.key, t)) chosen = b;
  }
  if (!chosen) chosen = std::move(first_capable);  // every capable path is down: try the preferred
  if (chosen) {
    path->peer = chosen->Peer(remote_engine);
    path->backend = std::move(chosen);
    path->peer_key = remote_engine.key;
    path->alternative = capable > 1;
    path->counters = TransferStats::Of(counters, path->backend->Type());
    return StatusCode::SUCCESS;
  }
  *msg = "No available backend found, create backend first (local " + std::string(MemoryLocationName(local.loc)) +
         " memory, remote " + MemoryLocationName(remote.loc) + " memory)";
  return StatusCode::ERR_BAD_STATE;
}

StatusPtr Engine::Prepare(bool is_read, const MemoryDesc& local, const MemoryDesc& remote, Int64Span local_offsets,
                          Int64Span remote_offsets, Int64Span sizes, TransferUid uid, TransferOp* op,
                          TransferPath* path) {
  auto status = MakeStatus();
  std::string msg;
  auto segs = NewSegmentBatch();
  StatusCode c = BuildSegments(local_offsets, remote_offsets, sizes, local, remote, segs.get(), &msg);
  Route route;
  if (c == StatusCode::SUCCESS) c = Resolve(local, remote, &route, &msg);
  if (c != StatusCode::SUCCESS) {
    stats_.Unrouted().Rejected(is_read, c);
    status->Update(c, msg);
    return status;
  }
  op->segs = std::move(segs);
  op->is_read = is_read;
  op->local = std::move(route.local);
  op->remote = remote;
  op->uid = uid;
  op->status = status;
  AttachRecord(*op, route.path.counters);
  *path = std::move(route.path);
  return status;
}

StatusPtr Engine::Submit(bool is_read, const MemoryDesc& local, const MemoryDesc& remote, Int64Span local_offsets,
                         Int64Span remote_offsets, Int64Span sizes, TransferUid uid) {
  TransferOp op;
  TransferPath path;
  StatusPtr status = Prepare(is_read, local, remote, local_offsets, remote_offsets, sizes, uid, &op, &path);
  if (op.status) driver_->Submit(std::move(op), std::move(path));
  return status;
}

StatusPtr Engine::Read(const MemoryDesc& local, int64_t lo, const MemoryDesc& remote, int64_t ro, int64_t size,
                       TransferUid uid) {
  return Submit(true, local, remote, {lo}, {ro}, {size}, uid);
}

StatusPtr Engine::Write(const MemoryDesc& local, int64_t lo, const MemoryDesc& remote, int64_t ro, int64_t size,
                        TransferUid uid) {
  return Submit(false, local, remote, {lo}, {ro}, {size}, uid);
}

namespace {
std::vector<const MemoryDesc*> Addresses(const std::vector<MemoryDesc>& v) {
  std::vector<const MemoryDesc*> out;
  out.reserve(v.size());
  for (const MemoryDesc& d : v) out.push_back(&d);
  return out;
}
}  // namespace

std::vector<StatusPtr> Engine::BatchTransfer(bool is_read, const std::vector<MemoryDesc>& locals,
                                             const std::vector<Int64Span>& local_offsets,
                                             const std::vector<MemoryDesc>& remotes,
                                             const std::vector<Int64Span>& remote_offsets,
                                             const std::vector<Int64Span>& sizes, const std::vector<int64_t>& uids) {
  return BatchTransfer(is_read, Addresses(locals), local_offsets, Addresses(remotes), remote_offsets, sizes, uids);
}

std::vector<StatusPtr> Engine::BatchTransfer(bool is_read, const std::vector<const MemoryDesc*>& locals,
                                             const std::vector<Int64Span>& local_offsets,
                                             const std::vector<const MemoryDesc*>& remotes,
                                             const std::vector<Int64Span>& remote_offsets,
                                             const std::vector<Int64Span>& sizes, const std::vector<int64_t>& uids) {
  const size_t n = locals.size();
  std::vector<StatusPtr> out;
  out.reserve(n);
  if (remotes.size() != n || local_offsets.size() != n || remote_offsets.size() != n || sizes.size() != n ||
      uids.size() != n) {
    const std::string msg = "mismatched list lengths: local_descs " + std::to_string(n) + ", local_offsets " +
                            std::to_string(local_offsets.size()) + ", remote_descs " + std::to_string(remotes.size()) +
                            ", remote_offsets " + std::to_string(remote_offsets.size()) + ", sizes " +
                            std::to_string(sizes.size()) + ", uids " + std::to_string(uids.size());
    for (size_t i = 0; i < n; ++i) {
      stats_.Unrouted().Rejected(is_read, StatusCode::ERR_INVALID_ARGS);
      out.push_back(MakeStatus(StatusCode::ERR_INVALID_ARGS, msg));
    }
    return out;
  }
  // Every pair checked and routed first, then the routed ones go out
  // together: a backend may coalesce them (Backend::SubmitGroup).
  std::vector<std::pair<TransferOp, TransferPath>> routed;
  routed.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    TransferOp op;
    TransferPath path;
    out.push_back(Prepare(is_read, *locals[i], *remotes[i], local_offsets[i], remote_offsets[i], sizes[i],
                          static_cast<TransferUid>(uids[i]), &op, &path));
    if (op.status) routed.emplace_back(std::move(op), std::move(path));
  }
  if (!routed.empty()) driver_->SubmitGroup(std::move(routed));
  return out;
}

std::shared_ptr<Session> Engine::CreateSession(const MemoryDesc& local, const MemoryDesc& remote) {
  CheckAlive("create_session");
  Route route;
  std::string msg;
  StatusCode c = Resolve(local, remote, &route, &msg);
  if (c == StatusCode::ERR_BAD_STATE) {
    MORI_LOG(Info, "create_session: " << msg);
    return nullptr;
  }
  if (c != StatusCode::SUCCESS) throw Error(c, "create_session: " + msg);
  ValidateRemoteMemory(remote);
  return std::make_shared<Session>(std::move(route.local), remote, std::move(route.path), driver_, next_uid_);
}

size_t Engine::MappedRemoteMemories() const {
  size_t n = 0;
  ForEachBackend([&](Backend& b) { n += b.MappedRemoteMemories(); });
  return n;
}

bool Engine::PopInboundTransferStatus(const std::string& initiator_key, TransferUid uid) {
  CheckAlive("pop_inbound_transfer_status");
  return notices_.Pop(initiator_key, uid);
}

StatusCode Engine::WaitAll(const std::vector<StatusPtr>& statuses, int64_t timeout_ms) {
  const Deadline deadline = DeadlineAfterMs(timeout_ms);
  StatusCode first_error = StatusCode::SUCCESS;
  bool pending = false;
  for (const auto& s : statuses) {
    if (!s) continue;
    StatusCode c;
    if (timeout_ms == 0) {
      c = s->Code();
    } else if (timeout_ms < 0) {
      c = s->WaitFor(-1);
    } else {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      c = s->WaitFor(left > 0 ? left : 0);
    }
    if (IsError(c)) {
      if (first_error == StatusCode::SUCCESS) first_error = c;
      if (timeout_ms >= 0) return c;  // a seen error beats IN_PROGRESS
    } else if (c != StatusCode::SUCCESS) {
      pending = true;
    }
  }
  if (first_error != StatusCode::SUCCESS) return first_error;
  return pending ? StatusCode::IN_PROGRESS : StatusCode::SUCCESS;
}

bool Engine::HandleControl(const EngineDesc& peer, const std::string& peer_ip, const Frame& request, Frame* reply) {
  switch (request.type) {
    case FrameType::Ping:
      reply->type = FrameType::Pong;
      return true;
    case FrameType::MemLookup: {
      auto m = memory_.FindByRef(request.payload, "MemLookup frame");
      reply->type = FrameType::MemLookupReply;
      reply->payload = m->desc.Pack();
      return true;
    }
    default:
      // Frames a backend family owns (XGMI's MemWatch, MemRevoke ...).
      for (const auto& s : services_) {
        if (s->Handles(request.type)) {
          s->HandleControl(peer, peer_ip, request, reply);
          return true;
        }
      }
      return false;
  }
}

std::string Engine::CanServeData(uint8_t backend) {
  if (backend > 3 || !ValidBackendType(static_cast<BackendType>(backend))) {
    return "unknown backend type " + std::to_string(backend);
  }
  auto b = BackendOf(static_cast<BackendType>(backend));
  if (!b || !b->AcceptsDataConnections()) {
    return std::string("engine '") + desc_.key + "' has no " + BackendTypeName(static_cast<BackendType>(backend)) +
           " backend; create it on both engines";
  }
  return "";
}

bool Engine::AdoptData(uint8_t backend, const EngineDesc& peer, InboundConnection& conn) {
  auto b = BackendOf(static_cast<BackendType>(backend));
  return b && b->AdoptData(peer, conn);
}

void Engine::ServeData(uint8_t backend, const EngineDesc& peer, Socket& sock) {
  auto b = BackendOf(static_cast<BackendType>(backend));
  if (b) b->ServeData(peer, sock);
}

}  // namespace mori_torch
