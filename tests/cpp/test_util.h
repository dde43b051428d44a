// Small helpers shared by the GoogleTest files (not a test file itself: the
// CMake glob only picks up *_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/types.h"

namespace mori_torch {
namespace testing_util {

// Runs `f` and returns the mori_torch::Error it throws; records a failure
// (and returns an empty optional) when it throws nothing or something else.
template <typename F>
std::optional<Error> CatchError(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected mori_torch::Error, got std::exception: " << e.what();
    return std::nullopt;
  } catch (...) {
    ADD_FAILURE() << "expected mori_torch::Error, got an unknown exception";
    return std::nullopt;
  }
  ADD_FAILURE() << "expected mori_torch::Error, nothing was thrown";
  return std::nullopt;
}

inline bool Contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

// Polls `pred` until it holds or `timeout_ms` passes.
inline bool PollUntil(const std::function<bool()>& pred, int timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

inline int64_t MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
}

inline void FillRandom(std::vector<uint8_t>& v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= v.size(); i += 8) {
    uint64_t x = rng();
    for (int k = 0; k < 8; ++k) v[i + k] = static_cast<uint8_t>(x >> (8 * k));
  }
  for (; i < v.size(); ++i) v[i] = static_cast<uint8_t>(rng());
}

// Sets an environment variable for one scope and restores the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = std::string(old);
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

}  // namespace testing_util
}  // namespace mori_torch
