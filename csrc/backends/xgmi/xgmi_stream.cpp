// XGMI's entry point for stream-ordered ops (docs/ARCHITECTURE.md,
// "Stream-ordered ops"): the transfer runs
// as one copy kernel on the caller's stream, so it orders with the work
// around it and records into CUDA graphs. The kernel reads the segment list
// at run time and checks every segment against both registrations.
#include "backends/xgmi/xgmi_backend.h"

namespace mori_torch {
namespace xgmi {

void XgmiPeer::PrepareStream(const LocalMemory& local, const MemoryDesc& remote) {
  gpu::WarmUpStreamKernels(local.desc.device_id);
  std::shared_lock<std::shared_mutex> use(use_mu_);
  (void)RemoteBase(remote, local.desc.device_id, true);
}

void XgmiPeer::LaunchOnStream(const LocalMemory& local, const MemoryDesc& remote, gpu::StreamCopyArgs args,
                              gpu::Stream stream) {
  // Mapping is cached after PrepareStream; the scope keeps a first mapping
  // from invalidating a capture in progress on this thread.
  gpu::RelaxedCaptureScope relaxed;
  XgmiBackend::SubmitScope submitting(backend_);     // entered before the check: Shutdown waits for it
  std::shared_lock<std::shared_mutex> use(use_mu_);  // held until the kernel is enqueued
  if (closed_.load() || backend_->shut_down()) {
    throw Error(StatusCode::ERR_BAD_STATE, "XGMI peer '" + remote_.key + "' is closed");
  }
  args.remote_base = RemoteBase(remote, local.desc.device_id, true);
  args.remote_size = remote.size;
  gpu::LaunchStreamCopy(args, stream);
}

}  // namespace xgmi
}  // namespace mori_torch
