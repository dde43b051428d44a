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
#include <deque>
#include <mutex>
#include <thread>

#include "base/config_table.h"
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
  try {
    level = static_cast<LogLevel>(config::EnvInt("MORI_TORCH_LOG_LEVEL"));
  } catch (const Error& e) {
    // Read at the first log line, wherever that is: never throw from here.
    std::fprintf(stderr, "mori_torch: %s; logging at WARNING\n", e.what());
  }
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

  void Push(std::string line) {
    std::lock_guard<std::mutex> lk(mu_);
    EnsureWriter();
    if (q_.size() >= kMaxLines || bytes_ + line.size() > kMaxBytes) {
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    bytes_ += line.size();
    q_.push_back(std::move(line));
    ++queued_;
    cv_.notify_one();
  }

  bool Flush(int timeout_ms) {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t target = queued_;
    return done_cv_.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return written_ >= target; });
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

  void WriterLoop() {
    // A stderr whose reader went away must not kill the process with
    // SIGPIPE (a write from this thread raises it on this thread): blocked
    // here, the write fails with EPIPE and the line is lost.
    sigset_t pipe_only;
    sigemptyset(&pipe_only);
    sigaddset(&pipe_only, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_only, nullptr);
    std::deque<std::string> batch;
    while (true) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        written_ += batch.size();
        batch.clear();
        done_cv_.notify_all();
        cv_.wait(lk, [&] { return !q_.empty(); });
        batch.swap(q_);
        bytes_ = 0;
      }
      for (const auto& line : batch) {
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
  std::condition_variable cv_, done_cv_;
  std::deque<std::string> q_;
  size_t bytes_ = 0;
  uint64_t queued_ = 0, written_ = 0;
  pid_t writer_pid_ = 0;
  bool atexit_registered_ = false;
};

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

void LogLine(LogLevel level, const std::string& msg) {
  auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                 std::chrono::system_clock::now().time_since_epoch())
                 .count();
  char head[96];
  std::snprintf(head, sizeof head, "[mori_torch %s %lld.%03lld pid=%d] ", LevelName(level),
                static_cast<long long>(now / 1000), static_cast<long long>(now % 1000), static_cast<int>(getpid()));
  std::string line;
  line.reserve(sizeof head + msg.size() + 1);
  line += head;
  line += msg;
  line += '\n';
  LogSink::Get().Push(std::move(line));
}

uint64_t LogLinesDropped() { return LogSink::Get().dropped_.load(); }
uint64_t LogLinesSuppressed() { return LogSink::Get().suppressed_.load(); }
bool FlushLog(int timeout_ms) { return LogSink::Get().Flush(timeout_ms); }

}  // namespace mori_torch
