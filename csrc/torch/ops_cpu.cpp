// torch.ops.mori.* with every tensor on the CPU: a synchronous transfer
// through the engine; errors raise.
#include "torch/classes.h"
#include "torch/ops_args.h"

namespace mori_torch {
namespace bind {
namespace {

void RunNow(OpCall c) {
  PointAtLists(c);
  try {
    RunOnHost(c.t);
  } catch (const Error& e) {
    Rethrow(Error(e.code(), std::string(c.name) + ": " + e.what()));
  }
}

}  // namespace

void RunOpOnHost(OpCall c) { RunNow(std::move(c)); }

TORCH_LIBRARY_IMPL(mori, CPU, m) { OpImpls<RunNow>::Register(m); }

}  // namespace bind
}  // namespace mori_torch
