"""A redis-server the test owns: start, SIGKILL, SIGSTOP/SIGCONT, restart empty on one port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """One ``redis-server`` on ``port`` (no persistence: a restart comes back empty)."""

    def __init__(self, workdir, port: int | None = None) -> None:
        self.workdir, self.port = str(workdir), port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProcess":
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed: run scripts/test.sh, which installs it"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.workdir],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not listen on {self.port} within 10 s")

    def kill(self) -> None:
        """SIGKILL and reap (its data is gone)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        """SIGSTOP: it keeps its connections but answers nothing (hung)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            self.cont()
            self.kill()
