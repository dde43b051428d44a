#include "core/work_crew.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "base/config_table.h"
#include "core/cpu.h"
#include "core/thread_name.h"

namespace mori_torch {
namespace {

int SharedHelpers() {
  const int64_t v = config::EnvInt("MORI_TORCH_SUBMIT_HELPERS");
  if (v >= 0) return static_cast<int>(v);
  // Auto: none below 8 usable CPUs (the serving process and the engine's
  // own threads need them); else one per 2 CPUs beyond the first 2, at most
  // 7: a 16,384-entry batch's checks are 8 ranges, so 8 threads take one
  // each. On the 16-core H100 VM, 7 helpers against 3, processes taking
  // turns, moved 16,384 x 16 KiB pages from lists between two processes
  // from 0.73-0.75 of copy_ to 0.75-0.77 and 4 KiB pages from 0.45-0.49 to
  // 0.50-0.57.
  constexpr int kMaxAuto = 7;
  const int cpus = UsableCpus();
  return cpus < 8 ? 0 : std::min((cpus - 2) / 2, kMaxAuto);
}

bool IsOpen(uint64_t ticket) { return (ticket & 1) != 0; }

// Set while this thread runs a pass's chunks: a chunk that runs a pass of
// its own runs it alone (the crew is busy with the outer one).
thread_local bool t_in_pass = false;

struct InPass {
  InPass() { t_in_pass = true; }
  ~InPass() { t_in_pass = false; }
};

}  // namespace

WorkCrew::WorkCrew(int helpers, int64_t spin_us)
    : spin_us_(std::max<int64_t>(0, spin_us)), poll_us_(spin_us_), pid_(::getpid()) {
  try {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this, i] { Helper(static_cast<size_t>(i) + 1); });
  } catch (...) {
    // No more threads to be had (a container's limit, memory): the crew
    // works with those it got, as a pass runs on its caller if need be.
  }
  parts_ = threads_.size() + 1;
}

WorkCrew::~WorkCrew() {
  {
    std::lock_guard<std::mutex> lk(sleep_mu_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

WorkCrew& WorkCrew::Shared() {
  static WorkCrew* const crew =
      new WorkCrew(SharedHelpers(), config::EnvInt("MORI_TORCH_HELPER_SPIN_US"));  // never destroyed
  return *crew;
}

size_t WorkCrew::ForRanges(size_t n, const std::function<void(size_t r, size_t begin, size_t end)>& work) {
  constexpr size_t kCrewFrom = 4096, kMinRange = 2048;
  if (n < kCrewFrom) {
    work(0, 0, n);
    return 1;
  }
  const size_t per = std::max(kMinRange, (n + kMaxRanges - 1) / kMaxRanges);
  const size_t ranges = (n + per - 1) / per;
  Shared().Run(ranges, [&](size_t r) { work(r, r * per, std::min(n, (r + 1) * per)); });
  return ranges;
}

void WorkCrew::RunAlone(size_t chunks, const std::function<void(size_t)>& work) {
  std::exception_ptr first;
  for (size_t c = 0; c < chunks; ++c) {
    try {
      work(c);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void WorkCrew::Run(size_t chunks, const std::function<void(size_t)>& work) {
  if (threads_.empty() || chunks <= 1 || t_in_pass || ::getpid() != pid_) return RunAlone(chunks, work);
  std::unique_lock<std::mutex> pass(pass_mu_, std::try_to_lock);
  if (!pass.owns_lock()) return RunAlone(chunks, work);
  InPass in_pass;
  PaceHelpers();

  work_ = &work;
  chunks_ = chunks;
  next_.store(0);
  for (size_t w = 0; w < (chunks + 63) / 64 && w < kClaimWords; ++w) claimed_[w].bits.store(0);
  done_.store(0);
  error_ = nullptr;
  const uint64_t open = ticket_.load() + 3;  // the next pass, open (no pass is open now)
  ticket_.store(open);
  // A helper about to sleep either sees the open ticket or is counted here
  // (both are sequentially consistent), and it checks under sleep_mu_.
  if (sleepers_.load() > 0) {
    { std::lock_guard<std::mutex> lk(sleep_mu_); }
    wake_.notify_all();
  }
  TakeChunks(0);
  // Chunks that helpers took may still run; a helper the scheduler took
  // the core from (a busy machine) is given the core back soon.
  WaitUntil([&] { return done_.load() >= chunks; });
  ticket_.store(open - 1);
  WaitUntil([&] { return active_.load() == 0; });
  work_ = nullptr;
  last_pass_end_ = std::chrono::steady_clock::now();
  if (error_) std::rethrow_exception(error_);
}

int64_t WorkCrew::NextPollUs(int64_t poll_us, int64_t gap_us, int64_t spin_us) {
  if (spin_us == 0) return 0;               // helpers that never poll stay so
  if (gap_us > kMaxPollUs) return spin_us;  // calls far apart: the configured window
  const int64_t want = std::clamp(gap_us * 3 / 2, spin_us, std::max(spin_us, kMaxPollUs));
  // A shorter gap (a pass late within a call) lowers the window by a
  // quarter only, so one such gap does not leave the next call's first
  // pass to sleeping helpers.
  return std::max(want, poll_us * 3 / 4);
}

void WorkCrew::PaceHelpers() {
  // A call's passes follow each other within microseconds; a longer idle
  // gap comes between calls. The helpers poll through 1.5 such gaps (at
  // most kMaxPollUs), so that one batch at a time (submit, wait, submit)
  // finds them awake: a first pass that finds them asleep runs at one
  // thread's speed plus the cost of waking them.
  constexpr auto kCallGap = std::chrono::microseconds(50);
  const auto now = std::chrono::steady_clock::now();
  if (last_pass_end_ == std::chrono::steady_clock::time_point{} || now - last_pass_end_ < kCallGap) return;
  const int64_t gap = std::chrono::duration_cast<std::chrono::microseconds>(now - last_pass_end_).count();
  poll_us_.store(NextPollUs(poll_us_.load(std::memory_order_relaxed), gap, spin_us_), std::memory_order_relaxed);
}

void WorkCrew::WaitUntil(const std::function<bool()>& ready) {
  // A chunk takes microseconds: spin that long, then yield the core.
  constexpr int kSpins = 2000;
  for (int i = 0; !ready(); ++i) {
    if (i < kSpins) {
      CpuRelax();
    } else {
      ::sched_yield();
    }
  }
}

void WorkCrew::RunChunk(size_t c, bool helper) {
  try {
    (*work_)(c);
  } catch (...) {
    std::lock_guard<std::mutex> lk(error_mu_);
    if (!error_) error_ = std::current_exception();
  }
  if (helper) by_helpers_.fetch_add(1, std::memory_order_relaxed);
  done_.fetch_add(1);
}

bool WorkCrew::Claim(size_t c) {
  const uint64_t bit = uint64_t{1} << (c % 64);
  std::atomic<uint64_t>& word = claimed_[c / 64].bits;
  return (word.load(std::memory_order_relaxed) & bit) == 0 && (word.fetch_or(bit) & bit) == 0;
}

void WorkCrew::TakeChunks(size_t me) {
  const size_t chunks = chunks_;
  const bool helper = me != 0;
  if (chunks > kClaimWords * 64) {
    for (size_t c = next_.fetch_add(1); c < chunks; c = next_.fetch_add(1)) RunChunk(c, helper);
    return;
  }
  // Its own chunks first (me, me + parts, ...), then any left (those of a
  // helper not awake yet). A pass over the same number of chunks thus
  // gives each range to the same thread as the pass before, whose cache
  // holds that range's memory: a batch's checks write its segments, the
  // next pass reads them, and the next batch reuses both buffers. On the
  // 16-core GPU machine, this crew (3 helpers, awake) copied 384 KiB in 8
  // chunks in 4.5 us, against 9.0 with chunks taken in turn (alone: 9.8).
  // Passes of more than kClaimWords x 64 chunks take them in turn.
  for (size_t c = me; c < chunks; c += parts_) {
    if (Claim(c)) RunChunk(c, helper);
  }
  for (size_t c = 0; c < chunks; ++c) {
    if (Claim(c)) RunChunk(c, helper);
  }
}

void WorkCrew::Helper(size_t me) {
  SetThreadName("mori-crew");
  using Clock = std::chrono::steady_clock;
  uint64_t last = 0;  // the last ticket this helper looked at
  auto polling_until = Clock::now();
  while (!stop_.load()) {
    const uint64_t t = ticket_.load();
    if (IsOpen(t) && t != last) {
      last = t;
      active_.fetch_add(1);
      if (ticket_.load() == t) TakeChunks(me);
      active_.fetch_sub(1);
      polling_until = Clock::now() + std::chrono::microseconds(poll_us_.load(std::memory_order_relaxed));
      continue;
    }
    if (Clock::now() < polling_until) {
      ::sched_yield();  // polling, but the core stays free for others
      continue;
    }
    std::unique_lock<std::mutex> lk(sleep_mu_);
    sleepers_.fetch_add(1);
    // Any pass opened since `t` wakes it, even one that has ended by the
    // time this thread runs (a sleeping core can take longer to wake than a
    // 16,384-entry pass takes): it then polls, so that the same call's next
    // passes find it awake.
    wake_.wait(lk, [&] { return stop_.load() || ticket_.load() != t; });
    sleepers_.fetch_sub(1);
    polling_until = Clock::now() + std::chrono::microseconds(poll_us_.load(std::memory_order_relaxed));
  }
}

}  // namespace mori_torch
