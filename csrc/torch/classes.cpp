// TorchScript custom classes torch.classes.mori.{Engine, Session,
// TransferStatus, EngineDesc, MemoryDesc}: the objects mori_torch.io wraps,
// usable from torch.jit.script code and LibTorch. The only file (with the op
// registrations) that includes torch headers.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "base/config_table.h"
#include "core/engine.h"
#include "core/logging.h"
#include "gpu/gpu_runtime.h"
#include "gpu/trace_ranges.h"
#include "torch/classes.h"
#include "torch/int64_buffers.h"

namespace mori_torch {
namespace bind {

[[noreturn]] void Rethrow(const Error& e) {
  const std::string msg = std::string(StatusCodeName(e.code())) + ": " + e.what();
  if (e.code() == StatusCode::ERR_INVALID_ARGS || e.code() == StatusCode::ERR_NOT_FOUND) {
    TORCH_CHECK_VALUE(false, msg);
  }
  TORCH_CHECK(false, msg);
}

template <typename F>
auto Guard(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    Rethrow(e);
  }
}

at::Tensor BytesToTensor(const std::vector<uint8_t>& b) {
  auto t = at::empty({static_cast<int64_t>(b.size())}, at::TensorOptions().dtype(at::kByte));
  if (!b.empty()) std::memcpy(t.data_ptr(), b.data(), b.size());
  return t;
}

std::vector<uint8_t> TensorToBytes(const at::Tensor& t, const char* what) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte && t.device().is_cpu() && t.dim() == 1, what,
                   ": expected a 1-D CPU uint8 tensor of packed bytes");
  auto c = t.contiguous();
  const auto* p = c.data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + c.numel());
}

std::vector<int64_t> ToVec(const c10::List<int64_t>& l) { return std::vector<int64_t>(l.begin(), l.end()); }

// "[a, b, c]" without iostreams: formatting numbers through ostream crashed
// inside the GPU machine's Python process (see core/logging.h), so error
// messages here pass only strings to TORCH_CHECK.
std::string Str(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

StatusRef Wrap(StatusPtr p) { return c10::make_intrusive<TransferStatusObj>(std::move(p)); }

struct EngineDescObj : torch::CustomClassHolder {
  EngineDesc d;
  explicit EngineDescObj(EngineDesc x) : d(std::move(x)) {}
};
using EngineDescRef = c10::intrusive_ptr<EngineDescObj>;

MemoryDescRef Wrap(MemoryDesc d) { return c10::make_intrusive<MemoryDescObj>(std::move(d)); }

// The descriptors' addresses inside their objects, which the list keeps
// alive for the call (no copy of each descriptor).
std::vector<const MemoryDesc*> DescAddresses(const c10::List<MemoryDescRef>& l) {
  std::vector<const MemoryDesc*> out;
  out.reserve(l.size());
  for (const MemoryDescRef& r : l) out.push_back(&r->d);
  return out;
}

std::vector<std::vector<int64_t>> ToVecs(const c10::List<c10::List<int64_t>>& l) {
  std::vector<std::vector<int64_t>> out;
  out.reserve(l.size());
  for (const c10::List<int64_t>& x : l) out.push_back(ToVec(x));
  return out;
}

// Spans over lists of values that the caller keeps alive for the call.
std::vector<Int64Span> Spans(const std::vector<std::vector<int64_t>>& l) {
  return std::vector<Int64Span>(l.begin(), l.end());
}

// One int64 tensor per memory pair (mori_torch._C.int64_tensor made them
// from the caller's lists, or the caller passed tensors or numpy arrays),
// read in place: `holders` keeps a contiguous CPU copy where one was needed.
std::vector<Int64Span> Spans(const c10::List<at::Tensor>& l, const char* name, std::vector<HostInt64>* holders) {
  holders->reserve(holders->size() + l.size());  // spans point into the tensors, which stay put either way
  std::vector<Int64Span> out;
  out.reserve(l.size());
  for (const at::Tensor& t : l) {
    holders->push_back(ToHostInt64(t, name));
    out.push_back(holders->back().span());
  }
  return out;
}

EngineObj::EngineObj(const std::string& key, const std::string& host, int64_t port, const std::string& secret,
                     bool failover, int64_t retry_attempts, int64_t retry_budget_ms) {
  Guard([&] {
    EngineConfig cfg;
    cfg.host = host;
    cfg.secret = secret;
    cfg.port = static_cast<int>(config::Value({{"port", port}}, "IOEngineConfig", "port"));
    cfg.retry.enabled = cfg.failover.enabled = failover;
    cfg.retry.max_attempts =
        static_cast<int>(config::Value({{"retry_attempts", retry_attempts}}, "IOEngineConfig", "retry_attempts"));
    cfg.retry.budget_ms = config::Value({{"retry_budget_ms", retry_budget_ms}}, "IOEngineConfig", "retry_budget_ms");
    e = std::make_shared<Engine>(key, cfg);
    return 0;
  });
}

EngineObj::~EngineObj() {
  if (e) e->Shutdown();
}

MemoryDescRef EngineObj::RegisterTensor(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), "register_torch_tensor: tensor is undefined");
  TORCH_CHECK_VALUE(t.is_contiguous(), "register_torch_tensor: tensor must be contiguous (got sizes ", Str(t.sizes()),
                    ", strides ", Str(t.strides()), "); call .contiguous() first");
  TORCH_CHECK_VALUE(t.nbytes() > 0, "register_torch_tensor: tensor has no bytes");
  const auto ptr = reinterpret_cast<uint64_t>(t.data_ptr());
  const auto size = static_cast<int64_t>(t.nbytes());
  if (t.device().is_cpu()) {
    return Guard([&] { return Wrap(e->RegisterMemory(ptr, size, -1, MemoryLocationType::CPU)); });
  }
  return Guard([&] { return Wrap(e->RegisterMemory(ptr, size, t.device().index(), MemoryLocationType::GPU)); });
}

c10::List<StatusRef> WrapAll(const std::vector<StatusPtr>& v) {
  c10::List<StatusRef> out;
  out.reserve(v.size());
  for (const auto& s : v) out.push_back(Wrap(s));
  return out;
}

TORCH_LIBRARY(mori, m) {
  m.class_<TransferStatusObj>("TransferStatus")
      .def(torch::init<>())
      .def("Code", [](const StatusRef& self) { return static_cast<int64_t>(self->s->Code()); })
      .def("Message", [](const StatusRef& self) { return self->s->Message(); })
      .def("Init", [](const StatusRef& self) { return self->s->Init(); })
      .def("InProgress", [](const StatusRef& self) { return self->s->InProgress(); })
      .def("Succeeded", [](const StatusRef& self) { return self->s->Succeeded(); })
      .def("Failed", [](const StatusRef& self) { return self->s->Failed(); })
      .def("Update", [](const StatusRef& self, int64_t code,
                        const std::string& msg) { self->s->Update(static_cast<StatusCode>(code), msg); })
      .def("SetCode", [](const StatusRef& self, int64_t code) { self->s->SetCode(static_cast<StatusCode>(code)); })
      .def("SetMessage", [](const StatusRef& self, const std::string& msg) { self->s->SetMessage(msg); })
      .def("Wait", [](const StatusRef& self) { self->s->Wait(); })
      .def("WaitFor", [](const StatusRef& self, int64_t timeout_ms) {
        return static_cast<int64_t>(self->s->WaitFor(timeout_ms));
      });

  m.class_<EngineDescObj>("EngineDesc")
      .def("key", [](const EngineDescRef& self) { return self->d.key; })
      .def("node_id", [](const EngineDescRef& self) { return self->d.node_id; })
      .def("hostname", [](const EngineDescRef& self) { return self->d.hostname; })
      .def("host", [](const EngineDescRef& self) { return self->d.host; })
      .def("port", [](const EngineDescRef& self) { return static_cast<int64_t>(self->d.port); })
      .def("pid", [](const EngineDescRef& self) { return static_cast<int64_t>(self->d.pid); })
      .def("incarnation", [](const EngineDescRef& self) { return static_cast<int64_t>(self->d.incarnation); })
      .def("pack", [](const EngineDescRef& self) { return BytesToTensor(self->d.Pack()); })
      .def("equals", [](const EngineDescRef& self, const EngineDescRef& o) { return self->d == o->d; })
      .def_static("unpack", [](const at::Tensor& t) {
        auto b = TensorToBytes(t, "EngineDesc.unpack");
        return Guard([&] { return c10::make_intrusive<EngineDescObj>(EngineDesc::Unpack(b.data(), b.size())); });
      });

  m.class_<MemoryDescObj>("MemoryDesc")
      .def("engine_key", [](const MemoryDescRef& self) { return self->d.engine_key; })
      .def("id", [](const MemoryDescRef& self) { return static_cast<int64_t>(self->d.id); })
      .def("device_id", [](const MemoryDescRef& self) { return static_cast<int64_t>(self->d.device_id); })
      .def("device_bus_id", [](const MemoryDescRef& self) { return self->d.device_bus_id; })
      .def("data", [](const MemoryDescRef& self) { return static_cast<int64_t>(self->d.data); })
      .def("size", [](const MemoryDescRef& self) { return static_cast<int64_t>(self->d.size); })
      .def("loc", [](const MemoryDescRef& self) { return static_cast<int64_t>(self->d.loc); })
      .def("ipc_handle",
           [](const MemoryDescRef& self) {
             return BytesToTensor(std::vector<uint8_t>(self->d.ipc_handle.begin(), self->d.ipc_handle.end()));
           })
      .def("ipc_offset", [](const MemoryDescRef& self) { return static_cast<int64_t>(self->d.ipc_offset); })
      .def("numa_node", [](const MemoryDescRef& self) { return static_cast<int64_t>(self->d.numa_node); })
      .def("pack", [](const MemoryDescRef& self) { return BytesToTensor(self->d.Pack()); })
      .def("equals", [](const MemoryDescRef& self, const MemoryDescRef& o) { return self->d == o->d; })
      .def_static("unpack", [](const at::Tensor& t) {
        auto b = TensorToBytes(t, "MemoryDesc.unpack");
        return Guard([&] { return Wrap(MemoryDesc::Unpack(b.data(), b.size())); });
      });

  m.class_<SessionObj>("Session")
      .def("allocate_transfer_uid",
           [](const SessionRef& self) { return static_cast<int64_t>(self->s->AllocateTransferUid()); })
      .def("read", [](const SessionRef& self, int64_t lo, int64_t ro, int64_t size,
                      int64_t uid) { return Wrap(self->s->Read(lo, ro, size, static_cast<TransferUid>(uid))); })
      .def("write", [](const SessionRef& self, int64_t lo, int64_t ro, int64_t size,
                       int64_t uid) { return Wrap(self->s->Write(lo, ro, size, static_cast<TransferUid>(uid))); })
      .def("batch_read",
           [](const SessionRef& self, const c10::List<int64_t>& lo, const c10::List<int64_t>& ro,
              const c10::List<int64_t>& sizes, int64_t uid) {
             return Wrap(self->s->BatchRead(ToVec(lo), ToVec(ro), ToVec(sizes), static_cast<TransferUid>(uid)));
           })
      .def("batch_write",
           [](const SessionRef& self, const c10::List<int64_t>& lo, const c10::List<int64_t>& ro,
              const c10::List<int64_t>& sizes, int64_t uid) {
             return Wrap(self->s->BatchWrite(ToVec(lo), ToVec(ro), ToVec(sizes), static_cast<TransferUid>(uid)));
           })
      .def(
          "batch_read_tensors",
          [](const SessionRef& self, const at::Tensor& lo, const at::Tensor& ro, const at::Tensor& sizes, int64_t uid) {
            const auto l = ToHostInt64(lo, "local_offsets"), r = ToHostInt64(ro, "remote_offsets"),
                       n = ToHostInt64(sizes, "sizes");
            return Wrap(self->s->BatchRead(l.span(), r.span(), n.span(), static_cast<TransferUid>(uid)));
          })
      .def(
          "batch_write_tensors",
          [](const SessionRef& self, const at::Tensor& lo, const at::Tensor& ro, const at::Tensor& sizes, int64_t uid) {
            const auto l = ToHostInt64(lo, "local_offsets"), r = ToHostInt64(ro, "remote_offsets"),
                       n = ToHostInt64(sizes, "sizes");
            return Wrap(self->s->BatchWrite(l.span(), r.span(), n.span(), static_cast<TransferUid>(uid)));
          })
      .def("alive", [](const SessionRef& self) { return self->s->Alive(); })
      .def("backend_type", [](const SessionRef& self) { return static_cast<int64_t>(self->s->backend_type()); });

  m.class_<EngineObj>("Engine")
      .def(torch::init<std::string, std::string, int64_t, std::string, bool, int64_t, int64_t>(), "",
           {torch::arg("key"), torch::arg("host"), torch::arg("port"), torch::arg("secret") = std::string(),
            torch::arg("failover") = true, torch::arg("retry_attempts") = 4, torch::arg("retry_budget_ms") = 30000})
      .def("get_engine_desc", [](const EngineRef& self) { return c10::make_intrusive<EngineDescObj>(self->e->Desc()); })
      .def("create_backend",
           [](const EngineRef& self, int64_t type, const c10::Dict<std::string, int64_t>& config) {
             BackendConfig cfg;
             for (const auto& kv : config) cfg[kv.key()] = kv.value();
             Guard([&] {
               self->e->CreateBackend(static_cast<BackendType>(type), cfg);
               return 0;
             });
           })
      .def("remove_backend",
           [](const EngineRef& self, int64_t type) {
             Guard([&] {
               self->e->RemoveBackend(static_cast<BackendType>(type));
               return 0;
             });
           })
      .def("has_backend",
           [](const EngineRef& self, int64_t type) { return self->e->HasBackend(static_cast<BackendType>(type)); })
      .def("register_remote_engine",
           [](const EngineRef& self, const EngineDescRef& d) {
             Guard([&] {
               self->e->RegisterRemoteEngine(d->d);
               return 0;
             });
           })
      .def("deregister_remote_engine",
           [](const EngineRef& self, const EngineDescRef& d) {
             Guard([&] {
               self->e->DeregisterRemoteEngine(d->d);
               return 0;
             });
           })
      .def("deregister_remote_engine_because",
           [](const EngineRef& self, const EngineDescRef& d, const std::string& reason) {
             Guard([&] {
               self->e->DeregisterRemoteEngine(d->d, reason);
               return 0;
             });
           })
      .def("register_memory",
           [](const EngineRef& self, int64_t ptr, int64_t size, int64_t device_id, int64_t loc) {
             return Guard([&] {
               return Wrap(self->e->RegisterMemory(static_cast<uint64_t>(ptr), size, static_cast<int>(device_id),
                                                   static_cast<MemoryLocationType>(loc)));
             });
           })
      .def("register_tensor", [](const EngineRef& self, const at::Tensor& t) { return self->RegisterTensor(t); })
      .def("deregister_memory",
           [](const EngineRef& self, const MemoryDescRef& d) {
             Guard([&] {
               self->e->DeregisterMemory(d->d);
               return 0;
             });
           })
      .def("allocate_transfer_uid",
           [](const EngineRef& self) { return static_cast<int64_t>(self->e->AllocateTransferUid()); })
      .def("read",
           [](const EngineRef& self, const MemoryDescRef& local, int64_t lo, const MemoryDescRef& remote, int64_t ro,
              int64_t size, int64_t uid) {
             return Wrap(self->e->Read(local->d, lo, remote->d, ro, size, static_cast<TransferUid>(uid)));
           })
      .def("write",
           [](const EngineRef& self, const MemoryDescRef& local, int64_t lo, const MemoryDescRef& remote, int64_t ro,
              int64_t size, int64_t uid) {
             return Wrap(self->e->Write(local->d, lo, remote->d, ro, size, static_cast<TransferUid>(uid)));
           })
      .def("batch_read",
           [](const EngineRef& self, const c10::List<MemoryDescRef>& locals, const c10::List<c10::List<int64_t>>& lo,
              const c10::List<MemoryDescRef>& remotes, const c10::List<c10::List<int64_t>>& ro,
              const c10::List<c10::List<int64_t>>& sizes, const c10::List<int64_t>& uids) {
             const auto l = ToVecs(lo), r = ToVecs(ro), n = ToVecs(sizes);
             return WrapAll(self->e->BatchTransfer(true, DescAddresses(locals), Spans(l), DescAddresses(remotes),
                                                   Spans(r), Spans(n), ToVec(uids)));
           })
      .def("batch_write",
           [](const EngineRef& self, const c10::List<MemoryDescRef>& locals, const c10::List<c10::List<int64_t>>& lo,
              const c10::List<MemoryDescRef>& remotes, const c10::List<c10::List<int64_t>>& ro,
              const c10::List<c10::List<int64_t>>& sizes, const c10::List<int64_t>& uids) {
             const auto l = ToVecs(lo), r = ToVecs(ro), n = ToVecs(sizes);
             return WrapAll(self->e->BatchTransfer(false, DescAddresses(locals), Spans(l), DescAddresses(remotes),
                                                   Spans(r), Spans(n), ToVec(uids)));
           })
      .def("batch_transfer_tensors",
           [](const EngineRef& self, bool is_read, const c10::List<MemoryDescRef>& locals,
              const c10::List<at::Tensor>& lo, const c10::List<MemoryDescRef>& remotes, const c10::List<at::Tensor>& ro,
              const c10::List<at::Tensor>& sizes, const c10::List<int64_t>& uids) {
             std::vector<HostInt64> holders;  // alive until BatchTransfer returns
             const auto l = Spans(lo, "local_offsets[]", &holders);
             const auto r = Spans(ro, "remote_offsets[]", &holders);
             const auto n = Spans(sizes, "sizes[]", &holders);
             return WrapAll(
                 self->e->BatchTransfer(is_read, DescAddresses(locals), l, DescAddresses(remotes), r, n, ToVec(uids)));
           })
      .def("create_session",
           [](const EngineRef& self, const MemoryDescRef& local,
              const MemoryDescRef& remote) -> c10::optional<SessionRef> {
             auto s = Guard([&] { return self->e->CreateSession(local->d, remote->d); });
             if (!s) return c10::nullopt;
             return c10::make_intrusive<SessionObj>(std::move(s));
           })
      .def("pop_inbound_transfer_status",
           [](const EngineRef& self, const std::string& key, int64_t uid) -> c10::optional<StatusRef> {
             if (!self->e->PopInboundTransferStatus(key, static_cast<TransferUid>(uid))) return c10::nullopt;
             return Wrap(MakeStatus(StatusCode::SUCCESS));
           })
      .def("wait_all",
           [](const EngineRef& /*self*/, const c10::List<StatusRef>& statuses, int64_t timeout_ms) {
             std::vector<StatusPtr> v;
             v.reserve(statuses.size());
             for (const StatusRef& s : statuses) v.push_back(s->s);
             return static_cast<int64_t>(Engine::WaitAll(v, timeout_ms));
           })
      .def("shutdown", [](const EngineRef& self) { self->e->Shutdown(); })
      .def("failover_stats",
           [](const EngineRef& self) {
             const FailoverCounters f = self->e->Failover();
             c10::Dict<std::string, int64_t> d;
             d.insert("retries", static_cast<int64_t>(f.retry.retries));
             d.insert("recovered", static_cast<int64_t>(f.retry.recovered));
             d.insert("exhausted", static_cast<int64_t>(f.retry.exhausted));
             d.insert("failovers", static_cast<int64_t>(f.failover.failovers));
             d.insert("returns", static_cast<int64_t>(f.failover.returns));
             d.insert("probes", static_cast<int64_t>(f.failover.probes));
             d.insert("paths_down", static_cast<int64_t>(f.failover.paths_down));
             return d;
           })
      .def("mapped_remote_memories",
           [](const EngineRef& self) { return static_cast<int64_t>(self->e->MappedRemoteMemories()); })
      // Transfer counters as JSON (core/transfer_stats.h documents the fields;
      // mori_torch.io.IOEngine.stats() parses them into a dict).
      .def("stats_json", [](const EngineRef& self) { return self->e->StatsJson(); })
      .def_static("pinned_host_bytes", []() { return static_cast<int64_t>(gpu::PinnedBytes()); })
      .def_static("pinned_segment_list_bytes",
                  []() { return static_cast<int64_t>(gpu::PinnedBytes(gpu::PinnedUse::kSegmentLists)); })
      .def_static("flush_log", [](int64_t timeout_ms) { return FlushLog(static_cast<int>(timeout_ms)); })
      .def_static("set_log_level",
                  [](const std::string& level) {
                    Guard([&] {
                      SetLogLevel(level);
                      return 0;
                    });
                  })
      .def_static("log_level_spec", []() { return LogLevelSpec(); })
      .def_static("log_lines_dropped", []() { return static_cast<int64_t>(LogLinesDropped()); })
      .def_static("log_lines_suppressed", []() { return static_cast<int64_t>(LogLinesSuppressed()); })
      .def_static("set_trace_ranges", [](bool on) { gpu::SetTraceRanges(on); })
      .def_static("trace_ranges_enabled", []() { return gpu::TraceRangesEnabled(); })
      .def_static("trace_ranges_available", []() { return gpu::TraceRangesAvailable(); });
}

}  // namespace bind
}  // namespace mori_torch
