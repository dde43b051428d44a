"""Kills established TCP sockets with `ss -K` (SOCK_DESTROY), as a flaky
network or a restarted NIC would: the socket is torn down in the kernel and
its peer gets a reset. Needs root (or CAP_NET_ADMIN) and a kernel with
CONFIG_INET_DIAG_DESTROY; `supported()` says whether this machine has both."""
import random
import shutil
import socket
import subprocess
import threading
import time


def kill(port: int) -> int:
    """Destroys every established socket whose local or remote port is
    `port` (both ends of each connection to the engine listening there).
    Returns how many were killed."""
    r = subprocess.run(["ss", "-K", "-t", "-n", "state", "established", f"( sport = :{port} or dport = :{port} )"],
                       capture_output=True, text=True)
    # ss lists what it killed, after one header line.
    return max(0, len(r.stdout.strip().splitlines()) - 1)


def supported() -> bool:
    if not shutil.which("ss"):
        return False
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    c = socket.create_connection(("127.0.0.1", port))
    a, _ = srv.accept()
    try:
        kill(port)
        c.settimeout(2)
        try:
            c.send(b"x")
            c.recv(1)
        except OSError:
            return True
        return False
    finally:
        for s in (c, a, srv):
            s.close()


def kill_after(port: int, delay_s: float) -> threading.Thread:
    """Kills the connections of the engine on `port` once, `delay_s` from
    now (plus the ~ms `ss` takes to start), in a thread; join it."""
    t = threading.Thread(target=lambda: (time.sleep(delay_s), kill(port)), daemon=True)
    t.start()
    return t


class Killer:
    """Kills the connections of the engine on `port` every `period_s`
    (uniformly jittered by half), in a thread, until stopped."""

    def __init__(self, port: int, period_s: float, seed: int = 0):
        self.port, self.period_s = port, period_s
        self.kills = 0
        self.rounds = 0
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.period_s * self._rng.uniform(0.5, 1.5)):
            self.kills += kill(self.port)
            self.rounds += 1

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False
