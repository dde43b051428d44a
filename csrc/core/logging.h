// Minimal leveled logger writing to stderr. The level comes from
// MORI_TORCH_LOG_LEVEL or SetLogLevel (mori.io's set_log_level).
#pragma once

#include <string>
#include <type_traits>

namespace mori_torch {

enum class LogLevel : int { Trace = 0, Debug, Info, Warning, Error, Critical, Off };

LogLevel GetLogLevel();
// Accepts trace/debug/info/warning/warn/error/critical/off (any case);
// throws Error(ERR_INVALID_ARGS) naming the value otherwise.
void SetLogLevel(const std::string& level);
void LogLine(LogLevel level, const std::string& msg);

// Builds a log line without iostreams: number formatting through std::locale
// facets crashed inside a host process that had loaded a different
// libstdc++ than the one we were built with (seen on the GPU machine).
class LogStream {
 public:
  LogStream& operator<<(const std::string& v) {
    s_ += v;
    return *this;
  }
  LogStream& operator<<(const char* v) {
    s_ += v ? v : "(null)";
    return *this;
  }
  LogStream& operator<<(char v) {
    s_ += v;
    return *this;
  }
  template <typename T, typename std::enable_if<std::is_arithmetic<T>::value, int>::type = 0>
  LogStream& operator<<(T v) {
    s_ += std::to_string(v);
    return *this;
  }
  const std::string& str() const { return s_; }

 private:
  std::string s_;
};

}  // namespace mori_torch

#define MORI_LOG(lvl, expr)                                                   \
  do {                                                                        \
    if (static_cast<int>(::mori_torch::LogLevel::lvl) >=                      \
        static_cast<int>(::mori_torch::GetLogLevel())) {                      \
      ::mori_torch::LogStream mori_log_os_;                                   \
      mori_log_os_ << expr;                                                   \
      ::mori_torch::LogLine(::mori_torch::LogLevel::lvl, mori_log_os_.str()); \
    }                                                                         \
  } while (0)
