// The fenced receive (core/net.h), which writes a peer's payload into
// registered memory: whole iovec lists arrive in order through receives
// capped at kFencedReceiveMax, and nothing more is received once the peer
// reset the connection. The read-ahead reader (core/socket_reader.h): the
// same byte stream whichever way it is split between buffer and socket,
// readiness without waiting, and the same fence for buffered bytes. The
// send-room bound of the TCP backend's inline path (tcp_inline.h).
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "backends/tcp/tcp_inline.h"
#include "core/net.h"
#include "core/socket_reader.h"

namespace mori_torch {
namespace {

struct Connection {
  Socket sender, receiver;
};

Connection Loopback() {
  int port = 0;
  Socket listener = Listen("127.0.0.1", 0, &port);
  Connection c;
  c.sender = Connect("127.0.0.1", port, 5000);
  c.receiver = Socket(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
  EXPECT_TRUE(c.receiver.valid());
  return c;
}

std::vector<uint8_t> Pattern(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 131 + 7 + i / 4099);
  return v;
}

std::vector<iovec> Slices(std::vector<uint8_t>& buf, const std::vector<size_t>& sizes) {
  std::vector<iovec> iov;
  size_t off = 0;
  for (size_t s : sizes) {
    iov.push_back({buf.data() + off, s});
    off += s;
  }
  return iov;
}

TEST(FencedReceiveTest, ReceivesIovecListsThatCrossTheCapInOrder) {
  Connection c = Loopback();
  // Entries below, across, at and far above the cap.
  const std::vector<size_t> sizes = {700 << 10, 700 << 10, (2 << 20) + 3, 1, kFencedReceiveMax, 5};
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  const std::vector<uint8_t> payload = Pattern(total);
  std::thread writer([&] {
    IoResult r = WriteFull(c.sender.fd(), payload.data(), total, IoDeadline(DeadlineAfterMs(20000)));
    EXPECT_TRUE(r.ok) << r.error;
  });
  std::vector<uint8_t> got(total);
  std::vector<iovec> iov = Slices(got, sizes);
  IoResult r = ReadVFullFenced(c.receiver.fd(), iov, IoDeadline(DeadlineAfterMs(20000)));
  writer.join();
  ASSERT_TRUE(r.ok) << r.error;
  EXPECT_EQ(got, payload);
}

TEST(FencedReceiveTest, OneReceiveTakesAtMostTheCapAndLeavesTheListAsItWas) {
  Connection c = Loopback();
  const std::vector<uint8_t> payload = Pattern(8192);
  ASSERT_TRUE(WriteFull(c.sender.fd(), payload.data(), payload.size(), IoDeadline(DeadlineAfterMs(5000))).ok);
  for (int i = 0; i < 200 && BytesReadable(c.receiver.fd()) < payload.size(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(BytesReadable(c.receiver.fd()), payload.size());
  std::vector<uint8_t> got(8192, 0);
  // Caps inside the second entry, at an entry's end, and past all entries.
  std::vector<iovec> iov = Slices(got, {1000, 3000, 4192});
  msghdr m{};
  m.msg_iov = iov.data();
  m.msg_iovlen = iov.size();
  ASSERT_EQ(RecvAtMost(c.receiver.fd(), &m, 2500), 2500);
  EXPECT_EQ(m.msg_iovlen, 3u);
  EXPECT_EQ(iov[1].iov_len, 3000u);  // restored
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 2500, payload.begin()));
  EXPECT_EQ(std::count(got.begin() + 2500, got.end(), 0), 8192 - 2500);
  std::vector<iovec> rest = {{got.data() + 2500, 1500}, {got.data() + 4000, 4192}};
  m.msg_iov = rest.data();
  m.msg_iovlen = rest.size();
  ASSERT_EQ(RecvAtMost(c.receiver.fd(), &m, 1500), 1500);  // the cap at an entry's end
  EXPECT_EQ(m.msg_iovlen, 2u);
  EXPECT_EQ(rest[1].iov_len, 4192u);
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + 4000, payload.begin()));
  std::vector<iovec> last = {{got.data() + 4000, 4192}};
  m.msg_iov = last.data();
  m.msg_iovlen = 1;
  ASSERT_EQ(RecvAtMost(c.receiver.fd(), &m, size_t{1} << 20), 4192);  // a cap past every entry
  EXPECT_EQ(got, payload);
}

TEST(FencedReceiveTest, ReceivesNothingOnceThePeerResetTheConnection) {
  Connection c = Loopback();
  const std::vector<uint8_t> payload = Pattern(64 << 10);
  ASSERT_TRUE(WriteFull(c.sender.fd(), payload.data(), payload.size(), IoDeadline(DeadlineAfterMs(5000))).ok);
  c.sender.Abort();  // queued bytes stay in the receiver's kernel; the reset is recorded at once
  ASSERT_TRUE(WaitReadable(c.receiver.fd(), 5000));
  for (int i = 0; i < 200 && !PeerAbandoned(c.receiver.fd()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(PeerAbandoned(c.receiver.fd()));
  std::vector<uint8_t> got(128 << 10, 0);
  std::vector<iovec> iov = Slices(got, {got.size()});
  IoResult r = ReadVFullFenced(c.receiver.fd(), iov, IoDeadline(DeadlineAfterMs(5000)));
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("fenced receive"), std::string::npos) << r.error;
  EXPECT_EQ(std::count(got.begin(), got.end(), 0), static_cast<long>(got.size()));  // nothing written
}

TEST(SocketReaderTest, OneStreamWhateverTheSplitBetweenBufferAndSocket) {
  Connection c = Loopback();
  const std::vector<uint8_t> payload = Pattern(60000);
  ASSERT_TRUE(WriteFull(c.sender.fd(), payload.data(), payload.size(), IoDeadline(DeadlineAfterMs(5000))).ok);
  SocketReader in(4096);
  in.Attach(c.receiver.fd());
  ASSERT_TRUE(WaitReadable(c.receiver.fd(), 5000));
  ASSERT_GT(in.FillNow(), 0);
  EXPECT_EQ(in.buffered(), 4096u) << "one recv fills the buffer";
  EXPECT_EQ(std::vector<uint8_t>(in.data(), in.data() + 8), std::vector<uint8_t>(payload.begin(), payload.begin() + 8));
  // More than the buffer holds is ready now: queued in the socket (FIONREAD).
  EXPECT_TRUE(in.Ready(20000));
  std::vector<uint8_t> got(payload.size());
  // A small read from the buffer, an iovec list across it and the socket,
  // a discard across both, then the rest.
  const IoDeadline d(DeadlineAfterMs(5000));
  ASSERT_TRUE(in.ReadFull(got.data(), 10, d).ok);
  std::vector<iovec> iov = Slices(got, {10, 4000, 200, 5000});
  iov.erase(iov.begin());
  ASSERT_TRUE(in.ReadVFull(iov, d).ok);
  ASSERT_TRUE(in.FillNow() > 0);
  const size_t skipped_at = 9210, skip = 7000;
  ASSERT_TRUE(in.Discard(skip, d).ok);
  std::fill(got.begin() + skipped_at, got.begin() + skipped_at + skip, 0);
  ASSERT_TRUE(in.ReadFull(got.data() + skipped_at + skip, got.size() - skipped_at - skip, d).ok);
  std::vector<uint8_t> want = payload;
  std::fill(want.begin() + skipped_at, want.begin() + skipped_at + skip, 0);
  EXPECT_EQ(got, want);
  EXPECT_EQ(in.buffered(), 0u);
  EXPECT_EQ(in.FillNow(), 0) << "nothing queued";
  EXPECT_TRUE(in.drained());
  EXPECT_FALSE(in.Ready(1));
  c.sender.Close();
  ASSERT_TRUE(WaitReadable(c.receiver.fd(), 5000));
  EXPECT_EQ(in.FillNow(), -1) << "the peer closed";
  EXPECT_FALSE(in.drained());
}

// drained() vouches for the socket only until it is read directly or a new
// readiness event comes: a stale "drained" re-arms a level-triggered watch
// with bytes queued, which fires again at once, for ever.
TEST(SocketReaderTest, DrainedIsForgottenOnceTheSocketIsReadOrANewEventComes) {
  Connection c = Loopback();
  const IoDeadline d(DeadlineAfterMs(5000));
  SocketReader in(4096);
  in.Attach(c.receiver.fd());
  const std::vector<uint8_t> first = Pattern(100);
  ASSERT_TRUE(WriteFull(c.sender.fd(), first.data(), 10, d).ok);
  ASSERT_TRUE(WaitReadable(c.receiver.fd(), 5000));
  EXPECT_FALSE(in.Ready(100)) << "10 of 100 bytes";
  EXPECT_FALSE(in.Ready(100)) << "and nothing more queued";
  EXPECT_EQ(in.buffered(), 10u);
  // The rest of the message comes and is read past the buffer.
  ASSERT_TRUE(WriteFull(c.sender.fd(), first.data() + 10, 90, d).ok);
  std::vector<uint8_t> got(100);
  ASSERT_TRUE(in.ReadFull(got.data(), got.size(), d).ok);
  EXPECT_EQ(got, first);
  EXPECT_FALSE(in.drained()) << "read directly since the empty FillNow";
  ASSERT_EQ(in.FillNow(), 0);
  EXPECT_TRUE(in.drained());
  in.NewEvent();
  EXPECT_FALSE(in.drained());
  ASSERT_EQ(in.FillNow(), 0);
  ASSERT_TRUE(in.drained());
  ASSERT_TRUE(WriteFull(c.sender.fd(), first.data(), 5, d).ok);
  ASSERT_TRUE(in.Discard(5, d).ok);
  EXPECT_FALSE(in.drained()) << "a discard reads the socket";
}

// A reset that the read-ahead's recv takes from the socket (which clears it
// there) is what the next read reports, not a plain close.
TEST(SocketReaderTest, AResetTakenByTheReadAheadIsReportedAsSuch) {
  Connection c = Loopback();
  SocketReader in(4096);
  in.Attach(c.receiver.fd());
  c.sender.Abort();
  ASSERT_TRUE(WaitReadable(c.receiver.fd(), 5000));
  ASSERT_EQ(in.FillNow(), -1);
  char b[8];
  IoResult r = in.ReadFull(b, sizeof(b), IoDeadline(DeadlineAfterMs(5000)));
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find(std::strerror(ECONNRESET)), std::string::npos) << r.error;
}

TEST(SocketReaderTest, BufferedBytesAreFencedLikeTheSocketsOnes) {
  Connection c = Loopback();
  const std::vector<uint8_t> payload = Pattern(64 << 10);
  ASSERT_TRUE(WriteFull(c.sender.fd(), payload.data(), payload.size(), IoDeadline(DeadlineAfterMs(5000))).ok);
  SocketReader in(16 << 10);
  in.Attach(c.receiver.fd());
  ASSERT_TRUE(WaitReadable(c.receiver.fd(), 5000));
  ASSERT_GT(in.FillNow(), 0);
  ASSERT_GT(in.buffered(), 0u);
  c.sender.Abort();
  for (int i = 0; i < 200 && !PeerAbandoned(c.receiver.fd()); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(PeerAbandoned(c.receiver.fd()));
  std::vector<uint8_t> got(payload.size(), 0);
  std::vector<iovec> iov = Slices(got, {got.size()});
  IoResult r = in.ReadVFullFenced(iov, IoDeadline(DeadlineAfterMs(5000)));
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("fenced receive"), std::string::npos) << r.error;
  EXPECT_EQ(std::count(got.begin(), got.end(), 0), static_cast<long>(got.size()));  // nothing written
}

TEST(SendRoomTest, WhatFitsIsSentWithoutWaitingAndItSaysNoOnceTheBufferIsFull) {
  Connection c = Loopback();
  SetBufferSizes(c.sender.fd(), 64 << 10, 0);
  SetBufferSizes(c.receiver.fd(), 0, 64 << 10);
  tcp::SendRoom room;
  room.Attach(c.sender.fd());
  // The receiver never reads: its window fills, then the sender's queue.
  const std::vector<char> msg(4096, 'x');
  size_t sent = 0;
  while (room.Fits(msg.size())) {
    // Fits: one non-blocking send takes all of it.
    ASSERT_EQ(::send(c.sender.fd(), msg.data(), msg.size(), MSG_DONTWAIT), static_cast<ssize_t>(msg.size()))
        << "after " << sent << " bytes";
    room.Wrote(msg.size());
    sent += msg.size();
    ASSERT_LT(sent, size_t{64} << 20) << "never said no";
  }
  int sndbuf = 0;
  socklen_t len = sizeof(sndbuf);
  ASSERT_EQ(::getsockopt(c.sender.fd(), SOL_SOCKET, SO_SNDBUF, &sndbuf, &len), 0);
  EXPECT_GT(BytesUnsent(c.sender.fd()) + msg.size(), static_cast<size_t>(sndbuf) / 2) << "said no with room left";
  EXPECT_GT(sent, static_cast<size_t>(sndbuf) / 2) << "the receiver's window took some too";
}

}  // namespace
}  // namespace mori_torch
