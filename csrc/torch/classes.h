// Custom-class holders shared by classes.cpp (which registers them) and
// ops.cpp (whose ops take a session).
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

// Core errors become Python ValueError (bad arguments, unknown ids) or
// RuntimeError (bad state), with the status code name leading the message.
[[noreturn]] void Rethrow(const Error& e);

}  // namespace bind
}  // namespace mori_torch
