// torch.ops.mori.* with a tensor on a GPU: the transfer is ordered on that
// device's current stream (csrc/stream/enqueue.h does the work).
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "torch/classes.h"
#include "torch/ops_args.h"

namespace mori_torch {
namespace bind {

void RunOpOnHost(OpCall c);  // ops_cpu.cpp

namespace {

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

void RunOnStream(OpCall c) {
  const c10::Device dev = StreamDevice(c);
  c10::DeviceGuard guard(dev);
  GpuStreamDriver stream(CurrentStream(dev));
  bool capturing = false;
  try {
    capturing = stream.Capturing();
  } catch (const Error& e) {
    Rethrow(e);
  }
  // Under capture every block list must be a GPU tensor (a replay reads it),
  // for every backend, before anything is enqueued.
  for (size_t k = 0; k < 3; ++k) {
    TORCH_CHECK_VALUE(!capturing || !c.lists[k].defined() || c.lists[k].is_cuda(), c.name,
                      ": under CUDA graph capture the block lists must be GPU tensors (a graph replay reads them); ",
                      c.t.list_names[k], " is a CPU tensor");
  }
  const Session& s = *c.ss->session;
  if (s.peer()->RunsOnStream()) {
    TORCH_CHECK_VALUE(c.local.is_cuda(), c.name,
                      ": this session's backend copies between GPUs; local must be on a GPU");
    for (auto& t : c.lists) {
      if (t.defined()) t = t.to(dev);  // the copy kernel reads its lists on the device
    }
  } else if (c.local.is_cpu() && !IsRegistered(c)) {
    // A host copy of the registration (torch.compile could not reinplace):
    // host code the compiler placed after the op reads it unordered with the
    // stream, so this op completes on the host, after the stream's work.
    TORCH_CHECK_VALUE(!capturing, c.name, ": under CUDA graph capture, local must be the registered tensor itself");
    try {
      gpu::SynchronizeStream(stream.native());
    } catch (const Error& e) {
      Rethrow(e);
    }
    for (auto& t : c.lists) {
      if (t.defined()) t = t.cpu();
    }
    return RunOpOnHost(std::move(c));
  }
  PointAtLists(c);
  try {
    EnqueueOnStream(c.t, stream);
  } catch (const Error& e) {
    Rethrow(Error(e.code(), std::string(c.name) + ": " + e.what()));
  }
}

}  // namespace

#if MORI_WITH_GPU
TORCH_LIBRARY_IMPL(mori, CUDA, m) { OpImpls<RunOnStream>::Register(m); }
#endif

}  // namespace bind
}  // namespace mori_torch
