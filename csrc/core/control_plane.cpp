#include "core/control_plane.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "core/byte_io.h"
#include "core/logging.h"
#include "core/memory_registry.h"

namespace mori_torch {

std::vector<uint8_t> EncodeErrorPayload(StatusCode code, const std::string& msg) {
  ByteWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(code));
  w.PutString(msg.substr(0, 4000));
  return std::move(w.bytes());
}

Error DecodeErrorPayload(const Frame& f, const std::string& where) {
  ByteReader r(f.payload.data(), f.payload.size(), "error frame");
  auto code = static_cast<StatusCode>(r.Get<uint32_t>("code"));
  std::string msg = r.GetString("message");
  if (!IsError(code)) code = StatusCode::ERR_BAD_STATE;
  return Error(code, where + ": " + msg);
}

std::vector<uint8_t> EncodeHello(ConnectionKind kind, uint8_t backend, const EngineDesc& self,
                                 const auth::HelloAuth& auth) {
  ByteWriter w;
  w.Put<uint8_t>(static_cast<uint8_t>(kind));
  w.Put<uint8_t>(backend);
  auto desc = self.Pack();
  w.Put<uint32_t>(static_cast<uint32_t>(desc.size()));
  w.PutBytes(desc.data(), desc.size());
  auth::PutHelloAuth(w, auth);
  return std::move(w.bytes());
}

Hello ParseHello(const uint8_t* payload, size_t n) {
  Hello h;
  ByteReader rd(payload, n, "Hello frame");
  uint8_t k = rd.Get<uint8_t>("kind");
  if (k != static_cast<uint8_t>(ConnectionKind::Control) && k != static_cast<uint8_t>(ConnectionKind::Data)) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "unknown connection kind " + std::to_string(k));
  }
  h.kind = static_cast<ConnectionKind>(k);
  h.backend = rd.Get<uint8_t>("backend");
  uint32_t len = rd.Get<uint32_t>("desc length");
  if (len > rd.remaining()) {
    throw Error(StatusCode::ERR_INVALID_ARGS, "Hello frame truncated: engine desc of " + std::to_string(len) +
                                                  " bytes but only " + std::to_string(rd.remaining()) + " left");
  }
  std::vector<uint8_t> desc(len);
  rd.GetBytes(desc.data(), len, "engine desc");
  h.auth = auth::GetHelloAuth(rd);
  rd.ExpectEnd();
  h.peer = EngineDesc::Unpack(desc.data(), desc.size());
  return h;
}

namespace {

std::string PeerAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
    if (ss.ss_family == AF_INET) {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
      port = ntohs(a->sin_port);
    } else if (ss.ss_family == AF_INET6) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
      port = ntohs(a->sin6_port);
    }
  }
  return std::string(host) + ":" + std::to_string(port);
}

}  // namespace

std::string ControlPlaneServer::Authenticate(int fd, const Hello& hello, const std::vector<uint8_t>& hello_bytes) {
  const std::string& secret = opts_.secret;
  const std::string& self_key = delegate_->SelfDesc().key;
  if (secret.empty()) {
    if (hello.auth.version == 0) return "";
    return "this engine has no secret configured, but the connecting engine '" + hello.peer.key +
           "' requires authentication: set the same secret on both (IOEngineConfig(secret=...) or MORI_TORCH_SECRET)";
  }
  if (hello.auth.version == 0) {
    return "this engine requires authentication and the connecting engine '" + hello.peer.key +
           "' has no secret: set the same secret on both (IOEngineConfig(secret=...) or MORI_TORCH_SECRET)";
  }
  auth::ServerHandshake hs(secret, hello_bytes, self_key);
  if (!WriteFrame(fd, FrameType::AuthChallenge, hs.Challenge(), opts_.frame_timeout_ms).ok) {
    return "connection lost during authentication";
  }
  Frame proof;
  IoResult r = ReadFrame(fd, &proof, opts_.hello_timeout_ms, opts_.frame_timeout_ms);
  if (!r.ok) return "no authentication proof: " + r.error;
  if (proof.type == FrameType::Error) {
    return "the connecting engine refused this engine's proof: " +
           std::string(DecodeErrorPayload(proof, "'" + hello.peer.key + "'").what());
  }
  if (proof.type != FrameType::AuthProof) {
    return "expected AuthProof, got frame type " + std::to_string(static_cast<int>(proof.type));
  }
  std::string why = hs.VerifyProof(proof.payload.data(), proof.payload.size());
  return why.empty() ? "" : "authentication failed: " + why;
}

ControlPlaneServer::ControlPlaneServer(ControlPlaneDelegate* delegate, ControlPlaneOptions opts)
    : delegate_(delegate), opts_(opts) {}

ControlPlaneServer::~ControlPlaneServer() { Stop(); }

int ControlPlaneServer::Start(const std::string& host, int port) {
  int bound = 0;
  listener_ = Listen(host, port, &bound);
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return bound;
}

void ControlPlaneServer::Stop() {
  if (stopping_.exchange(true)) return;
  listener_.Shutdown();
  if (accept_thread_.joinable()) accept_thread_.join();
  listener_.Close();
  std::list<std::unique_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& c : conns_) c->sock.Shutdown();
    conns.swap(conns_);
  }
  for (auto& c : conns) {
    if (c->thread.joinable()) c->thread.join();
  }
}

size_t ControlPlaneServer::ConnectionCount() {
  std::lock_guard<std::mutex> lk(mu_);
  ReapFinished();
  return conns_.size();
}

void ControlPlaneServer::ReapFinished() {  // mu_ held
  for (auto it = conns_.begin(); it != conns_.end();) {
    if ((*it)->done.load()) {
      if ((*it)->thread.joinable()) (*it)->thread.join();
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void ControlPlaneServer::AcceptLoop() {
  while (!stopping_.load()) {
    int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        MORI_LOG(Error, "control plane: accept: out of file descriptors");
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        continue;
      }
      if (!stopping_.load()) MORI_LOG(Error, "control plane: accept failed: " << std::strerror(errno));
      return;
    }
    std::lock_guard<std::mutex> lk(mu_);
    ReapFinished();
    if (stopping_.load()) {
      ::close(fd);
      return;
    }
    auto c = std::make_unique<Conn>();
    c->sock = Socket(fd);
    Conn* raw = c.get();
    conns_.push_back(std::move(c));
    raw->thread = std::thread([this, raw] {
      Serve(raw);
      // Tell the peer now: the fd itself is only closed when the connection
      // is reaped (next accept), and Stop() may still shut it down, so it
      // must not be closed (and its number reused) from this thread.
      raw->sock.Shutdown();
      raw->done.store(true);
    });
  }
}

void ControlPlaneServer::Serve(Conn* c) {
  const int fd = c->sock.fd();
  SetNoDelay(fd, true);
  Frame hello;
  IoResult r = ReadFrame(fd, &hello, opts_.hello_timeout_ms, opts_.frame_timeout_ms);
  if (!r.ok) {
    MORI_LOG(Warning, "control plane: closing new connection: " << r.error);
    return;
  }
  Hello h;
  try {
    if (hello.type != FrameType::Hello) {
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "expected Hello, got frame type " + std::to_string(static_cast<int>(hello.type)));
    }
    h = ParseHello(hello.payload.data(), hello.payload.size());
    // Nothing is served, not even our descriptor, before the peer proved the secret.
    std::string why = Authenticate(fd, h, hello.payload);
    if (!why.empty()) {
      MORI_LOG(Warning, "control plane: refused connection from " << PeerAddress(fd) << " claiming to be '"
                                                                  << h.peer.key << "': " << why);
      WriteFrame(fd, FrameType::Error, EncodeErrorPayload(StatusCode::ERR_BAD_STATE, why), opts_.frame_timeout_ms);
      return;
    }
    if (h.kind == ConnectionKind::Data) {
      why = delegate_->CanServeData(h.backend);
      if (!why.empty()) throw Error(StatusCode::ERR_BAD_STATE, why);
    }
  } catch (const Error& e) {
    MORI_LOG(Warning, "control plane: rejecting connection: " << e.what());
    WriteFrame(fd, FrameType::Error, EncodeErrorPayload(e.code(), e.what()), opts_.frame_timeout_ms);
    return;
  }
  if (!WriteFrame(fd, FrameType::HelloAck, delegate_->SelfDesc().Pack(), opts_.frame_timeout_ms).ok) return;

  const EngineDesc& peer = h.peer;
  if (h.kind == ConnectionKind::Data) {
    delegate_->ServeData(h.backend, peer, c->sock);
    return;
  }
  while (!stopping_.load()) {
    Frame req, reply;
    r = ReadFrame(fd, &req, -1, opts_.frame_timeout_ms);
    if (!r.ok) {
      if (r.error != "peer closed the connection" && !stopping_.load()) {
        MORI_LOG(Warning, "control plane: closing connection from '" << peer.key << "': " << r.error);
      }
      return;
    }
    bool keep = false;
    try {
      keep = delegate_->HandleControl(peer, req, &reply);
    } catch (const Error& e) {
      reply.type = FrameType::Error;
      reply.payload = EncodeErrorPayload(e.code(), e.what());
      keep = true;
    }
    if (!keep) {
      MORI_LOG(Warning, "control plane: closing connection from '" << peer.key << "': unexpected frame type "
                                                                   << static_cast<int>(req.type));
      return;
    }
    if (!WriteFrame(fd, reply.type, reply.payload, opts_.frame_timeout_ms).ok) return;
  }
}

Socket OpenEngineConnection(const EngineDesc& self, const EngineDesc& remote, ConnectionKind kind, uint8_t backend,
                            int timeout_ms, const std::string& secret) {
  const std::string where = "engine '" + remote.key + "' at " + remote.host + ":" + std::to_string(remote.port);
  Socket s;
  try {
    s = Connect(remote.host, remote.port, timeout_ms);
  } catch (const Error& e) {
    throw Error(e.code(), where + ": " + e.what());
  }
  SetNoDelay(s.fd(), true);
  std::unique_ptr<auth::ClientHandshake> hs;
  if (!secret.empty()) hs = std::make_unique<auth::ClientHandshake>(secret, remote.key);
  const std::vector<uint8_t> hello = EncodeHello(kind, backend, self, hs ? hs->Offer() : auth::HelloAuth{});
  IoResult r = WriteFrame(s.fd(), FrameType::Hello, hello, timeout_ms);
  Frame reply;
  if (r.ok) r = ReadFrame(s.fd(), &reply, timeout_ms, timeout_ms);
  bool proved = false;  // the server proved the secret
  if (r.ok && hs && reply.type == FrameType::AuthChallenge) {
    std::string why = hs->VerifyChallenge(hello, reply.payload.data(), reply.payload.size());
    if (!why.empty()) {
      why = "authentication failed: " + why;
      WriteFrame(s.fd(), FrameType::Error, EncodeErrorPayload(StatusCode::ERR_BAD_STATE, why), timeout_ms);
      MORI_LOG(Warning, "engine '" << self.key << "': " << where << ": " << why);
      throw Error(StatusCode::ERR_BAD_STATE, where + ": " + why);
    }
    proved = true;
    r = WriteFrame(s.fd(), FrameType::AuthProof, hs->Proof(), timeout_ms);
    if (r.ok) r = ReadFrame(s.fd(), &reply, timeout_ms, timeout_ms);
  }
  if (!r.ok) throw Error(StatusCode::ERR_BAD_STATE, where + ": handshake failed: " + r.error);
  if (reply.type == FrameType::Error) throw DecodeErrorPayload(reply, where);
  if (reply.type == FrameType::AuthChallenge) {
    throw Error(StatusCode::ERR_BAD_STATE, where + ": the engine requires authentication and this engine '" +
                                               self.key + "' has no secret: set the same secret on both "
                                               "(IOEngineConfig(secret=...) or MORI_TORCH_SECRET)");
  }
  if (hs && !proved && reply.type == FrameType::HelloAck) {
    throw Error(StatusCode::ERR_BAD_STATE, where + ": the engine did not authenticate (it has no secret), and "
                                               "this engine '" + self.key + "' requires it");
  }
  if (reply.type != FrameType::HelloAck) {
    throw Error(StatusCode::ERR_BAD_STATE, where + ": handshake failed: unexpected reply type " +
                                               std::to_string(static_cast<int>(reply.type)));
  }
  EngineDesc server = EngineDesc::Unpack(reply.payload.data(), reply.payload.size());
  if (server.key != remote.key) {
    throw Error(StatusCode::ERR_NOT_FOUND, where + ": the engine listening there is '" + server.key + "'");
  }
  if (remote.incarnation != 0 && server.incarnation != remote.incarnation) {
    throw Error(StatusCode::ERR_NOT_FOUND, where + ": " + EngineRestartedMessage(remote.key, remote.incarnation,
                                                                                 server.incarnation));
  }
  return s;
}

Frame ControlClient::Call(FrameType type, const std::vector<uint8_t>& payload) {
  std::lock_guard<std::mutex> lk(mu_);
  const std::string where = "engine '" + remote_.key + "'";
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (!sock_.valid()) sock_ = OpenEngineConnection(self_, remote_, ConnectionKind::Control, 0, timeout_ms_, secret_);
    Frame reply;
    IoResult r = WriteFrame(sock_.fd(), type, payload, timeout_ms_);
    if (r.ok) r = ReadFrame(sock_.fd(), &reply, timeout_ms_, timeout_ms_);
    if (r.ok) {
      if (reply.type == FrameType::Error) throw DecodeErrorPayload(reply, where);
      return reply;
    }
    sock_.Close();  // a stale connection (peer restarted): retry once on a new one
    if (attempt == 1) throw Error(StatusCode::ERR_BAD_STATE, where + ": control request failed: " + r.error);
  }
  throw Error(StatusCode::ERR_BAD_STATE, where + ": unreachable");
}

void ControlClient::Close() {
  std::lock_guard<std::mutex> lk(mu_);
  sock_.Close();
}

}  // namespace mori_torch
