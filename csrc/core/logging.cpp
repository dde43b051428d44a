#include "core/logging.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <thread>

#include "base/config_table.h"
#include "core/thread_name.h"
#include "core/types.h"

namespace mori_torch {
namespace {

bool ParseLevel(std::string s, LogLevel* out) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  static const struct {
    const char* name;
    LogLevel level;
  } kLevels[] = {
      {"trace", LogLevel::Trace},       {"debug", LogLevel::Debug},  {"info", LogLevel::Info},
      {"warning", LogLevel::Warning},   {"warn", LogLevel::Warning}, {"error", LogLevel::Error},
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

constexpr const char* kSubsystems[kLogSubsystems] = {"core", "engine", "ctrl",   "loop", "tcp",
                                                     "rdma", "xgmi",   "stream", "gpu",  "torch"};

// Applies `spec` (SetLogLevel's form) to `levels`; false with *bad naming
// the offending part.
bool ParseSpec(const std::string& spec, int* levels, std::string* bad) {
  size_t pos = 0;
  while (pos <= spec.size()) {
    size_t comma = spec.find(',', pos);
    if (comma == std::string::npos) comma = spec.size();
    std::string part = spec.substr(pos, comma - pos);
    pos = comma + 1;
    part.erase(0, part.find_first_not_of(" \t"));
    part.erase(part.find_last_not_of(" \t") + 1);
    if (part.empty()) continue;
    const size_t eq = part.find('=');
    LogLevel level;
    if (!ParseLevel(eq == std::string::npos ? part : part.substr(eq + 1), &level)) {
      *bad = "unknown level '" + (eq == std::string::npos ? part : part.substr(eq + 1)) + "'";
      return false;
    }
    if (eq == std::string::npos) {
      for (int i = 0; i < kLogSubsystems; ++i) levels[i] = static_cast<int>(level);
      continue;
    }
    const int sub = LogSubsystemByName(part.substr(0, eq));
    if (sub < 0) {
      *bad = "unknown subsystem '" + part.substr(0, eq) + "'";
      return false;
    }
    levels[sub] = static_cast<int>(level);
  }
  return true;
}

struct Levels {
  std::atomic<int> by_subsystem[kLogSubsystems];
  std::string env_error;  // a bad MORI_TORCH_LOG(_LEVEL), reported once the sink runs
  Levels() {
    int v[kLogSubsystems];
    for (int& l : v) l = static_cast<int>(LogLevel::Warning);
    try {
      const int level = static_cast<int>(config::EnvInt("MORI_TORCH_LOG_LEVEL"));  // a Choice: LogLevel's order
      for (int& l : v) l = level;
    } catch (const Error& e) {
      env_error += std::string(e.what()) + "; ";
    }
    const std::string spec = config::EnvText("MORI_TORCH_LOG");
    std::string bad;
    int tmp[kLogSubsystems];
    std::copy(v, v + kLogSubsystems, tmp);
    if (!ParseSpec(spec, tmp, &bad)) {
      env_error += "MORI_TORCH_LOG='" + spec + "' ignored: " + bad + "; ";
    } else {
      std::copy(tmp, tmp + kLogSubsystems, v);
    }
    for (int i = 0; i < kLogSubsystems; ++i) by_subsystem[i].store(v[i]);
  }
};

void LogLineUnchecked(LogLevel level, const std::string& msg);

Levels& LevelStore() {
  // Never destroyed: threads may log during exit.
  static Levels* levels = [] {
    auto* l = new Levels();
    // A bad MORI_TORCH_LOG cannot throw where it is read (the first log
    // site): it is reported once, whatever the levels.
    if (!l->env_error.empty()) LogLineUnchecked(LogLevel::Warning, l->env_error);
    return l;
  }();
  return *levels;
}

const char* LevelName(LogLevel l) {
  static const char* kNames[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "OFF"};
  return kNames[static_cast<int>(l)];
}

std::string FormatLine(const LogRecord& r) {
  char head[160];
  std::snprintf(head, sizeof head, "[mori_torch %s %lld.%03lld pid=%d %s %s %s:%d] ", LevelName(r.level),
                static_cast<long long>(r.time_ms / 1000), static_cast<long long>(r.time_ms % 1000),
                static_cast<int>(getpid()), LogSubsystemName(r.subsystem), r.thread.empty() ? "-" : r.thread.c_str(),
                r.file && *r.file ? r.file : "?", r.line);
  std::string line;
  line.reserve(std::strlen(head) + r.msg.size() + 1);
  line += head;
  line += r.msg;
  line += '\n';
  return line;
}

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The queue and its writer thread. Never destroyed (a detached writer may
// still be inside write() at exit), so exit and engine shutdown never wait
// for stderr.
class LogSink {
 public:
  static constexpr size_t kMaxLines = 4096;
  static constexpr size_t kMaxBytes = 1 << 20;

  static LogSink& Get() {
    static LogSink* sink = new LogSink();
    return *sink;
  }

  void Push(LogRecord rec) {
    std::lock_guard<std::mutex> lk(mu_);
    EnsureWriter();
    const size_t size = RecordBytes(rec);
    if (q_.size() >= kMaxLines || bytes_ + size > kMaxBytes) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    bytes_ += size;
    q_.push_back(std::move(rec));
    ++queued_;
    if (routed_) {
      drain_cv_.notify_one();
    } else {
      cv_.notify_one();
    }
  }

  bool Flush(int timeout_ms) {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t target = queued_;
    return done_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return written_ >= target; });
  }

  void Route(bool routed) {
    std::lock_guard<std::mutex> lk(mu_);
    EnsureWriter();
    routed_ = routed;
    cv_.notify_all();
    drain_cv_.notify_all();
  }

  std::vector<LogRecord> Drain(size_t max_lines, int timeout_ms) {
    std::vector<LogRecord> out;
    std::unique_lock<std::mutex> lk(mu_);
    drain_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return !q_.empty() || !routed_; });
    if (!routed_) return out;
    while (!q_.empty() && out.size() < max_lines) {
      bytes_ -= RecordBytes(q_.front());
      out.push_back(std::move(q_.front()));
      q_.pop_front();
    }
    written_ += out.size();
    done_cv_.notify_all();
    return out;
  }

  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> suppressed_{0};

 private:
  // mu_ held. Also after fork(): the child has no writer thread yet.
  void EnsureWriter() {
    const pid_t pid = getpid();
    if (writer_pid_ == pid) return;
    writer_pid_ = pid;
    std::thread([this] { WriterLoop(); }).detach();
    if (!atexit_registered_) {
      atexit_registered_ = true;
      std::atexit([] { LogSink::Get().Flush(200); });
    }
  }

  static size_t RecordBytes(const LogRecord& r) { return r.msg.size() + r.thread.size() + 64; }

  void WriterLoop() {
    SetThreadName("mori-log");
    // A stderr whose reader went away must not kill the process with
    // SIGPIPE (a write from this thread raises it on this thread): blocked
    // here, the write fails with EPIPE and the line is lost.
    sigset_t pipe_only;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_only, nullptr);
    std::deque<LogRecord> batch;
    while (true) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        written_ += batch.size();
        batch.clear();
        done_cv_.notify_all();
        drain_cv_.notify_all();
        // Routed: the reader (DrainLog) takes the lines; wake it instead.
        cv_.wait(lk, [&] { return !q_.empty() && !routed_; });
        batch.swap(q_);
        bytes_ = 0;
      }
      for (const auto& rec : batch) {
        const std::string line = FormatLine(rec);
        // Only this thread ever blocks on stderr.
        size_t off = 0;
        while (off < line.size()) {
          ssize_t n = ::write(STDERR_FILENO, line.data() + off, line.size() - off);
          if (n > 0) {
            off += static_cast<size_t>(n);
          } else if (n < 0 && errno == EINTR) {
            continue;
          } else {
            break;  // stderr closed or broken: the line is lost
          }
        }
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_, done_cv_, drain_cv_;
  std::deque<LogRecord> q_;
  bool routed_ = false;
  size_t bytes_ = 0;
  uint64_t queued_ = 0, written_ = 0;
  pid_t writer_pid_ = 0;
  bool atexit_registered_ = false;
};

}  // namespace

LogOrigin::LogOrigin(const char* path) : subsystem(0), file(path) {
  const std::string p = path;
  const size_t csrc = p.rfind("csrc/");
  if (csrc != std::string::npos) file = path + csrc + 5;
  const std::string rel = file;
  // The first matching prefix names the subsystem; the rest of core is "core".
  static const struct {
    const char* prefix;
    const char* subsystem;
  } kMap[] = {
      {"backends/tcp/", "tcp"},
      {"backends/rdma/", "rdma"},
      {"backends/xgmi/", "xgmi"},
      {"stream/", "stream"},
      {"gpu/", "gpu"},
      {"torch/", "torch"},
      {"core/engine", "engine"},
      {"core/session", "engine"},
      {"core/control_plane", "ctrl"},
      {"core/peer_auth", "ctrl"},
      {"core/connection_limits", "ctrl"},
      {"core/frame", "ctrl"},
      {"core/event_loop", "loop"},
  };
  for (const auto& m : kMap) {
    if (rel.rfind(m.prefix, 0) == 0) {
      subsystem = LogSubsystemByName(m.subsystem);
      return;
    }
  }
}

const char* LogSubsystemName(int subsystem) {
  return subsystem >= 0 && subsystem < kLogSubsystems ? kSubsystems[subsystem] : "?";
}

int LogSubsystemByName(const std::string& name) {
  for (int i = 0; i < kLogSubsystems; ++i) {
    if (name == kSubsystems[i]) return i;
  }
  return -1;
}

LogLevel GetLogLevel() { return GetLogLevel(0); }

LogLevel GetLogLevel(int subsystem) {
  return static_cast<LogLevel>(LevelStore().by_subsystem[subsystem].load(std::memory_order_relaxed));
}

void SetLogLevel(const std::string& spec) {
  int levels[kLogSubsystems];
  for (int i = 0; i < kLogSubsystems; ++i) levels[i] = LevelStore().by_subsystem[i].load();
  std::string bad;
  if (!ParseSpec(spec, levels, &bad)) {
    std::string names;
    for (const char* n : kSubsystems) names += std::string(names.empty() ? "" : ", ") + n;
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "set_log_level: " + bad + " in '" + spec +
                    "' (expected a level: trace, debug, info, warning, error, critical or off, and/or "
                    "subsystem=level pairs, comma-separated; subsystems: " +
                    names + ")");
  }
  for (int i = 0; i < kLogSubsystems; ++i) LevelStore().by_subsystem[i].store(levels[i]);
}

std::string LogLevelSpec() {
  // The most common level first, then the subsystems that differ.
  int count[static_cast<int>(LogLevel::Off) + 1] = {};
  for (int i = 0; i < kLogSubsystems; ++i) ++count[LevelStore().by_subsystem[i].load()];
  const int common = static_cast<int>(std::max_element(std::begin(count), std::end(count)) - std::begin(count));
  std::string spec = LevelName(static_cast<LogLevel>(common));
  for (int i = 0; i < kLogSubsystems; ++i) {
    const int l = LevelStore().by_subsystem[i].load();
    if (l != common) spec += std::string(",") + kSubsystems[i] + "=" + LevelName(static_cast<LogLevel>(l));
  }
  std::transform(spec.begin(), spec.end(), spec.begin(), [](unsigned char c) { return std::tolower(c); });
  return spec;
}

bool LogSite::Allow(uint64_t* suppressed) {
  // Refill kPerSecond tokens per second, up to kBurst (in thousandths, so a
  // refill of a few milliseconds counts). Races between threads only blur
  // the rate a little.
  const int64_t now = NowMs();
  const int64_t last = last_ms_.exchange(now, std::memory_order_relaxed);
  int64_t tokens = tokens_milli_.load(std::memory_order_relaxed);
  if (last != 0 && now > last) tokens = std::min(kBurst * 1000, tokens + (now - last) * kPerSecond);
  if (tokens < 1000) {
    tokens_milli_.store(tokens, std::memory_order_relaxed);
    suppressed_.fetch_add(1, std::memory_order_relaxed);
    LogSink::Get().suppressed_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  tokens_milli_.store(tokens - 1000, std::memory_order_relaxed);
  *suppressed = suppressed_.exchange(0, std::memory_order_relaxed);
  return true;
}

namespace {
void LogLineUnchecked(LogLevel level, const std::string& msg) {
  static const LogOrigin unknown("");
  LogLine(level, unknown, 0, msg);
}
}  // namespace

void LogLine(LogLevel level, const std::string& msg) { LogLineUnchecked(level, msg); }

void LogLine(LogLevel level, const LogOrigin& origin, int line, const std::string& msg) {
  LogRecord r;
  r.level = level;
  r.subsystem = origin.subsystem;
  r.thread = ThisThreadName();
  r.file = origin.file;
  r.line = line;
  r.time_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
                  .count();
  r.msg = msg;
  LogSink::Get().Push(std::move(r));
}

void RouteLogToReader(bool routed) { LogSink::Get().Route(routed); }
std::vector<LogRecord> DrainLog(size_t max_lines, int timeout_ms) {
  return LogSink::Get().Drain(max_lines, timeout_ms);
}

uint64_t LogLinesDropped() { return LogSink::Get().dropped_.load(); }
uint64_t LogLinesSuppressed() { return LogSink::Get().suppressed_.load(); }
bool FlushLog(int timeout_ms) { return LogSink::Get().Flush(timeout_ms); }

}  // namespace mori_torch
