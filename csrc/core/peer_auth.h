// Mutual challenge-response proof of a shared secret, HMAC-SHA256 over the
// whole handshake, for every control and data connection. Transport-agnostic:
// payloads in, payloads out; the caller moves them (today: the control plane's
// Hello / AuthChallenge / AuthProof frames).
//
//   client -> server  Hello: ..., HelloAuth {u8 version=1, 32-byte client nonce}
//   server -> client  AuthChallenge: u8 version, 32-byte server nonce,
//                     server proof = HMAC(secret, "server" label, transcript)
//   client -> server  AuthProof: u8 version, client proof = HMAC(secret, "client" label, transcript)
//   server -> client  HelloAck (its EngineDesc) only after the proof verified
//
// The transcript is the exact Hello bytes (kind, backend, the client's
// EngineDesc and nonce), the server nonce and the key of the engine the
// client means to reach: the client's identity is bound to the connection,
// and neither proof can be replayed on another connection or reflected.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/byte_io.h"
#include "core/crypto.h"

namespace mori_torch {
namespace auth {

constexpr uint8_t kAuthVersion = 1;  // 0 in a Hello: the client brings no secret
constexpr size_t kNonceBytes = 32;
constexpr size_t kMaxSecretBytes = 4096;
using Nonce = std::array<uint8_t, kNonceBytes>;

// The secret from the engine config, else MORI_TORCH_SECRET, else "" (open).
// Throws Error if it is longer than kMaxSecretBytes.
std::string ResolveSecret(const std::string& configured);

struct HelloAuth {
  uint8_t version = 0;
  Nonce nonce{};
};
void PutHelloAuth(ByteWriter& w, const HelloAuth& a);
// Throws Error (ERR_INVALID_ARGS) on an unknown version or missing bytes.
HelloAuth GetHelloAuth(ByteReader& r);

// Server side of one connection's handshake.
class ServerHandshake {
 public:
  // `hello` is the client's whole Hello payload, `server_key` this engine's key.
  ServerHandshake(const std::string& secret, const std::vector<uint8_t>& hello, const std::string& server_key);
  // The AuthChallenge payload.
  std::vector<uint8_t> Challenge() const;
  // "" when the AuthProof payload proves the secret, else why not.
  std::string VerifyProof(const uint8_t* payload, size_t n) const;

 private:
  std::string secret_;
  std::vector<uint8_t> transcript_;
  Nonce server_nonce_{};
};

// Client side of one connection's handshake.
class ClientHandshake {
 public:
  // `server_key`: the engine the client means to reach.
  ClientHandshake(const std::string& secret, const std::string& server_key);
  // What the Hello carries.
  HelloAuth Offer() const { return {kAuthVersion, client_nonce_}; }
  // "" when the AuthChallenge payload proves the server knows the secret for
  // the Hello `hello` (built with Offer()), else why not.
  std::string VerifyChallenge(const std::vector<uint8_t>& hello, const uint8_t* payload, size_t n);
  // The AuthProof payload; only after VerifyChallenge returned "".
  std::vector<uint8_t> Proof() const;

 private:
  std::string secret_;
  std::string server_key_;
  Nonce client_nonce_{};
  std::vector<uint8_t> transcript_;
};

// Parsers of the two handshake payloads (exposed for the fuzzer): "" and the
// fields, or why the payload is malformed.
std::string ParseChallenge(const uint8_t* payload, size_t n, Nonce* server_nonce, crypto::Mac* proof);
std::string ParseProof(const uint8_t* payload, size_t n, crypto::Mac* proof);

}  // namespace auth
}  // namespace mori_torch
