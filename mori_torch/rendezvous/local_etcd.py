"""Runs an etcd server on free loopback ports in a scratch data directory:
for tests, benchmarks and trying the etcd directory on one machine. Uses the
`etcd` binary on PATH (Debian: `apt-get install etcd-server`)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """``start()``, ``kill()`` (as a crash: SIGKILL) and ``start(fresh=True)``
    (a restart that lost its data); ``endpoint`` is the client URL. ``close()``
    (and leaving a ``with`` block) kills the server and removes the scratch
    directory and log it made; a ``data_dir`` the caller gave is left alone."""

    def __init__(self, data_dir: Optional[str] = None):
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise RuntimeError("no etcd binary on PATH: install Debian's etcd-server (scripts/setup.sh does)")
        self.owns_data_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="mori-etcd-")
        self.log_path = self.data_dir.rstrip("/") + ".log"
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self, fresh: bool = False, timeout_s: float = 30.0) -> "LocalEtcd":
        if fresh:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, "--name", "mori", "--data-dir", self.data_dir, "--listen-client-urls", self.endpoint,
                 "--advertise-client-urls", self.endpoint, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", f"mori={peer}"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.endpoint + "/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"etcd did not become healthy at {self.endpoint} within {timeout_s:g}s; "
                           f"see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def close(self) -> None:
        self.kill()
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            try:
                os.unlink(self.log_path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
