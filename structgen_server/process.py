"""`ServerProcess`: run `python -m structgen_server` as a child process on a free loopback port
and wait until it is healthy. Tests and benchmarks use it to exercise the real server."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

# A child server started with this variable set to its parent's pid stops when that parent is
# gone, however it went (a data-parallel front end killed outright leaves no replica behind).
PARENT_PID_ENV = "STRUCTGEN_PARENT_PID"
PARENT_POLL_S = 0.5


def exit_with_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Watch, from a daemon thread, that this process's parent is still `parent_pid`; once it
    is not (the parent died and the process was re-parented), send this process SIGTERM, which
    the server takes as a graceful stop."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (an IPv4 or IPv6 address, or a name)."""
    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cap_address_space(pid: int, headroom: int) -> int:
    """Cap process `pid`'s virtual memory (RLIMIT_AS) at its current size plus `headroom`
    bytes and return the cap. Relative, not absolute: what a started server maps depends on the
    host (a 16-core GPU host's CUDA libraries and per-thread malloc arenas held more than the 6
    GiB a 2-core CPU host's cap allowed, and every request failed)."""
    with open(f"/proc/{pid}/status") as status:
        size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    cap = size_kb * 1024 + headroom
    resource.prlimit(pid, resource.RLIMIT_AS, (cap, cap))
    return cap


class ServerProcess:
    """`with ServerProcess(["--device", "cpu"]) as server: server.url` (".../v1").

    The server's output goes to `log_path`; a server that exits or stays unhealthy for
    `startup_timeout` seconds raises with that path in the message. `env` adds environment
    variables; `address_space_headroom` caps the process's virtual memory (RLIMIT_AS) at what
    it holds once healthy plus that many bytes (`cap_address_space`), so a request that would
    take the host's memory fails inside the server instead."""

    def __init__(
        self,
        args: list[str] | None = None,
        host: str = "127.0.0.1",
        startup_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        address_space_headroom: int | None = None,
    ):
        self.host = host
        self.port = free_port(host)
        self.args = list(args or [])
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, **(env or {})}
        self.address_space_headroom = address_space_headroom
        self.log_path = Path(tempfile.gettempdir()) / f"structgen-server-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.root}/v1"

    def start(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "structgen_server", "--host", self.host, "--port", str(self.port), *self.args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.root}/health", timeout=1).status_code == 200:
                    if self.address_space_headroom is not None:
                        cap_address_space(self.proc.pid, self.address_space_headroom)
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {self.startup_timeout:.0f} s; see {self.log_path}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
