#include "core/connection_limits.h"

namespace mori_torch {

ConnectionTicket::~ConnectionTicket() { owner_->Release(*this); }

std::unique_ptr<ConnectionTicket> ConnectionLimits::Admit(const std::string& ip, std::string* why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (open_ >= caps_.max_connections) {
    ++refused_;
    *why = "the engine has " + std::to_string(open_) + " connections open (max_connections " +
           std::to_string(caps_.max_connections) + ")";
    return nullptr;
  }
  int& hs = handshaking_[ip];
  if (hs >= caps_.max_handshaking_per_ip) {
    ++refused_;
    *why = std::to_string(hs) + " connections from " + ip + " have not completed their handshake (max " +
           std::to_string(caps_.max_handshaking_per_ip) + ")";
    return nullptr;
  }
  ++hs;
  ++open_;
  return std::unique_ptr<ConnectionTicket>(new ConnectionTicket(shared_from_this(), ip));
}

bool ConnectionLimits::BindPeer(ConnectionTicket& t, const std::string& peer_key, std::string* why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!t.peer_.empty()) return true;
  int& n = per_peer_[peer_key];
  if (n >= caps_.max_connections_per_peer) {
    if (n == 0) per_peer_.erase(peer_key);
    ++refused_;
    *why = "engine '" + peer_key + "' has " + std::to_string(n) + " connections open (max_connections_per_peer " +
           std::to_string(caps_.max_connections_per_peer) + ")";
    return false;
  }
  ++n;
  t.peer_ = peer_key;
  auto it = handshaking_.find(t.ip_);
  if (it != handshaking_.end() && --it->second <= 0) handshaking_.erase(it);
  return true;
}

void ConnectionLimits::Release(ConnectionTicket& t) {
  std::lock_guard<std::mutex> lk(mu_);
  --open_;
  auto& counts = t.peer_.empty() ? handshaking_ : per_peer_;
  auto it = counts.find(t.peer_.empty() ? t.ip_ : t.peer_);
  if (it != counts.end() && --it->second <= 0) counts.erase(it);
}

int ConnectionLimits::Open() {
  std::lock_guard<std::mutex> lk(mu_);
  return open_;
}

uint64_t ConnectionLimits::Refused() const {
  std::lock_guard<std::mutex> lk(mu_);
  return refused_;
}

}  // namespace mori_torch
