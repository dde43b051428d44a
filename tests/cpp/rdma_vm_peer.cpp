#include "rdma_vm_peer.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <stdexcept>

#include "backends/rdma/rdma_recv_qp.h"
#include "core/engine.h"

extern char** environ;

namespace mori_torch {
namespace rdma_test {
namespace {

std::string Hex(const std::vector<uint8_t>& b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (uint8_t x : b) {
    s += d[x >> 4];
    s += d[x & 15];
  }
  return s;
}

std::vector<uint8_t> Unhex(const std::string& s) {
  std::vector<uint8_t> b;
  for (size_t i = 0; i + 1 < s.size(); i += 2)
    b.push_back(static_cast<uint8_t>(std::stoi(s.substr(i, 2), nullptr, 16)));
  return b;
}

uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

BackendConfig ParseConfig(const std::string& s) {
  BackendConfig c;
  std::stringstream ss(s);
  std::string kv;
  while (std::getline(ss, kv, ',')) {
    auto eq = kv.find('=');
    if (eq != std::string::npos) c[kv.substr(0, eq)] = std::stoll(kv.substr(eq + 1));
  }
  return c;
}

}  // namespace

std::string TestHost() {
  const char* ip = std::getenv("MORI_RDMA_IP");
  return ip && *ip ? ip : "127.0.0.1";
}

void FillPattern(uint8_t* p, uint64_t off, uint64_t n, uint64_t seed) {
  for (uint64_t i = 0; i < n;) {
    const uint64_t abs = off + i;
    const uint64_t word = Mix(seed ^ (abs >> 3));
    const uint64_t in_word = abs & 7;
    const uint64_t take = std::min<uint64_t>(8 - in_word, n - i);
    std::memcpy(p + i, reinterpret_cast<const uint8_t*>(&word) + in_word, take);
    i += take;
  }
}

uint64_t HashBytes(const uint8_t* p, uint64_t n) {
  uint64_t h = 0xcbf29ce484222325ull ^ n;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

int RunPeer(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: --peer KEY BUF_BYTES CONFIG\n";
    return 2;
  }
  const std::string key = argv[2];
  const uint64_t bytes = std::stoull(argv[3]);
  EngineConfig ec;
  ec.host = TestHost();
  Engine engine(key, ec);
  engine.CreateBackend(BackendType::RDMA, ParseConfig(argv[4]));
  // TCP too: what an initiator fails over to (rdma_vm_failover_test.cpp).
  engine.CreateBackend(BackendType::TCP, {});
  auto* buf = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (buf == MAP_FAILED) return 3;
  std::memset(buf, 0, bytes);
  MemoryDesc mem =
      engine.RegisterMemory(reinterpret_cast<uint64_t>(buf), static_cast<int64_t>(bytes), -1, MemoryLocationType::CPU);
  std::cout << "READY " << Hex(engine.Desc().Pack()) << " " << Hex(mem.Pack()) << std::endl;
  std::string cmd;
  while (std::cin >> cmd) {
    if (cmd == "fill") {
      uint64_t seed;
      std::cin >> seed;
      FillPattern(buf, 0, bytes, seed);
      std::cout << "OK" << std::endl;
    } else if (cmd == "hash") {
      uint64_t off, len;
      std::cin >> off >> len;
      std::cout << "HASH " << HashBytes(buf + off, len) << std::endl;
    } else if (cmd == "pop") {
      std::string who;
      uint64_t uid;
      std::cin >> who >> uid;
      std::cout << "POP " << (engine.PopInboundTransferStatus(who, uid) ? 1 : 0) << std::endl;
    } else if (cmd == "dereg") {
      engine.DeregisterMemory(mem);
      std::cout << "OK" << std::endl;
    } else if (cmd == "notices") {
      const rdma::NoticeCounters c = rdma::TargetNoticeCounters();
      std::cout << "NOTICES " << c.received << " " << c.incomplete << std::endl;
    } else if (cmd == "quit") {
      break;
    }
  }
  engine.Shutdown();
  munmap(buf, bytes);
  return 0;
}

PeerProcess::PeerProcess(const std::string& key, uint64_t buf_bytes, const std::string& config) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out[1], 1);
  const std::string bytes = std::to_string(buf_bytes);
  const std::string cfg = config.empty() ? "-" : config;
  const char* args[] = {"/proc/self/exe", "--peer", key.c_str(), bytes.c_str(), cfg.c_str(), nullptr};
  int rc = posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, const_cast<char**>(args), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(in[0]);
  close(out[1]);
  if (rc != 0) throw std::runtime_error("posix_spawn failed");
  to_ = fdopen(in[1], "w");
  from_ = fdopen(out[0], "r");
  std::string line = Command("");
  std::stringstream ss(line);
  std::string word, e, m;
  ss >> word >> e >> m;
  if (word != "READY") throw std::runtime_error("peer did not start: '" + line + "'");
  auto eb = Unhex(e), mb = Unhex(m);
  engine_ = EngineDesc::Unpack(eb.data(), eb.size());
  memory_ = MemoryDesc::Unpack(mb.data(), mb.size());
}

PeerProcess::~PeerProcess() {
  if (stopped_) Continue();
  if (to_) {
    fputs("quit\n", to_);
    fclose(to_);
  }
  if (from_) fclose(from_);
  if (pid_ > 0) {
    int st;
    // A peer stuck in shutdown must not hang the suite.
    for (int i = 0; i < 500 && waitpid(pid_, &st, WNOHANG) == 0; ++i) usleep(10000);
    if (waitpid(pid_, &st, WNOHANG) == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &st, 0);
    }
  }
}

std::string PeerProcess::Command(const std::string& line) {
  if (!line.empty()) {
    fputs((line + "\n").c_str(), to_);
    fflush(to_);
  }
  char buf[8192];
  if (!fgets(buf, sizeof buf, from_)) throw std::runtime_error("peer closed its output (crashed?)");
  std::string s(buf);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

uint64_t PeerProcess::Hash(uint64_t off, uint64_t len) {
  std::string r = Command("hash " + std::to_string(off) + " " + std::to_string(len));
  if (r.rfind("HASH ", 0) != 0) throw std::runtime_error("bad hash reply '" + r + "'");
  return std::stoull(r.substr(5));
}

bool PeerProcess::Pop(const std::string& initiator, uint64_t uid) {
  std::string r = Command("pop " + initiator + " " + std::to_string(uid));
  return r == "POP 1";
}

void PeerProcess::Stop() {
  if (pid_ <= 0 || stopped_) return;
  kill(pid_, SIGSTOP);
  int st = 0;
  // Returns once every thread of the peer is stopped.
  while (waitpid(pid_, &st, WUNTRACED) == pid_ && !WIFSTOPPED(st)) {
  }
  stopped_ = true;
}

void PeerProcess::Continue() {
  if (pid_ <= 0 || !stopped_) return;
  kill(pid_, SIGCONT);
  int st = 0;
  waitpid(pid_, &st, WCONTINUED);
  stopped_ = false;
}

std::pair<uint64_t, uint64_t> PeerProcess::Notices() {
  std::string r = Command("notices");
  std::stringstream ss(r);
  std::string word;
  uint64_t received = 0, incomplete = 0;
  ss >> word >> received >> incomplete;
  if (word != "NOTICES") throw std::runtime_error("bad notices reply '" + r + "'");
  return {received, incomplete};
}

void PeerProcess::Kill() {
  if (to_) fclose(to_);
  to_ = nullptr;
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    int st;
    waitpid(pid_, &st, 0);
    pid_ = -1;
    stopped_ = false;
  }
}

}  // namespace rdma_test
}  // namespace mori_torch
