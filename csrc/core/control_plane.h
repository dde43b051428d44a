// The engine's one TCP listener, served by the engine's event loop (no
// thread per connection). A connection's life:
//   accepted (caps checked per engine and per source address)
//   -> Hello frame read as its bytes arrive (hello_timeout_ms)
//   -> [handshake stage: EstablishConnection(); peer authentication hooks in here]
//   -> HelloAck, then serving: control connections exchange request/reply
//      frames (handled on a small worker pool, idle ones closed after
//      idle_timeout_ms); data connections are handed to the backend they name.
// Out of file descriptors, accept() drops the connection it cannot take (a
// reserved descriptor makes room to accept and close it) and goes on.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/connection_limits.h"
#include "core/descriptors.h"
#include "core/event_loop.h"
#include "core/frame.h"
#include "core/net.h"
#include "core/peer_auth.h"

namespace mori_torch {

struct ControlPlaneOptions {
  // A frame, once started, must arrive whole within this time.
  int frame_timeout_ms = 5000;
  // A new connection must send its Hello within this time.
  int hello_timeout_ms = 5000;
  // An established connection with no traffic for this long is closed (its
  // initiator reopens it when needed); -1: never.
  int idle_timeout_ms = 300000;
  ConnectionCaps caps;
  // Threads that run control requests (some wait on backends).
  int handler_threads = 2;
  // Shared secret peers must prove (peer_auth.h); "" accepts anyone.
  std::string secret;
};

// An inbound data connection handed to a backend: the socket, the ticket
// that counts it against the caps (drop it with the socket), and how long it
// may stay idle.
struct InboundConnection {
  Socket sock;
  std::unique_ptr<ConnectionTicket> ticket;
  int idle_timeout_ms = -1;
};

class ControlPlaneDelegate {
 public:
  virtual ~ControlPlaneDelegate() = default;
  virtual const EngineDesc& SelfDesc() const = 0;
  // Control request -> reply frame. Returning false closes the connection.
  // `peer_ip`: the connection's source address.
  virtual bool HandleControl(const EngineDesc& peer, const std::string& peer_ip, const Frame& request,
                             Frame* reply) = 0;
  // "" if a data connection for `backend` can be served, else why not.
  virtual std::string CanServeData(uint8_t backend) = 0;
  // Takes a data connection to serve on the event loop; false if the backend
  // serves its connections with blocking calls instead (ServeData).
  virtual bool AdoptData(uint8_t backend, const EngineDesc& peer, InboundConnection& conn) = 0;
  // Serves a data connection until it ends (on a thread of its own).
  virtual void ServeData(uint8_t backend, const EngineDesc& peer, Socket& sock) = 0;
};

class ControlPlaneServer {
 public:
  ControlPlaneServer(ControlPlaneDelegate* delegate, ControlPlaneOptions opts, EventLoop* loop);
  ~ControlPlaneServer();
  // Binds host:port (port 0 picks a free one) and starts accepting.
  int Start(const std::string& host, int port);
  // Stops accepting, closes every connection it serves. Idempotent.
  void Stop();
  // Connections served here (handshaking or control; blocking data ones).
  size_t ConnectionCount();
  // Inbound connections open, wherever served (backends' data ones too).
  int OpenConnections() { return limits_->Open(); }
  // Connections refused by a cap, or dropped for want of file descriptors.
  uint64_t RefusedConnections() const { return limits_->Refused() + fd_drops_.load(); }

 private:
  // kAuth: the AuthChallenge is out, the peer's AuthProof awaited.
  enum class Stage { kHello, kAuth, kServing };
  struct Conn {
    Socket sock;
    std::unique_ptr<ConnectionTicket> ticket;
    Stage stage = Stage::kHello;
    EngineDesc peer;  // as claimed until the handshake stage passed
    ConnectionKind kind = ConnectionKind::Control;
    uint8_t backend = 0;
    std::unique_ptr<auth::ServerHandshake> handshake;
    FrameReader reader;
    int64_t hello_deadline_ms = 0;
    int64_t frame_started_ms = -1;
  };
  using ConnPtr = std::shared_ptr<Conn>;
  struct BlockingData {  // a backend that serves with blocking calls (RDMA)
    Socket sock;
    std::unique_ptr<ConnectionTicket> ticket;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void OnAcceptable(uint32_t events);
  void AcceptOne(int fd, const std::string& ip);
  // Out of descriptors: accepts and closes one pending connection through
  // the reserved descriptor. False when even that failed (accepting pauses).
  bool DropOnePending();
  void OnConnEvent(const ConnPtr& c, uint32_t events);
  void HandleFrame(const ConnPtr& c, Frame f);
  // Hello -> handshake stage (AuthChallenge, then the peer's AuthProof in
  // VerifyProof) -> HelloAck. False closes the connection.
  bool EstablishConnection(const ConnPtr& c, const Frame& hello);
  bool VerifyProof(const ConnPtr& c, const Frame& proof);
  // The handshake stage passed (or needs no proof): HelloAck, then serving.
  bool Admit(const ConnPtr& c);
  // Writes the refusal, logs it; always false.
  bool Refuse(const ConnPtr& c, StatusCode code, const std::string& why);
  void Rearm(const ConnPtr& c);
  void CloseConn(const ConnPtr& c, const std::string& why);
  void HandOffData(const ConnPtr& c, uint8_t backend);
  void Housekeeping();

  ControlPlaneDelegate* delegate_;
  const ControlPlaneOptions opts_;
  EventLoop* loop_;
  std::shared_ptr<ConnectionLimits> limits_;
  WorkerPool handlers_;
  Socket listener_;
  std::atomic<int> listen_fd_{-1};  // for housekeeping, which may run while Stop() closes it
  int reserve_fd_ = -1;
  std::atomic<bool> accept_paused_{false};
  std::atomic<uint64_t> fd_drops_{0};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::unordered_map<int, ConnPtr> conns_;
  std::list<std::unique_ptr<BlockingData>> blocking_;
};

// Opens a connection of `kind` to a remote engine and completes the Hello
// exchange, with the mutual proof of `secret` when it is not "". Checks the
// server's key and incarnation against `remote` (a restarted engine is
// ERR_NOT_FOUND "engine restarted"). Throws Error.
Socket OpenEngineConnection(const EngineDesc& self, const EngineDesc& remote, ConnectionKind kind, uint8_t backend,
                            int timeout_ms, const std::string& secret = "");

// Request/reply client for one remote engine's control plane; serialized.
class ControlClient {
 public:
  ControlClient(EngineDesc self, EngineDesc remote, int timeout_ms, std::string secret = "")
      : self_(std::move(self)), remote_(std::move(remote)), timeout_ms_(timeout_ms), secret_(std::move(secret)) {}
  // Sends a request and returns the reply; an Error reply becomes a thrown
  // Error carrying the remote code and message. Reconnects once on failure.
  Frame Call(FrameType type, const std::vector<uint8_t>& payload);
  void Close();

 private:
  EngineDesc self_, remote_;
  int timeout_ms_;
  const std::string secret_;
  std::mutex mu_;
  Socket sock_;
};

std::vector<uint8_t> EncodeErrorPayload(StatusCode code, const std::string& msg);
// The Error an Error frame carries, its message prefixed with `where`.
Error DecodeErrorPayload(const Frame& f, const std::string& where);
// Payload of the Hello frame that opens every connection.
std::vector<uint8_t> EncodeHello(ConnectionKind kind, uint8_t backend, const EngineDesc& self,
                                 const auth::HelloAuth& auth = {});
struct Hello {
  ConnectionKind kind = ConnectionKind::Control;
  uint8_t backend = 0;
  EngineDesc peer;  // the connecting engine, as it claims (bound by the proof)
  auth::HelloAuth auth;
};
// Decodes a Hello frame; throws Error(ERR_INVALID_ARGS) naming what is wrong.
Hello DecodeHello(const Frame& f);

}  // namespace mori_torch
