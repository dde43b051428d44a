// What the transfer counters add to one transfer's life on the host, in ns:
// the status lifecycle a backend sees (MakeStatus, SetRecord, Update to
// SUCCESS) with the counters' part (Start, clock reads, End) and without
// it (the baseline, same run), by 1 thread and by 4 threads counting on the
// same (peer, backend) pair (the contended case). Prints one JSON object.
//
//   build/cmake/mori_stats_bench [transfers per thread]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "core/transfer_stats.h"
#include "core/transfer_status.h"

using namespace mori_torch;

namespace {

// ns per transfer, `threads` threads doing `n` each.
double Run(int threads, int n, bool counted) {
  auto counters = std::make_shared<TransferCounters>();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < n; ++i) {
        auto st = MakeStatus();
        if (counted) {
          counters->Start(false);
          st->SetRecord(TransferRecord{counters, false, 4096, StatsNowNs(), 0});
        }
        st->Update(StatusCode::SUCCESS);
      }
    });
  }
  for (auto& t : ts) t.join();
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  if (counted && counters->Snapshot().succeeded != static_cast<uint64_t>(threads) * n) std::abort();
  return ns / n;  // per transfer of one thread (threads run side by side)
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 200000;
  std::printf("{");
  for (int threads : {1, 4}) {
    std::vector<double> on, off;
    for (int rep = 0; rep < 7; ++rep) {  // alternated, medians
      off.push_back(Run(threads, n, false));
      on.push_back(Run(threads, n, true));
    }
    const double a = Median(on), b = Median(off);
    std::printf("%s\"threads_%d\": {\"status_with_counters_ns\": %.1f, \"status_alone_ns\": %.1f, "
                "\"counters_add_ns\": %.1f}",
                threads == 1 ? "" : ", ", threads, a, b, a - b);
  }
  std::printf("}\n");
  return 0;
}
