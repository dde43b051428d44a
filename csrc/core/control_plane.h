// The engine's one TCP listener. Every connection opens with a Hello frame
// naming its kind: control connections then exchange request/reply frames;
// data connections are handed to the backend they name and leave framing.
// Each connection runs on its own thread, owned and joined by the server.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/descriptors.h"
#include "core/frame.h"
#include "core/net.h"
#include "core/peer_auth.h"

namespace mori_torch {

struct ControlPlaneOptions {
  // A frame, once started, must arrive whole within this time.
  int frame_timeout_ms = 5000;
  // A new connection must send its Hello within this time.
  int hello_timeout_ms = 5000;
  // Shared secret peers must prove (peer_auth.h); "" accepts anyone.
  std::string secret;
};

// The Hello frame that opens every connection.
struct Hello {
  ConnectionKind kind = ConnectionKind::Control;
  uint8_t backend = 0;
  EngineDesc peer;  // the connecting engine, as it claims (bound by the proof)
  auth::HelloAuth auth;
};

class ControlPlaneDelegate {
 public:
  virtual ~ControlPlaneDelegate() = default;
  virtual const EngineDesc& SelfDesc() const = 0;
  // Control request -> reply frame. Returning false closes the connection.
  virtual bool HandleControl(const EngineDesc& peer, const Frame& request, Frame* reply) = 0;
  // "" if a data connection for `backend` can be served, else why not.
  virtual std::string CanServeData(uint8_t backend) = 0;
  // Serves a data connection until it ends (runs on the connection's thread).
  virtual void ServeData(uint8_t backend, const EngineDesc& peer, Socket& sock) = 0;
};

class ControlPlaneServer {
 public:
  ControlPlaneServer(ControlPlaneDelegate* delegate, ControlPlaneOptions opts);
  ~ControlPlaneServer();
  // Binds host:port (port 0 picks a free one) and starts accepting.
  int Start(const std::string& host, int port);
  // Stops accepting, wakes and joins every connection thread. Idempotent.
  void Stop();
  size_t ConnectionCount();

 private:
  struct Conn {
    Socket sock;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void AcceptLoop();
  void Serve(Conn* c);
  // "" when the Hello's engine may be served: it proved the secret (or
  // neither side has one); else why not.
  std::string Authenticate(int fd, const Hello& hello, const std::vector<uint8_t>& hello_bytes);
  void ReapFinished();

  ControlPlaneDelegate* delegate_;
  ControlPlaneOptions opts_;
  Socket listener_;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::list<std::unique_ptr<Conn>> conns_;
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
std::vector<uint8_t> EncodeHello(ConnectionKind kind, uint8_t backend, const EngineDesc& self,
                                 const auth::HelloAuth& auth = {});
// Throws Error (ERR_INVALID_ARGS) naming what is malformed.
Hello ParseHello(const uint8_t* payload, size_t n);

}  // namespace mori_torch
