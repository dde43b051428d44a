#include "core/peer_auth.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "base/config_table.h"

namespace mori_torch {
namespace auth {
namespace {

constexpr char kServerLabel[] = "mori-torch auth v1: server proof";
constexpr char kClientLabel[] = "mori-torch auth v1: client proof";
constexpr size_t kChallengeBytes = 1 + kNonceBytes + crypto::kHmacBytes;
constexpr size_t kProofBytes = 1 + crypto::kHmacBytes;

std::vector<uint8_t> Transcript(const std::vector<uint8_t>& hello, const Nonce& server_nonce,
                                const std::string& server_key) {
  ByteWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(hello.size()));
  w.PutBytes(hello.data(), hello.size());
  w.PutBytes(server_nonce.data(), server_nonce.size());
  w.PutString(server_key);
  return std::move(w.bytes());
}

crypto::Mac Prove(const std::string& secret, const char* label, const std::vector<uint8_t>& transcript) {
  std::vector<uint8_t> msg(label, label + std::char_traits<char>::length(label));
  msg.push_back(0);
  msg.insert(msg.end(), transcript.begin(), transcript.end());
  return crypto::HmacSha256(secret, msg.data(), msg.size());
}

std::string CheckVersion(uint8_t v, const char* what) {
  if (v == kAuthVersion) return "";
  return std::string(what) + ": authentication version " + std::to_string(v) + " is not supported (this build speaks " +
         std::to_string(kAuthVersion) + ")";
}

}  // namespace

std::string ResolveSecret(const std::string& configured) {
  std::string s = configured;
  if (s.empty()) s = config::EnvText("MORI_TORCH_SECRET");
  if (s.size() > kMaxSecretBytes) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "IOEngineConfig: secret of " + std::to_string(s.size()) +
                                                  " bytes exceeds the limit of " + std::to_string(kMaxSecretBytes));
  }
  if (!s.empty() && !crypto::LibcryptoError().empty()) {
    throw Error(StatusCode::ERR_BAD_STATE,
                "IOEngineConfig: a secret needs HMAC-SHA256 from libcrypto: " + crypto::LibcryptoError());
  }
  return s;
}

void PutHelloAuth(ByteWriter& w, const HelloAuth& a) {
  w.Put<uint8_t>(a.version);
  if (a.version != 0) w.PutBytes(a.nonce.data(), a.nonce.size());
}

HelloAuth GetHelloAuth(ByteReader& r) {
  HelloAuth a;
  a.version = r.Get<uint8_t>("auth version");
  if (a.version == 0) return a;
  std::string why = CheckVersion(a.version, "Hello");
  if (!why.empty()) throw Error(StatusCode::ERR_INVALID_ARGS, why);
  r.GetBytes(a.nonce.data(), a.nonce.size(), "client nonce");
  return a;
}

std::string ParseChallenge(const uint8_t* payload, size_t n, Nonce* server_nonce, crypto::Mac* proof) {
  if (n != kChallengeBytes) {
    return "AuthChallenge of " + std::to_string(n) + " bytes (expected " + std::to_string(kChallengeBytes) + ")";
  }
  std::string why = CheckVersion(payload[0], "AuthChallenge");
  if (!why.empty()) return why;
  std::copy(payload + 1, payload + 1 + kNonceBytes, server_nonce->begin());
  std::copy(payload + 1 + kNonceBytes, payload + n, proof->begin());
  return "";
}

std::string ParseProof(const uint8_t* payload, size_t n, crypto::Mac* proof) {
  if (n != kProofBytes) {
    return "AuthProof of " + std::to_string(n) + " bytes (expected " + std::to_string(kProofBytes) + ")";
  }
  std::string why = CheckVersion(payload[0], "AuthProof");
  if (!why.empty()) return why;
  std::copy(payload + 1, payload + n, proof->begin());
  return "";
}

ServerHandshake::ServerHandshake(const std::string& secret, const std::vector<uint8_t>& hello,
                                 const std::string& server_key)
    : secret_(secret) {
  crypto::SecureRandom(server_nonce_.data(), server_nonce_.size());
  transcript_ = Transcript(hello, server_nonce_, server_key);
}

std::vector<uint8_t> ServerHandshake::Challenge() const {
  const crypto::Mac proof = Prove(secret_, kServerLabel, transcript_);
  ByteWriter w;
  w.Put<uint8_t>(kAuthVersion);
  w.PutBytes(server_nonce_.data(), server_nonce_.size());
  w.PutBytes(proof.data(), proof.size());
  return std::move(w.bytes());
}

std::string ServerHandshake::VerifyProof(const uint8_t* payload, size_t n) const {
  crypto::Mac got{};
  std::string why = ParseProof(payload, n, &got);
  if (!why.empty()) return why;
  const crypto::Mac want = Prove(secret_, kClientLabel, transcript_);
  if (!crypto::ConstantTimeEqual(got.data(), want.data(), want.size())) {
    return "the peer's proof does not match this engine's secret (wrong secret on one side)";
  }
  return "";
}

ClientHandshake::ClientHandshake(const std::string& secret, const std::string& server_key)
    : secret_(secret), server_key_(server_key) {
  crypto::SecureRandom(client_nonce_.data(), client_nonce_.size());
}

std::string ClientHandshake::VerifyChallenge(const std::vector<uint8_t>& hello, const uint8_t* payload, size_t n) {
  Nonce server_nonce{};
  crypto::Mac got{};
  std::string why = ParseChallenge(payload, n, &server_nonce, &got);
  if (!why.empty()) return why;
  transcript_ = Transcript(hello, server_nonce, server_key_);
  const crypto::Mac want = Prove(secret_, kServerLabel, transcript_);
  if (!crypto::ConstantTimeEqual(got.data(), want.data(), want.size())) {
    transcript_.clear();
    return "the server's proof does not match this engine's secret (wrong secret on one side, or an engine other "
           "than '" +
           server_key_ + "' listens there)";
  }
  return "";
}

std::vector<uint8_t> ClientHandshake::Proof() const {
  if (transcript_.empty()) throw Error(StatusCode::ERR_BAD_STATE, "AuthProof before a verified AuthChallenge");
  const crypto::Mac proof = Prove(secret_, kClientLabel, transcript_);
  ByteWriter w;
  w.Put<uint8_t>(kAuthVersion);
  w.PutBytes(proof.data(), proof.size());
  return std::move(w.bytes());
}

}  // namespace auth
}  // namespace mori_torch
