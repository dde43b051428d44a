#include "core/backend.h"

#include <algorithm>

namespace mori_torch {

void BackendPeer::LaunchOnStream(const LocalMemory&, const MemoryDesc&, gpu::StreamCopyArgs, gpu::Stream) {
  throw Error(StatusCode::ERR_BAD_STATE, "this backend cannot launch transfers on a GPU stream");
}

int64_t ConfigValue(const BackendConfig& config, const char* backend, const std::string& name, int64_t def,
                    int64_t min, int64_t max) {
  auto it = config.find(name);
  int64_t v = it == config.end() ? def : it->second;
  if (v < min || v > max) {
    throw Error(StatusCode::ERR_INVALID_ARGS, std::string(backend) + " config: " + name + "=" + std::to_string(v) +
                                                  " out of range [" + std::to_string(min) + ", " +
                                                  std::to_string(max) + "]");
  }
  return v;
}

void CheckConfigKeys(const BackendConfig& config, const char* backend, const std::vector<std::string>& known) {
  for (const auto& kv : config) {
    if (std::find(known.begin(), known.end(), kv.first) == known.end()) {
      throw Error(StatusCode::ERR_INVALID_ARGS, std::string(backend) + " config: unknown field '" + kv.first + "'");
    }
  }
}

}  // namespace mori_torch
