// RDMA backend bandwidth in the Soft-RoCE VM (benchmarks/rdma_vm_bench.py
// runs it there next to perftest on the same device). Initiator here, target
// in a child process; one JSON line per case on stdout:
//   {"op": "write", "segment_bytes": 65536, "segments": 1, "iters": ..., "mb_per_s": ..., "verified": true}
// Usage: mori_rdma_bench [--iters-scale X]   (X scales every case's iterations)
#include <signal.h>
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "core/engine.h"
#include "rdma_vm_peer.h"

using namespace mori_torch;
using rdma_test::FillPattern;
using rdma_test::HashBytes;
using rdma_test::PeerProcess;

namespace {

constexpr uint64_t kBuf = 64ull << 20;
constexpr size_t kWindow = 128;  // transfers in flight: perftest's default tx depth

struct Case {
  bool read;
  uint64_t seg;
  size_t segments;
  size_t iters;
};

double RunCase(Session& s, PeerProcess& peer, uint8_t* local, const Case& c, bool* verified) {
  const uint64_t per = c.seg * c.segments;
  const size_t slots = kBuf / (c.segments > 1 ? per * 2 : per);
  std::vector<int64_t> lo, ro, sz;
  for (size_t i = 0; i < c.segments; ++i) {  // every other remote slot: nothing merges
    lo.push_back(static_cast<int64_t>(i * c.seg));
    ro.push_back(static_cast<int64_t>(i * c.seg * (c.segments > 1 ? 2 : 1)));
    sz.push_back(static_cast<int64_t>(c.seg));
  }
  std::deque<StatusPtr> inflight;
  bool ok = true;
  auto wait_one = [&] {
    ok = inflight.front()->WaitFor(120000) == StatusCode::SUCCESS && ok;
    if (!ok) std::fprintf(stderr, "transfer failed: %s\n", inflight.front()->Message().c_str());
    inflight.pop_front();
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < c.iters; ++i) {
    if (inflight.size() >= kWindow) wait_one();
    const int64_t base = static_cast<int64_t>((i % slots) * (c.segments > 1 ? per * 2 : per));
    StatusPtr st;
    if (c.segments == 1) {
      st = c.read ? s.Read(base, base, static_cast<int64_t>(c.seg), i) : s.Write(base, base, static_cast<int64_t>(c.seg), i);
    } else {
      std::vector<int64_t> r(ro);
      for (auto& x : r) x += base;
      st = c.read ? s.BatchRead(lo, r, sz, i) : s.BatchWrite(lo, r, sz, i);
    }
    inflight.push_back(std::move(st));
  }
  while (!inflight.empty()) wait_one();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Verify one transfer's bytes end to end.
  if (ok) {
    if (c.read) {
      peer.Command("fill 77");
      std::vector<uint8_t> want(c.seg);
      FillPattern(want.data(), 4096, c.seg, 77);
      ok = s.Read(0, 4096, static_cast<int64_t>(c.seg), 0)->WaitFor(60000) == StatusCode::SUCCESS &&
           HashBytes(local, c.seg) == HashBytes(want.data(), c.seg);
    } else {
      FillPattern(local, 0, c.seg, 78);
      ok = s.Write(0, 4096, static_cast<int64_t>(c.seg), 0)->WaitFor(60000) == StatusCode::SUCCESS &&
           peer.Hash(4096, c.seg) == HashBytes(local, c.seg);
    }
  }
  *verified = ok;
  return static_cast<double>(per) * static_cast<double>(c.iters) / secs / 1e6;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  if (argc > 1 && std::string(argv[1]) == "--peer") return rdma_test::RunPeer(argc, argv);
  double scale = 1.0;
  if (argc > 2 && std::string(argv[1]) == "--iters-scale") scale = std::stod(argv[2]);
  auto* local = static_cast<uint8_t*>(mmap(nullptr, kBuf, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  std::memset(local, 1, kBuf);
  const Case cases[] = {
      {false, 1 << 20, 1, 300}, {true, 1 << 20, 1, 300},   {false, 64 << 10, 1, 3000},
      {true, 64 << 10, 1, 3000}, {false, 4096, 1024, 60}, {true, 4096, 1024, 60},
  };
  // Notices off first (perftest sends none either: the like-for-like
  // comparison), then on (the default, what their cost is); one QP, as
  // perftest's default.
  for (int notify = 0; notify <= 1; ++notify) {
    const std::string cfg = "qp_per_transfer=1,enable_notification=" + std::to_string(notify);
    PeerProcess peer(notify ? "rdma-bench-target-notices" : "rdma-bench-target", kBuf, cfg);
    EngineConfig ec;
    ec.host = rdma_test::TestHost();
    Engine engine(notify ? "rdma-bench-init-notices" : "rdma-bench-init", ec);
    engine.CreateBackend(BackendType::RDMA, {{"qp_per_transfer", 1}, {"enable_notification", notify}});
    engine.RegisterRemoteEngine(peer.engine());
    MemoryDesc ld = engine.RegisterMemory(reinterpret_cast<uint64_t>(local), kBuf, -1, MemoryLocationType::CPU);
    auto sess = engine.CreateSession(ld, peer.memory());
    bool warm;
    RunCase(*sess, peer, local, {false, 1 << 20, 1, 20}, &warm);  // connect, register, fault in
    for (const Case& c0 : cases) {
      Case c = c0;
      c.iters = std::max<size_t>(1, static_cast<size_t>(c.iters * scale));
      bool verified = false;
      const double mbps = RunCase(*sess, peer, local, c, &verified);
      std::printf("{\"op\": \"%s\", \"segment_bytes\": %llu, \"segments\": %zu, \"iters\": %zu, "
                  "\"mb_per_s\": %.1f, \"notifications\": %s, \"verified\": %s}\n",
                  c.read ? "read" : "write", static_cast<unsigned long long>(c.seg), c.segments, c.iters, mbps,
                  notify ? "true" : "false", verified ? "true" : "false");
      std::fflush(stdout);
    }
    engine.Shutdown();
  }
  return 0;
}
