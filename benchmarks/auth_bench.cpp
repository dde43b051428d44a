// Cost of peer authentication: the time to open a control connection to an
// engine (connect, Hello, HelloAck) without a secret and with one (plus the
// HMAC-SHA256 challenge and proof: one more round trip and four HMACs),
// measured in one run, alternating blocks so that other load hits both alike.
// Prints one JSON object. Usage: mori_auth_bench [connections per mode]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/control_plane.h"
#include "core/engine.h"

using namespace mori_torch;

namespace {

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / v.size();
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2000;
  const std::string secret = "benchmark secret";
  EngineConfig open_cfg;
  open_cfg.host = "127.0.0.1";
  EngineConfig auth_cfg = open_cfg;
  auth_cfg.secret = secret;
  Engine open_server("bench-open", open_cfg), auth_server("bench-auth", auth_cfg);
  EngineDesc client;
  client.key = "bench-client";
  client.host = "127.0.0.1";
  client.incarnation = 1;
  std::vector<double> open_us, auth_us;
  auto time_one = [&](const EngineDesc& server, const std::string& s, std::vector<double>* out) {
    const auto t0 = std::chrono::steady_clock::now();
    Socket sock = OpenEngineConnection(client, server, ConnectionKind::Control, 0, 5000, s);
    const auto t1 = std::chrono::steady_clock::now();
    out->push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  };
  constexpr int kBlock = 100;
  for (int i = 0; i < n; i += kBlock) {
    for (int k = 0; k < kBlock; ++k) time_one(open_server.Desc(), "", &open_us);
    for (int k = 0; k < kBlock; ++k) time_one(auth_server.Desc(), secret, &auth_us);
  }
  std::printf(
      "{\"connections_per_mode\": %zu, \"open_p50_us\": %.1f, \"open_p99_us\": %.1f, \"open_mean_us\": %.1f, "
      "\"secret_p50_us\": %.1f, \"secret_p99_us\": %.1f, \"secret_mean_us\": %.1f, \"added_p50_us\": %.1f}\n",
      open_us.size(), Percentile(open_us, 0.5), Percentile(open_us, 0.99), Mean(open_us), Percentile(auth_us, 0.5),
      Percentile(auth_us, 0.99), Mean(auth_us), Percentile(auth_us, 0.5) - Percentile(open_us, 0.5));
  return 0;
}
