// Custom-class holders shared by classes.cpp (which registers them),
// ops.cpp (whose ops take a session) and status_poll.cpp (which reads a
// status without TorchScript's method call).
#pragma once

#include <torch/custom_class.h>

#include <memory>

#include "core/session.h"
#include "core/types.h"

namespace mori_torch {
namespace bind {

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
