// Two TCP engines in this process on loopback and a session between a local
// and a remote host buffer of `bytes` each (the remote filled with random
// bytes): what the stream-ordering tests transfer through.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/engine.h"
#include "test_util.h"

namespace mori_torch {
namespace testing_util {

struct TcpSessionPair {
  TcpSessionPair(const std::string& prefix, size_t bytes, uint64_t seed) {
    a = std::make_unique<Engine>(prefix + "A", EngineConfig{"127.0.0.1", 0});
    b = std::make_unique<Engine>(prefix + "B", EngineConfig{"127.0.0.1", 0});
    a->CreateBackend(BackendType::TCP, {});
    b->CreateBackend(BackendType::TCP, {});
    a->RegisterRemoteEngine(b->Desc());
    b->RegisterRemoteEngine(a->Desc());
    local.assign(bytes, 0);
    remote.resize(bytes);
    FillRandom(remote, seed);
    auto lm = a->RegisterMemory(reinterpret_cast<uint64_t>(local.data()), static_cast<int64_t>(bytes), -1,
                                MemoryLocationType::CPU);
    auto rm = b->RegisterMemory(reinterpret_cast<uint64_t>(remote.data()), static_cast<int64_t>(bytes), -1,
                                MemoryLocationType::CPU);
    session = a->CreateSession(lm, rm);
  }
  ~TcpSessionPair() {
    session.reset();
    a->Shutdown();
    b->Shutdown();
  }

  std::unique_ptr<Engine> a, b;
  std::vector<uint8_t> local, remote;
  std::shared_ptr<Session> session;
};

}  // namespace testing_util
}  // namespace mori_torch
