// Leveled logger that never blocks the thread that logs. A line is formatted
// by the caller and queued in a bounded buffer; one writer thread copies it to
// stderr. When stderr stalls (a pipe nobody reads) the buffer fills and new
// lines are dropped and counted instead of waiting. Each MORI_LOG site is also
// rate-limited (a burst, then a few lines per second), so a peer that makes us
// log cannot make us log without bound. The level comes from
// MORI_TORCH_LOG_LEVEL or SetLogLevel (mori.io's set_log_level).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

namespace mori_torch {

enum class LogLevel : int { Trace = 0, Debug, Info, Warning, Error, Critical, Off };

LogLevel GetLogLevel();
// Accepts trace/debug/info/warning/warn/error/critical/off (any case);
// throws Error(ERR_INVALID_ARGS) naming the value otherwise.
void SetLogLevel(const std::string& level);
// Queues one line; never blocks on stderr.
void LogLine(LogLevel level, const std::string& msg);
// Lines lost since the process started: buffer full, or suppressed by a
// site's rate limit.
uint64_t LogLinesDropped();
uint64_t LogLinesSuppressed();
// Waits up to timeout_ms for the queued lines to reach stderr; true if they
// did (tests; also run at exit with a short bound).
bool FlushLog(int timeout_ms);

// Per call site token bucket: kBurst lines at once, then kPerSecond.
class LogSite {
 public:
  static constexpr int64_t kBurst = 20;
  static constexpr int64_t kPerSecond = 5;
  // True if this line may be written; *suppressed receives how many lines of
  // this site were suppressed since the last one written.
  bool Allow(uint64_t* suppressed);

 private:
  std::atomic<int64_t> tokens_milli_{kBurst * 1000};
  std::atomic<int64_t> last_ms_{0};
  std::atomic<uint64_t> suppressed_{0};
};

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

#define MORI_LOG(lvl, expr)                                                            \
  do {                                                                                 \
    if (static_cast<int>(::mori_torch::LogLevel::lvl) >=                               \
        static_cast<int>(::mori_torch::GetLogLevel())) {                               \
      static ::mori_torch::LogSite mori_log_site_;                                     \
      uint64_t mori_log_suppressed_ = 0;                                               \
      if (mori_log_site_.Allow(&mori_log_suppressed_)) {                               \
        ::mori_torch::LogStream mori_log_os_;                                          \
        mori_log_os_ << expr;                                                          \
        if (mori_log_suppressed_) {                                                    \
          mori_log_os_ << " [" << mori_log_suppressed_ << " similar line(s) suppressed]"; \
        }                                                                              \
        ::mori_torch::LogLine(::mori_torch::LogLevel::lvl, mori_log_os_.str());        \
      }                                                                                \
    }                                                                                  \
  } while (0)
