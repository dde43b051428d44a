#include "torch/ops_args.h"

#include "torch/classes.h"

namespace mori_torch {
namespace bind {
namespace {

std::string Num(int64_t v) { return std::to_string(v); }

void CheckList(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, op, ": ", name, " must be an int64 tensor, got ",
                   c10::toString(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got ", Num(t.dim()), " dimensions");
}

// `local` is the session's local registration or a tensor of its size and
// device: torch.compile (when it cannot reinplace) and opcheck hand the op a
// copy. Kernels then move bytes into the copy directly; host paths stage the
// segments through the registered memory.
void CheckLocal(const OpCall& c) {
  const MemoryDesc& d = c.ss->session->local()->desc;
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

OpCall Parse(const char* name, bool is_read, int64_t handle, const at::Tensor& local) {
  OpCall c{name, nullptr, local, {}, {}};
  try {
    c.ss = HandleRegistry::Instance().Find(handle, name);
  } catch (const Error& e) {
    Rethrow(e);
  }
  CheckLocal(c);
  c.t.session = c.ss->session;
  c.t.errors = c.ss->errors;
  c.t.is_read = is_read;
  c.t.local_base = reinterpret_cast<uint64_t>(local.data_ptr());
  c.t.local_size = static_cast<uint64_t>(local.nbytes());
  c.t.local_on_device = !local.is_cpu();
  c.t.segs.is_read = is_read;
  return c;
}

}  // namespace

OpCall ParseSingle(const char* name, bool is_read, int64_t handle, const at::Tensor& local, int64_t lo, int64_t ro,
                   int64_t size) {
  OpCall c = Parse(name, is_read, handle, local);
  c.t.segs.local_offset = lo;
  c.t.segs.remote_offset = ro;
  c.t.segs.uniform_size = size;
  c.t.segs.count = 1;
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
  c.t.segs.count = n;
  c.t.segs.size_stride = sizes.numel() == 1 ? 0 : 1;
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
  c.t.list_names = {{"local_pages", "remote_pages", ""}};
  c.t.segs.count = lp.numel();
  c.t.segs.offset_scale = page_bytes;
  c.t.segs.uniform_size = page_bytes;
  return c;
}

void PointAtLists(OpCall& c) {
  for (size_t k = 0; k < 3; ++k) {
    if (!c.lists[k].defined()) continue;
    c.lists[k] = c.lists[k].contiguous();
    c.t.lists[k] = c.lists[k].data_ptr<int64_t>();
    c.t.list_on_device[k] = !c.lists[k].is_cpu();
  }
}

bool IsRegistered(const OpCall& c) { return c.t.local_base == c.ss->session->local()->desc.data; }

}  // namespace bind
}  // namespace mori_torch
