// Caps on inbound connections, counted from accept() to close: all of an
// engine's, those of one source address still in their handshake (before the
// peer said who it is), and those of one peer engine once it did. A
// connection holds a ticket; the counts drop when the ticket is destroyed.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

namespace mori_torch {

struct ConnectionCaps {
  int max_connections = 1024;          // inbound, whole engine
  int max_handshaking_per_ip = 64;     // accepted, not yet through the Hello
  int max_connections_per_peer = 192;  // per peer engine key (data + control)
};

class ConnectionLimits;

class ConnectionTicket {
 public:
  ~ConnectionTicket();
  ConnectionTicket(const ConnectionTicket&) = delete;
  ConnectionTicket& operator=(const ConnectionTicket&) = delete;
  const std::string& ip() const { return ip_; }

 private:
  friend class ConnectionLimits;
  ConnectionTicket(std::shared_ptr<ConnectionLimits> owner, std::string ip)
      : owner_(std::move(owner)), ip_(std::move(ip)) {}
  std::shared_ptr<ConnectionLimits> owner_;
  std::string ip_;
  std::string peer_;  // "" while handshaking
};

class ConnectionLimits : public std::enable_shared_from_this<ConnectionLimits> {
 public:
  explicit ConnectionLimits(ConnectionCaps caps) : caps_(caps) {}
  // A ticket for a new connection from `ip`, or nullptr (with *why) when a cap
  // is reached.
  std::unique_ptr<ConnectionTicket> Admit(const std::string& ip, std::string* why);
  // The handshake named the peer: moves the ticket from its address's
  // handshaking count to the peer's. False (with *why) when the peer is at
  // its cap.
  bool BindPeer(ConnectionTicket& t, const std::string& peer_key, std::string* why);
  int Open();
  uint64_t Refused() const;

 private:
  friend class ConnectionTicket;
  void Release(ConnectionTicket& t);

  const ConnectionCaps caps_;
  mutable std::mutex mu_;
  int open_ = 0;
  uint64_t refused_ = 0;
  std::unordered_map<std::string, int> handshaking_;
  std::unordered_map<std::string, int> per_peer_;
};

}  // namespace mori_torch
