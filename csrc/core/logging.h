// Leveled logger that never blocks the thread that logs. A line is formatted
// by the caller and queued in a bounded buffer; one writer thread copies it to
// stderr (or, once routed, Python drains it into `logging`: mori_torch/log.py).
// When the reader stalls (a pipe nobody reads) the buffer fills and new lines
// are dropped and counted instead of waiting. Each MORI_LOG site is also
// rate-limited (a burst, then a few lines per second), so a peer that makes us
// log cannot make us log without bound.
//
// Each line carries its subsystem (from the source file: tcp, rdma, ctrl ...),
// the thread's name and file:line. Levels are per subsystem:
// MORI_TORCH_LOG="info,tcp=debug" (or SetLogLevel with the same text);
// MORI_TORCH_LOG_LEVEL (one level for all) is read first.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace mori_torch {

enum class LogLevel : int { Trace = 0, Debug, Info, Warning, Error, Critical, Off };

// Subsystems, by where the logging code lives: "core" (the rest of
// csrc/core), "engine", "ctrl" (control plane, peer authentication, frames),
// "loop" (event loop and worker pools), "tcp", "rdma", "xgmi" (backends),
// "stream", "gpu", "torch".
constexpr int kLogSubsystems = 10;
const char* LogSubsystemName(int subsystem);
// -1 for an unknown name.
int LogSubsystemByName(const std::string& name);

// Where a MORI_LOG site is: worked out once per site from __FILE__.
struct LogOrigin {
  explicit LogOrigin(const char* path);
  int subsystem;
  const char* file;  // the path below csrc/ (a suffix of __FILE__)
};

// The level of the "core" subsystem (mori.io's notion of one level).
LogLevel GetLogLevel();
LogLevel GetLogLevel(int subsystem);
// `spec` is a level (trace/debug/info/warning/warn/error/critical/off, any
// case) for every subsystem, and/or subsystem=level pairs, comma-separated:
// "info", "info,tcp=debug", "rdma=trace". A bare level resets every
// subsystem first; pairs then override theirs. Throws Error(ERR_INVALID_ARGS)
// naming the bad level or subsystem, changing nothing.
void SetLogLevel(const std::string& spec);
// The levels now, in SetLogLevel's form ("warning,tcp=debug").
std::string LogLevelSpec();
// Queues one line; never blocks on stderr.
void LogLine(LogLevel level, const std::string& msg);
void LogLine(LogLevel level, const LogOrigin& origin, int line, const std::string& msg);

// One queued line, for a reader that formats it itself (Python's logging).
struct LogRecord {
  LogLevel level;
  int subsystem;
  std::string thread;
  const char* file;  // static storage (__FILE__)
  int line;
  int64_t time_ms;  // since the epoch
  std::string msg;
};
// While routed, the writer thread leaves lines queued for DrainLog instead of
// writing them to stderr; unrouting writes what is left to stderr.
void RouteLogToReader(bool routed);
// Waits up to timeout_ms for lines, then takes up to max_lines of them
// (routed mode). Never blocks a thread that logs.
std::vector<LogRecord> DrainLog(size_t max_lines, int timeout_ms);
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

#define MORI_LOG(lvl, expr)                                                                                 \
  do {                                                                                                      \
    static const ::mori_torch::LogOrigin mori_log_origin_(__FILE__);                                        \
    if (static_cast<int>(::mori_torch::LogLevel::lvl) >=                                                    \
        static_cast<int>(::mori_torch::GetLogLevel(mori_log_origin_.subsystem))) {                          \
      static ::mori_torch::LogSite mori_log_site_;                                                          \
      uint64_t mori_log_suppressed_ = 0;                                                                    \
      if (mori_log_site_.Allow(&mori_log_suppressed_)) {                                                    \
        ::mori_torch::LogStream mori_log_os_;                                                               \
        mori_log_os_ << expr;                                                                               \
        if (mori_log_suppressed_) {                                                                         \
          mori_log_os_ << " [" << mori_log_suppressed_ << " similar line(s) suppressed]";                   \
        }                                                                                                   \
        ::mori_torch::LogLine(::mori_torch::LogLevel::lvl, mori_log_origin_, __LINE__, mori_log_os_.str()); \
      }                                                                                                     \
    }                                                                                                       \
  } while (0)
