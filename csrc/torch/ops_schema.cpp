// The schemas of torch.ops.mori.* (README "Stream-ordered ops";
// docs/ARCHITECTURE.md), and the ops that need
// no device: session handles, error checks, introspection. Implementations:
// ops_cpu.cpp (synchronous) and ops_cuda.cpp (ordered on the current stream);
// fake implementations for torch.compile live in mori_torch/ops.py.
#include <torch/library.h>

#include "stream/doorbell.h"
#include "stream/enqueue.h"
#include "stream/handle_registry.h"
#include "torch/classes.h"

namespace mori_torch {
namespace bind {
namespace {

int64_t SessionHandle(const SessionRef& s) {
  TORCH_CHECK_VALUE(s && s->s, "mori.session_handle: session is None");
  try {
    PrepareForStream(*s->s);  // work that must not happen during a graph capture; may throw
    return HandleRegistry::Instance().HandleOf(s->s);
  } catch (const Error& e) {
    Rethrow(e);
  }
}

void ReleaseSessionHandle(int64_t h) {
  TORCH_CHECK_VALUE(HandleRegistry::Instance().Release(h), "mori.release_session_handle: session handle ",
                    std::to_string(h), " is unknown or already released");
}

void CheckErrors(int64_t h) {
  try {
    auto ss = HandleRegistry::Instance().Find(h, "mori.check_errors");
    StatusCode code;
    std::string msg = ss->errors->Take(&code);
    if (code != StatusCode::SUCCESS) throw Error(code, "stream-ordered transfer: " + msg);
  } catch (const Error& e) {
    Rethrow(e);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mori, m) {
  m.set_python_module("mori_torch.ops");  // where the fake implementations live
  m.def("session_handle(__torch__.torch.classes.mori.Session session) -> int", &SessionHandle);
  m.def("release_session_handle(int session) -> ()", &ReleaseSessionHandle);
  m.def("check_errors(int session) -> ()", &CheckErrors);
  m.def("stream_flag_mechanism() -> str", [] { return gpu::StreamFlagMechanism(); });
  m.def("doorbell_slots_watched() -> int", [] { return static_cast<int64_t>(DoorbellService::Instance().Watched()); });
  m.def("doorbell_slots_captured() -> int", [] { return static_cast<int64_t>(DoorbellService::Instance().Leased()); });
  m.def("read(int session, Tensor(a!) local, int local_offset, int remote_offset, int size) -> ()");
  m.def("write(int session, Tensor local, int local_offset, int remote_offset, int size) -> ()");
  m.def("batch_read(int session, Tensor(a!) local, Tensor local_offsets, Tensor remote_offsets, Tensor sizes) -> ()");
  m.def("batch_write(int session, Tensor local, Tensor local_offsets, Tensor remote_offsets, Tensor sizes) -> ()");
  m.def("read_pages(int session, Tensor(a!) local, Tensor local_pages, Tensor remote_pages, int page_bytes) -> ()");
  m.def("write_pages(int session, Tensor local, Tensor local_pages, Tensor remote_pages, int page_bytes) -> ()");
}

}  // namespace bind
}  // namespace mori_torch
