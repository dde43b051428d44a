#include "core/control_plane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/byte_io.h"
#include "core/logging.h"
#include "core/memory_registry.h"
#include "core/thread_name.h"

namespace mori_torch {
namespace {

// Milliseconds left until `d`, at least 1 (0 would mean "do not wait").
int MsLeft(Deadline d) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()).count();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(left, 1 << 30)));
}

}  // namespace

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

Hello DecodeHello(const Frame& f) {
  if (f.type != FrameType::Hello) {
    throw Error(StatusCode::ERR_INVALID_ARGS,
                "expected Hello, got frame type " + std::to_string(static_cast<int>(f.type)));
  }
  ByteReader rd(f.payload.data(), f.payload.size(), "Hello frame");
  Hello h;
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

ControlPlaneServer::ControlPlaneServer(ControlPlaneDelegate* delegate, ControlPlaneOptions opts, EventLoop* loop)
    : delegate_(delegate),
      opts_(opts),
      loop_(loop),
      limits_(std::make_shared<ConnectionLimits>(opts.caps)),
      handlers_("control plane", "mori-ctrl", opts.handler_threads) {}

ControlPlaneServer::~ControlPlaneServer() {
  Stop();
  if (reserve_fd_ >= 0) ::close(reserve_fd_);
}

int ControlPlaneServer::Start(const std::string& host, int port) {
  int bound = 0;
  listener_ = Listen(host, port, &bound);
  ::fcntl(listener_.fd(), F_SETFL, ::fcntl(listener_.fd(), F_GETFL) | O_NONBLOCK);
  reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  listen_fd_.store(listener_.fd());
  loop_->Add(listener_.fd(), EPOLLIN, -1, [this](uint32_t ev) { OnAcceptable(ev); });
  loop_->Every(100, [this] { Housekeeping(); });
  return bound;
}

void ControlPlaneServer::Stop() {
  if (stopping_.exchange(true)) return;
  listen_fd_.store(-1);
  if (listener_.valid()) loop_->Remove(listener_.fd());
  listener_.Close();
  std::unordered_map<int, ConnPtr> conns;
  std::list<std::unique_ptr<BlockingData>> blocking;
  {
    std::lock_guard<std::mutex> lk(mu_);
    conns.swap(conns_);
    blocking.swap(blocking_);
  }
  for (auto& kv : conns) {
    loop_->Remove(kv.first);
    kv.second->sock.Shutdown();  // ends a handler's blocking write at once
  }
  handlers_.Stop();
  for (auto& b : blocking) b->sock.Shutdown();
  for (auto& b : blocking) {
    if (b->thread.joinable()) b->thread.join();
  }
}

size_t ControlPlaneServer::ConnectionCount() {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = conns_.size();
  for (auto& b : blocking_) n += b->done.load() ? 0 : 1;
  return n;
}

void ControlPlaneServer::Housekeeping() {
  if (stopping_.load()) return;
  // Threads of finished blocking data connections are joined here.
  std::list<std::unique_ptr<BlockingData>> finished;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = blocking_.begin(); it != blocking_.end();) {
      if ((*it)->done.load()) {
        finished.push_back(std::move(*it));
        it = blocking_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& b : finished) b->thread.join();
  // Out of descriptors a while ago: try again (it recovers by itself once
  // descriptors are free).
  if (accept_paused_.exchange(false)) {
    if (reserve_fd_ < 0) reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    const int fd = listen_fd_.load();
    if (fd >= 0) loop_->Rearm(fd, EPOLLIN);
  }
}

bool ControlPlaneServer::DropOnePending() {
  fd_drops_.fetch_add(1);
  if (reserve_fd_ < 0) return false;
  ::close(reserve_fd_);
  reserve_fd_ = -1;
  int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
  if (fd >= 0) ::close(fd);  // the peer sees the connection closed, not a hang
  reserve_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  return fd >= 0 && reserve_fd_ >= 0;
}

void ControlPlaneServer::OnAcceptable(uint32_t) {
  // A bounded number per wake-up, so other sockets of the loop get their turn.
  for (int i = 0; i < 64 && !stopping_.load(); ++i) {
    sockaddr_in addr{};
    socklen_t len = sizeof addr;
    int fd = ::accept4(listener_.fd(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      char ip[INET_ADDRSTRLEN] = "?";
      ::inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof ip);
      AcceptOne(fd, ip);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      MORI_LOG(Error, "control plane: out of file descriptors (" << std::strerror(errno)
                                                                 << "); dropping new connections until some are free");
      if (!DropOnePending()) {
        accept_paused_.store(true);  // Housekeeping re-arms the listener
        return;
      }
      continue;
    }
    MORI_LOG(Error, "control plane: accept failed: " << std::strerror(errno));
    accept_paused_.store(true);
    return;
  }
  if (!stopping_.load()) loop_->Rearm(listener_.fd(), EPOLLIN);
}

void ControlPlaneServer::AcceptOne(int fd, const std::string& ip) {
  Socket sock(fd);
  std::string why;
  auto ticket = limits_->Admit(ip, &why);
  if (!ticket) {
    MORI_LOG(Warning, "control plane: refusing a connection from " << ip << ": " << why);
    return;  // closed: the peer sees it at once
  }
  SetNoDelay(fd, true);
  auto c = std::make_shared<Conn>();
  c->sock = std::move(sock);
  c->ticket = std::move(ticket);
  c->hello_deadline_ms = SteadyMs() + opts_.hello_timeout_ms;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_.load()) return;
    conns_[fd] = c;
  }
  try {
    loop_->Add(fd, EPOLLIN | EPOLLRDHUP, opts_.hello_timeout_ms, [this, c](uint32_t ev) { OnConnEvent(c, ev); });
  } catch (const Error& e) {
    CloseConn(c, e.what());
  }
}

void ControlPlaneServer::Rearm(const ConnPtr& c) {
  int64_t idle = opts_.idle_timeout_ms;
  const int64_t now = SteadyMs();
  // The whole handshake (Hello and proof) is bounded by the Hello deadline.
  if (c->stage != Stage::kServing) idle = std::max<int64_t>(1, c->hello_deadline_ms - now);
  if (c->frame_started_ms >= 0) idle = std::max<int64_t>(1, c->frame_started_ms + opts_.frame_timeout_ms - now);
  loop_->Rearm(c->sock.fd(), EPOLLIN | EPOLLRDHUP, idle);
}

void ControlPlaneServer::CloseConn(const ConnPtr& c, const std::string& why) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = conns_.find(c->sock.fd());
    if (it == conns_.end() || it->second != c) return;  // closed already (Stop)
    conns_.erase(it);
  }
  if (!why.empty()) {
    MORI_LOG(Warning, "control plane: closing connection from "
                          << c->ticket->ip() << (c->peer.key.empty() ? "" : " ('" + c->peer.key + "')") << ": " << why);
  }
  loop_->Remove(c->sock.fd());
  c->sock.Shutdown();  // the fd itself closes with the last reference to c
}

void ControlPlaneServer::OnConnEvent(const ConnPtr& c, uint32_t events) {
  if (events == EventLoop::kIdle) {
    if (c->frame_started_ms >= 0) return CloseConn(c, "peer stalled mid-frame");
    if (c->stage == Stage::kAuth) {
      return CloseConn(c, "no authentication proof within " + std::to_string(opts_.hello_timeout_ms) + " ms");
    }
    if (c->stage == Stage::kHello)
      return CloseConn(c, "no Hello within " + std::to_string(opts_.hello_timeout_ms) + " ms");
    MORI_LOG(Info, "control plane: closing idle connection from '" << c->peer.key << "'");
    return CloseConn(c, "");
  }
  switch (c->reader.ReadSome(c->sock.fd())) {
    case FrameReader::Step::kNeedMore:
      if (c->reader.Started() && c->frame_started_ms < 0) c->frame_started_ms = SteadyMs();
      if (c->frame_started_ms >= 0 && SteadyMs() - c->frame_started_ms > opts_.frame_timeout_ms) {
        return CloseConn(c, "peer stalled mid-frame");
      }
      return Rearm(c);
    case FrameReader::Step::kClosed:
      return CloseConn(c, c->reader.Started() ? "peer closed the connection mid-frame" : "");
    case FrameReader::Step::kError:
      return CloseConn(c, c->reader.error());
    case FrameReader::Step::kFrame:
      break;
  }
  c->frame_started_ms = -1;
  Frame f = c->reader.Take();
  // Requests may wait (on backends, on the peer reading the reply): off the loop.
  if (!handlers_.Post([this, c, f = std::move(f)]() mutable { HandleFrame(c, std::move(f)); })) {
    CloseConn(c, "");
  }
}

void ControlPlaneServer::HandleFrame(const ConnPtr& c, Frame f) {
  const int fd = c->sock.fd();
  if (c->stage == Stage::kHello) {
    if (!EstablishConnection(c, f)) return CloseConn(c, "");
    return;  // EstablishConnection re-armed it or handed it off
  }
  if (c->stage == Stage::kAuth) {
    if (!VerifyProof(c, f)) return CloseConn(c, "");
    return;  // Admit re-armed it or handed it off
  }
  Frame reply;
  bool keep = false;
  try {
    keep = delegate_->HandleControl(c->peer, c->ticket->ip(), f, &reply);
  } catch (const Error& e) {
    reply.type = FrameType::Error;
    reply.payload = EncodeErrorPayload(e.code(), e.what());
    keep = true;
  }
  if (!keep) return CloseConn(c, "unexpected frame type " + std::to_string(static_cast<int>(f.type)));
  if (!WriteFrame(fd, reply.type, reply.payload, opts_.frame_timeout_ms).ok) return CloseConn(c, "");
  Rearm(c);
}

bool ControlPlaneServer::EstablishConnection(const ConnPtr& c, const Frame& hello) {
  const int fd = c->sock.fd();
  Hello h;
  try {
    h = DecodeHello(hello);
  } catch (const Error& e) {
    MORI_LOG(Warning, "control plane: rejecting connection from " << c->ticket->ip() << ": " << e.what());
    WriteFrame(fd, FrameType::Error, EncodeErrorPayload(e.code(), e.what()), opts_.frame_timeout_ms);
    return false;
  }
  c->kind = h.kind;
  c->backend = h.backend;
  c->peer = std::move(h.peer);
  // Handshake stage: nothing is served, not even our descriptor, before the
  // peer proved the secret.
  const std::string& secret = opts_.secret;
  if (secret.empty()) {
    if (h.auth.version == 0) return Admit(c);
    return Refuse(c, StatusCode::ERR_BAD_STATE,
                  "this engine has no secret configured, but the connecting engine '" + c->peer.key +
                      "' requires authentication: set the same secret on both (IOEngineConfig(secret=...) or "
                      "MORI_TORCH_SECRET)");
  }
  if (h.auth.version == 0) {
    return Refuse(c, StatusCode::ERR_BAD_STATE,
                  "this engine requires authentication and the connecting engine '" + c->peer.key +
                      "' has no secret: set the same secret on both (IOEngineConfig(secret=...) or MORI_TORCH_SECRET)");
  }
  c->handshake = std::make_unique<auth::ServerHandshake>(secret, hello.payload, delegate_->SelfDesc().key);
  if (!WriteFrame(fd, FrameType::AuthChallenge, c->handshake->Challenge(), opts_.frame_timeout_ms).ok) return false;
  // The proof comes back through the loop, within the Hello deadline.
  c->stage = Stage::kAuth;
  Rearm(c);
  return true;
}

bool ControlPlaneServer::Refuse(const ConnPtr& c, StatusCode code, const std::string& why) {
  MORI_LOG(Warning, "control plane: refused connection from " << c->ticket->ip() << " claiming to be '" << c->peer.key
                                                              << "': " << why);
  WriteFrame(c->sock.fd(), FrameType::Error, EncodeErrorPayload(code, why), opts_.frame_timeout_ms);
  return false;
}

bool ControlPlaneServer::VerifyProof(const ConnPtr& c, const Frame& proof) {
  if (proof.type == FrameType::Error) {
    return Refuse(c, StatusCode::ERR_BAD_STATE,
                  "the connecting engine refused this engine's proof: " +
                      std::string(DecodeErrorPayload(proof, "'" + c->peer.key + "'").what()));
  }
  if (proof.type != FrameType::AuthProof) {
    return Refuse(c, StatusCode::ERR_BAD_STATE,
                  "expected AuthProof, got frame type " + std::to_string(static_cast<int>(proof.type)));
  }
  std::string why = c->handshake->VerifyProof(proof.payload.data(), proof.payload.size());
  c->handshake.reset();
  if (!why.empty()) return Refuse(c, StatusCode::ERR_BAD_STATE, "authentication failed: " + why);
  return Admit(c);
}

bool ControlPlaneServer::Admit(const ConnPtr& c) {
  const int fd = c->sock.fd();
  // The identity is the proven one from here on: caps per engine count it,
  // requests are served as it.
  std::string why;
  if (!limits_->BindPeer(*c->ticket, c->peer.key, &why)) return Refuse(c, StatusCode::ERR_BAD_STATE, why);
  if (c->kind == ConnectionKind::Data) {
    why = delegate_->CanServeData(c->backend);
    if (!why.empty()) return Refuse(c, StatusCode::ERR_BAD_STATE, why);
  }
  if (!WriteFrame(fd, FrameType::HelloAck, delegate_->SelfDesc().Pack(), opts_.frame_timeout_ms).ok) return false;
  c->stage = Stage::kServing;
  if (c->kind == ConnectionKind::Data) {
    HandOffData(c, c->backend);
  } else {
    Rearm(c);
  }
  return true;
}

void ControlPlaneServer::HandOffData(const ConnPtr& c, uint8_t backend) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = conns_.find(c->sock.fd());
    if (it == conns_.end() || it->second != c) return;  // Stop() took it
    conns_.erase(it);
  }
  loop_->Remove(c->sock.fd());
  InboundConnection in{std::move(c->sock), std::move(c->ticket), opts_.idle_timeout_ms};
  if (delegate_->AdoptData(backend, c->peer, in)) return;
  auto b = std::make_unique<BlockingData>();
  b->sock = std::move(in.sock);
  b->ticket = std::move(in.ticket);
  BlockingData* raw = b.get();
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_.load()) return;
  blocking_.push_back(std::move(b));
  raw->thread = std::thread([this, raw, backend, peer = c->peer] {
    SetThreadName("mori-data-in");
    delegate_->ServeData(backend, peer, raw->sock);
    raw->sock.Shutdown();  // closed when joined (Stop() may still shut it down)
    raw->done.store(true);
  });
}

Socket OpenEngineConnection(const EngineDesc& self, const EngineDesc& remote, ConnectionKind kind, uint8_t backend,
                            int timeout_ms, const std::string& secret) {
  const std::string where = "engine '" + remote.key + "' at " + remote.host + ":" + std::to_string(remote.port);
  // One bound for connecting and the Hello exchange together.
  const Deadline deadline = DeadlineAfterMs(timeout_ms);
  Socket s;
  try {
    s = Connect(remote.host, remote.port, timeout_ms);
  } catch (const Error& e) {
    throw Error(where + ": ", e);
  }
  SetNoDelay(s.fd(), true);
  std::unique_ptr<auth::ClientHandshake> hs;
  if (!secret.empty()) hs = std::make_unique<auth::ClientHandshake>(secret, remote.key);
  const std::vector<uint8_t> hello = EncodeHello(kind, backend, self, hs ? hs->Offer() : auth::HelloAuth{});
  IoResult r = WriteFrame(s.fd(), FrameType::Hello, hello, MsLeft(deadline));
  Frame reply;
  if (r.ok) r = ReadFrameBy(s.fd(), &reply, deadline);
  bool proved = false;  // the server proved the secret
  if (r.ok && hs && reply.type == FrameType::AuthChallenge) {
    std::string why = hs->VerifyChallenge(hello, reply.payload.data(), reply.payload.size());
    if (!why.empty()) {
      why = "authentication failed: " + why;
      WriteFrame(s.fd(), FrameType::Error, EncodeErrorPayload(StatusCode::ERR_BAD_STATE, why), MsLeft(deadline));
      MORI_LOG(Warning, "engine '" << self.key << "': " << where << ": " << why);
      throw Error(StatusCode::ERR_BAD_STATE, where + ": " + why);
    }
    proved = true;
    r = WriteFrame(s.fd(), FrameType::AuthProof, hs->Proof(), MsLeft(deadline));
    if (r.ok) r = ReadFrameBy(s.fd(), &reply, deadline);
  }
  if (!r.ok) {
    // Reset or closed mid-handshake: the link's fault (a retry may work);
    // a timeout is not.
    const std::string bound = r.timed_out ? " (connecting bound: " + std::to_string(timeout_ms) + " ms)" : "";
    throw Error(StatusCode::ERR_BAD_STATE, where + ": handshake failed: " + r.error + bound, 0,
                r.timed_out ? ErrorCause::kUnspecified : ErrorCause::kPathFailed);
  }
  if (reply.type == FrameType::Error) throw DecodeErrorPayload(reply, where);
  if (reply.type == FrameType::AuthChallenge) {
    throw Error(StatusCode::ERR_BAD_STATE, where + ": the engine requires authentication and this engine '" + self.key +
                                               "' has no secret: set the same secret on both "
                                               "(IOEngineConfig(secret=...) or MORI_TORCH_SECRET)");
  }
  if (hs && !proved && reply.type == FrameType::HelloAck) {
    throw Error(StatusCode::ERR_BAD_STATE, where +
                                               ": the engine did not authenticate (it has no secret), and "
                                               "this engine '" +
                                               self.key + "' requires it");
  }
  if (reply.type != FrameType::HelloAck) {
    throw Error(StatusCode::ERR_BAD_STATE,
                where + ": handshake failed: unexpected reply type " + std::to_string(static_cast<int>(reply.type)));
  }
  EngineDesc server = EngineDesc::Unpack(reply.payload.data(), reply.payload.size());
  if (server.key != remote.key) {
    throw Error(StatusCode::ERR_NOT_FOUND, where + ": the engine listening there is '" + server.key + "'", 0,
                ErrorCause::kWrongPeer);
  }
  if (remote.incarnation != 0 && server.incarnation != remote.incarnation) {
    throw Error(StatusCode::ERR_NOT_FOUND,
                where + ": " + EngineRestartedMessage(remote.key, remote.incarnation, server.incarnation), 0,
                ErrorCause::kPeerRestarted);
  }
  return s;
}

Frame ControlClient::Call(FrameType type, const std::vector<uint8_t>& payload) {
  std::lock_guard<std::mutex> lk(mu_);
  const std::string where = "engine '" + remote_.key + "'";
  // The whole call, reconnects included, is bounded by one timeout: a hung
  // peer costs timeout_ms, not a multiple of it. Control requests are
  // idempotent lookups, so a connection that broke (a stale one after a peer
  // restart, or one reset mid-handshake by a flaky path) is retried on a
  // fresh one, a few times with a short backoff.
  constexpr int kAttempts = 4;
  const Deadline deadline = DeadlineAfterMs(timeout_ms_);
  int64_t backoff_ms = 2;
  std::string last_error = "timed out after " + std::to_string(timeout_ms_) + " ms";
  bool timed_out = true;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    if (attempt > 0) {
      if (MsLeft(deadline) <= backoff_ms + 1) break;
      if (attempt > 1) std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      backoff_ms *= 4;
    }
    if (!sock_.valid()) {
      try {
        sock_ = OpenEngineConnection(self_, remote_, ConnectionKind::Control, 0, MsLeft(deadline), secret_);
      } catch (const Error& e) {
        if (!IsPathError(e) || attempt + 1 == kAttempts) throw;
        continue;
      }
    }
    Frame reply;
    IoResult r = WriteFrame(sock_.fd(), type, payload, MsLeft(deadline));
    if (r.ok) r = ReadFrameBy(sock_.fd(), &reply, deadline);
    if (r.ok) {
      if (reply.type == FrameType::Error) throw DecodeErrorPayload(reply, where);
      return reply;
    }
    sock_.Close();
    last_error = r.error;
    timed_out = r.timed_out;
    if (timed_out) break;
  }
  throw Error(StatusCode::ERR_BAD_STATE, where + ": control request failed: " + last_error, 0,
              timed_out ? ErrorCause::kUnspecified : ErrorCause::kPathFailed);
}

void ControlClient::Close() {
  std::lock_guard<std::mutex> lk(mu_);
  sock_.Close();
}

}  // namespace mori_torch
