// A target engine in its own process for the RDMA tests: the test binary
// re-executes itself with --peer (exec, not a bare fork: pages registered
// with the NIC must not be shared copy-on-write with a child). The child
// registers one buffer and answers line commands on stdin:
//   fill SEED        fill the buffer with the pattern of SEED
//   hash OFF LEN     reply "HASH <h>" of the bytes there
//   pop KEY UID      reply "POP 1" or "POP 0" (pop_inbound_transfer_status)
//   dereg            deregister the buffer
//   notices          reply "NOTICES <received> <incomplete>": the RDMA
//                    target's notice counters (rdma::TargetNoticeCounters)
//   quit
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/descriptors.h"

namespace mori_torch {
namespace rdma_test {

// The byte pattern of `seed` at absolute offset `i` of a buffer.
void FillPattern(uint8_t* p, uint64_t off, uint64_t n, uint64_t seed);
uint64_t HashBytes(const uint8_t* p, uint64_t n);

// Runs the child side; returns the exit code.
int RunPeer(int argc, char** argv);

class PeerProcess {
 public:
  // `config` is "key=value,..." for the peer's RDMA backend.
  PeerProcess(const std::string& key, uint64_t buf_bytes, const std::string& config = "");
  ~PeerProcess();
  const EngineDesc& engine() const { return engine_; }
  const MemoryDesc& memory() const { return memory_; }
  std::string Command(const std::string& line);  // one reply line
  uint64_t Hash(uint64_t off, uint64_t len);
  bool Pop(const std::string& initiator, uint64_t uid);
  void Kill();  // SIGKILL, no goodbye
  // SIGSTOP / SIGCONT, each returning once the kernel reports the change.
  // While stopped, the peer's threads do nothing (its NIC, the kernel's
  // Soft-RoCE, still answers RDMA READ/WRITE; notice buffers used up are not
  // posted again). The destructor continues a stopped peer.
  void Stop();
  void Continue();
  // The target's notice counters (received, incomplete), see above.
  std::pair<uint64_t, uint64_t> Notices();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  bool stopped_ = false;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
  EngineDesc engine_;
  MemoryDesc memory_;
};

// The host the engines listen on: the VM's RDMA interface address.
std::string TestHost();

}  // namespace rdma_test
}  // namespace mori_torch
