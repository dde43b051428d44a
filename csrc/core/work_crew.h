// A few helper threads that join the submitting thread's pass over a long
// list (a 16,384-entry batch's offsets read from Python lists, then
// checked): on one H100 host those passes took 60-230 us of a batch whose
// copy takes 200, all of it before the first byte may move.
//
// The caller starts on the chunks at once. Each thread takes its own
// chunks first (the same ones pass after pass: their memory stays in its
// cache; passes of over 256 chunks are taken in turn), then whatever is
// left, so a helper that wakes late costs nothing but its share. (Session
// 12 tried torch's inter-op pool, which hands each helper a fixed part and
// waits for the slowest: 24-51 ns per segment against 14-24 alone.) After
// a pass (or once woken for one, even if it ended before they got there)
// the helpers keep polling for a while, yielding the core, so the call's
// next pass and the next call find them awake; then they sleep.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mori_torch {

class WorkCrew {
 public:
  // `helpers` threads besides the callers (0: every pass runs on its
  // caller alone; fewer when the system refuses more threads); after a
  // pass they poll for `spin_us` before sleeping (longer while calls come
  // steadily: NextPollUs; 0: never poll).
  WorkCrew(int helpers, int64_t spin_us);
  ~WorkCrew();
  WorkCrew(const WorkCrew&) = delete;
  WorkCrew& operator=(const WorkCrew&) = delete;

  // The process's crew, made on first use: MORI_TORCH_SUBMIT_HELPERS
  // helpers (auto: none below 8 usable CPUs, else one per 2 beyond the first 2, at most 7),
  // MORI_TORCH_HELPER_SPIN_US. Never destroyed (its threads sleep).
  static WorkCrew& Shared();

  int helpers() const { return static_cast<int>(threads_.size()); }

  // Runs work(c) once for every c in [0, chunks), on this thread and any
  // helpers that join, and returns when all have run; the first exception a
  // chunk threw is rethrown here (the other chunks still run). One pass at a
  // time: a thread that finds the crew busy, a chunk that starts a pass of
  // its own, and a forked child (where the helpers do not exist) run every
  // chunk themselves.
  void Run(size_t chunks, const std::function<void(size_t)>& work);

  // Runs work(r, begin, end) over ranges that split [0, n) in order and
  // returns how many there were (at least 1, at most kMaxRanges): one range
  // below 4,096 entries, run here without touching the crew; else ranges of
  // at least 2,048 entries on the shared crew. For passes over a long list
  // whose ranges' results are then combined in range order.
  static constexpr size_t kMaxRanges = 32;
  static size_t ForRanges(size_t n, const std::function<void(size_t r, size_t begin, size_t end)>& work);

  // Chunks that helpers (not callers) ran since construction (tests).
  uint64_t ChunksByHelpers() const { return by_helpers_.load(std::memory_order_relaxed); }
  // Helpers asleep now (tests).
  int Sleepers() const { return sleepers_.load(); }
  // How long helpers poll after a pass now, us (tests).
  int64_t PollUs() const { return poll_us_.load(); }
  // The polling window after a pass that followed `gap_us` of idleness
  // (more than a call's passes leave between them), from the window before:
  // 1.5 gaps, at least `spin_us`, at most kMaxPollUs (unless spin_us is
  // more); `spin_us` again after a gap of more than kMaxPollUs; 0 if
  // `spin_us` is 0. A shorter gap lowers it by at most a quarter.
  static constexpr int64_t kMaxPollUs = 1000;
  static int64_t NextPollUs(int64_t poll_us, int64_t gap_us, int64_t spin_us);

 private:
  void Helper(size_t me);  // me: 1..helpers (the caller is 0)
  // Takes chunks of the open pass until none is left: participant `me`'s
  // own first.
  void TakeChunks(size_t me);
  bool Claim(size_t chunk);  // true for the one thread that gets it
  void RunChunk(size_t chunk, bool helper);
  void RunAlone(size_t chunks, const std::function<void(size_t)>& work);
  // Called at each pass's start: sets poll_us_ from the idle gap before it.
  void PaceHelpers();
  static void WaitUntil(const std::function<bool()>& ready);

  const int64_t spin_us_;
  // How long helpers poll after a pass: spin_us_, or longer while calls
  // come steadily (PaceHelpers), at most kMaxPollUs.
  std::atomic<int64_t> poll_us_;
  // When the last pass ended (the pass owner's, under pass_mu_).
  std::chrono::steady_clock::time_point last_pass_end_{};
  const int pid_;  // the process the helpers run in
  std::vector<std::thread> threads_;

  std::mutex pass_mu_;  // held by the thread whose pass is open
  // The pass: written by its caller before `ticket_` opens it.
  const std::function<void(size_t)>* work_ = nullptr;
  size_t chunks_ = 0;
  size_t parts_ = 1;             // the caller and the helpers
  std::atomic<size_t> next_{0};  // the next chunk, in passes too long for claimed_
  static constexpr size_t kClaimWords = 4;
  struct alignas(64) ClaimWord {  // apart from the counters every chunk bumps
    std::atomic<uint64_t> bits{0};
  };
  ClaimWord claimed_[kClaimWords];  // one bit per chunk
  std::atomic<size_t> done_{0};
  std::mutex error_mu_;
  std::exception_ptr error_;

  // Pass number x 2, plus 1 while it is open. A helper works on a pass
  // only after announcing itself in `active_` and seeing the same ticket
  // again; its caller closes the ticket and waits for `active_` to drain
  // before returning, so no helper touches a finished pass.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> active_{0};
  std::atomic<uint64_t> by_helpers_{0};

  std::mutex sleep_mu_;
  std::condition_variable wake_;
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace mori_torch
