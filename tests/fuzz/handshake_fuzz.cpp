// libFuzzer target for what an unauthenticated peer can send before it has
// proved the secret: the Hello frame's payload and the two handshake payloads
// (AuthChallenge, AuthProof). Each parser must reject garbage with a message,
// never crash, and no input may pass as a proof of a secret it was not made
// with. Run by ctest for a bounded time (CMakeLists.txt, fuzz_handshake).
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "core/control_plane.h"
#include "core/logging.h"
#include "core/peer_auth.h"

using namespace mori_torch;

namespace {

const std::vector<uint8_t>& SomeHello() {
  static const std::vector<uint8_t> hello = [] {
    EngineDesc d;
    d.key = "fuzz-client";
    d.host = "127.0.0.1";
    d.port = 1;
    d.incarnation = 7;
    auth::HelloAuth a;
    a.version = auth::kAuthVersion;
    return EncodeHello(ConnectionKind::Data, 3, d, a);
  }();
  return hello;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    Hello h = ParseHello(data, size);
    // What parsed must encode back to the same bytes (nothing ignored).
    if (EncodeHello(h.kind, h.backend, h.peer, h.auth) != std::vector<uint8_t>(data, data + size)) std::abort();
  } catch (const Error&) {
  }
  auth::Nonce nonce;
  crypto::Mac mac;
  (void)auth::ParseChallenge(data, size, &nonce, &mac);
  (void)auth::ParseProof(data, size, &mac);

  // Random bytes never prove the secret, to either side.
  auth::ServerHandshake server("fuzz secret", SomeHello(), "fuzz-server");
  if (server.VerifyProof(data, size).empty()) std::abort();
  auth::ClientHandshake client("fuzz secret", "fuzz-server");
  if (client.VerifyChallenge(SomeHello(), data, size).empty()) std::abort();
  return 0;
}
