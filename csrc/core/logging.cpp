#include "core/logging.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "core/types.h"

namespace mori_torch {
namespace {

bool ParseLevel(std::string s, LogLevel* out) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  static const struct { const char* name; LogLevel level; } kLevels[] = {
      {"trace", LogLevel::Trace}, {"debug", LogLevel::Debug},     {"info", LogLevel::Info},
      {"warning", LogLevel::Warning}, {"warn", LogLevel::Warning}, {"error", LogLevel::Error},
      {"critical", LogLevel::Critical}, {"off", LogLevel::Off},
  };
  for (const auto& l : kLevels) {
    if (s == l.name) {
      *out = l.level;
      return true;
    }
  }
  return false;
}

LogLevel InitialLevel() {
  LogLevel level = LogLevel::Warning;
  if (const char* env = std::getenv("MORI_TORCH_LOG_LEVEL")) ParseLevel(env, &level);
  return level;
}

std::atomic<int>& LevelStore() {
  static std::atomic<int> level{static_cast<int>(InitialLevel())};
  return level;
}

const char* LevelName(LogLevel l) {
  static const char* kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "OFF"};
  return kNames[static_cast<int>(l)];
}

}  // namespace

LogLevel GetLogLevel() { return static_cast<LogLevel>(LevelStore().load(std::memory_order_relaxed)); }

void SetLogLevel(const std::string& level) {
  LogLevel parsed;
  if (!ParseLevel(level, &parsed)) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "set_log_level: unknown level '" + level +
                    "' (expected trace, debug, info, warning, error, critical or off)");
  }
  LevelStore().store(static_cast<int>(parsed));
}

void LogLine(LogLevel level, const std::string& msg) {
  auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::system_clock::now().time_since_epoch())
                 .count();
  // One fprintf per line so lines from different threads do not interleave.
  std::fprintf(stderr, "[mori_torch %s %lld.%03lld pid=%d] %s\n", LevelName(level),
               static_cast<long long>(now / 1000), static_cast<long long>(now % 1000),
               static_cast<int>(getpid()), msg.c_str());
}

}  // namespace mori_torch
