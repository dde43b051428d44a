// Minimal leveled logger writing to stderr. The level comes from
// MORI_TORCH_LOG_LEVEL or SetLogLevel (mori.io's set_log_level).
#pragma once

#include <sstream>
#include <string>

namespace mori_torch {

enum class LogLevel : int { Trace = 0, Debug, Info, Warning, Error, Critical, Off };

LogLevel GetLogLevel();
// Accepts trace/debug/info/warning/warn/error/critical/off (any case);
// throws Error(ERR_INVALID_ARGS) naming the value otherwise.
void SetLogLevel(const std::string& level);
void LogLine(LogLevel level, const std::string& msg);

}  // namespace mori_torch

#define MORI_LOG(lvl, expr)                                                   \
  do {                                                                        \
    if (static_cast<int>(::mori_torch::LogLevel::lvl) >=                      \
        static_cast<int>(::mori_torch::GetLogLevel())) {                      \
      std::ostringstream mori_log_os_;                                        \
      mori_log_os_ << expr;                                                   \
      ::mori_torch::LogLine(::mori_torch::LogLevel::lvl, mori_log_os_.str()); \
    }                                                                         \
  } while (0)
