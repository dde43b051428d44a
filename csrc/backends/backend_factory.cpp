// The one place that knows every backend: maps a BackendType to its
// implementation, so the core engine stays free of backend headers.
#include "backends/rdma/rdma_backend.h"
#include "backends/tcp/tcp_backend.h"
#include "backends/xgmi/xgmi_backend.h"
#include "backends/xgmi/xgmi_ownership.h"
#include "core/backend.h"

namespace mori_torch {

std::shared_ptr<Backend> MakeBackend(BackendType type, const BackendConfig& config, const BackendContext& ctx) {
  switch (type) {
    case BackendType::TCP:
      return std::make_shared<tcp::TcpBackend>(tcp::TcpConfig::FromMap(config), ctx);
    case BackendType::XGMI:
      return std::make_shared<xgmi::XgmiBackend>(xgmi::XgmiConfig::FromMap(config), ctx);
    case BackendType::RDMA:
      return std::make_shared<rdma::RdmaBackend>(rdma::RdmaConfig::FromMap(config), ctx);
    default:
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "create_backend: unknown backend type " + std::to_string(static_cast<int>(type)));
  }
}

std::vector<std::shared_ptr<EngineService>> MakeEngineServices(const BackendContext& ctx) {
  return {std::make_shared<xgmi::MemoryOwnership>(ctx)};
}

}  // namespace mori_torch
