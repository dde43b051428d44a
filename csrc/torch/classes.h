// Custom-class holders shared by classes.cpp (which registers them),
// ops.cpp (whose ops take a session) and fast_calls.cpp (which reads a
// status, allocates a uid or submits an engine-level batch without
// TorchScript's method call).
#pragma once

#include <torch/custom_class.h>

#include <memory>

#include "core/engine.h"
#include "core/session.h"
#include "core/types.h"

namespace mori_torch {
namespace bind {

struct MemoryDescObj : torch::CustomClassHolder {
  MemoryDesc d;
  explicit MemoryDescObj(MemoryDesc x) : d(std::move(x)) {}
};
using MemoryDescRef = c10::intrusive_ptr<MemoryDescObj>;

struct EngineObj : torch::CustomClassHolder {
  std::shared_ptr<Engine> e;
  EngineObj(const std::string& key, const std::string& host, int64_t port, const std::string& secret, bool failover,
            int64_t retry_attempts, int64_t retry_budget_ms);
  ~EngineObj() override;
  MemoryDescRef RegisterTensor(const at::Tensor& t);
};
using EngineRef = c10::intrusive_ptr<EngineObj>;

struct SessionObj : torch::CustomClassHolder {
  std::shared_ptr<Session> s;
  explicit SessionObj(std::shared_ptr<Session> x) : s(std::move(x)) {}
};
using SessionRef = c10::intrusive_ptr<SessionObj>;

struct TransferStatusObj : torch::CustomClassHolder {
  StatusPtr s;
  TransferStatusObj() : s(std::make_shared<TransferStatus>()) {}
  explicit TransferStatusObj(StatusPtr p) : s(std::move(p)) {}
};
using StatusRef = c10::intrusive_ptr<TransferStatusObj>;

// Core errors become Python ValueError (bad arguments, unknown ids) or
// RuntimeError (bad state), with the status code name leading the message.
[[noreturn]] void Rethrow(const Error& e);

}  // namespace bind
}  // namespace mori_torch
