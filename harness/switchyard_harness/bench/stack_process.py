"""One service of a benchmark stack in a process of its own, as Switchyard runs in production.

``switchyard bench compare`` (``--stack processes``, the default) starts
retrieval, the dispatcher and the orchestrator each in its own process, the
way ``switchyard up`` and a Kubernetes deployment run them: one event loop and
one interpreter lock per service, so the orchestrator's CPU work and the
dispatcher's stream handling use different cores. A scenario's config reaches
the child as JSON (``SwitchyardConfig.model_dump_json``), so its overrides need
no config files.

Child: ``python -m switchyard_harness.bench.stack_process NAME CONFIG_JSON [--fixed-slots N]``
serves NAME on 127.0.0.1 port 0, prints one JSON line ``{"port": P,
"metrics_port": M}`` on stdout once it serves, logs to stderr, and stops
gracefully on SIGTERM, or when its stdin (a pipe from the parent) closes. ``--fixed-slots N`` gives the dispatcher's scheduler a
capacity of N running requests: the no-batching baseline
(:class:`switchyard_harness.testing.capacity.FixedSlots`),
never a product setting.

Parent: :func:`start` and :meth:`ServiceProcess.stop`; the parent measures
engine busy time and batch sizes across the process boundary by reading the
child's Prometheus metrics (:func:`switchyard_harness.top.read`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from switchyard.common.config import SwitchyardConfig
from switchyard_harness.testing.capacity import FixedSlots

START_TIMEOUT_S = 180.0
"""Longest a child may take to serve (the retrieval child loads the embedding model and the index)."""


# --------------------------------------------------------------------------- parent side


@dataclass
class ServiceProcess:
    """A running child: its gRPC address and metrics URL."""

    name: str
    proc: asyncio.subprocess.Process
    port: int
    metrics_port: int
    config_file: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    async def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (a graceful drain), then SIGKILL after ``timeout_s``; removes the config file."""
        try:
            if self.proc.returncode is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(self.proc.wait(), timeout_s)
                except TimeoutError:
                    self.proc.kill()
                    await self.proc.wait()
        finally:
            self.config_file.unlink(missing_ok=True)


async def start(name: str, config: SwitchyardConfig, fixed_slots: int = 0) -> ServiceProcess:
    """Start service ``name`` with ``config`` in a child process; returns once it serves. Cancelled meanwhile,
    it ends the child before it goes on (it was left starting, to serve on, or die writing to a closed pipe).

    Raises:
        RuntimeError: the child exited or did not serve within :data:`START_TIMEOUT_S` (its
            log, on this process's stderr, says why).
    """
    with tempfile.NamedTemporaryFile("w", suffix=f"-{name}.json", delete=False, encoding="utf-8") as f:
        f.write(config.model_dump_json())
    config_file = Path(f.name)
    argv = [sys.executable, "-m", "switchyard_harness.bench.stack_process", name, str(config_file)]
    if fixed_slots:
        argv += ["--fixed-slots", str(fixed_slots)]
    # stdin is a pipe the child watches: if this process dies without stopping it, the pipe
    # closes and the child stops itself rather than serving on as an orphan.
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        ready = json.loads(line) if line else None
    except (TimeoutError, json.JSONDecodeError):
        ready = None
    except BaseException:  # the caller stopped (cancelled: SIGTERM, Ctrl-C) while it started: so does the child
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        config_file.unlink(missing_ok=True)
        raise
    if not ready:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        config_file.unlink(missing_ok=True)
        raise RuntimeError(f"bench stack: {name} did not start (exit status {proc.returncode}); its log is above")
    return ServiceProcess(name, proc, int(ready["port"]), int(ready["metrics_port"]), config_file)


# --------------------------------------------------------------------------- child side


def _stop_when_parent_goes(loop: asyncio.AbstractEventLoop) -> None:
    """SIGTERM this process once stdin (a pipe from the parent) closes: the parent is gone.

    The signal is sent from the event loop, so it lands after :func:`serve_until_signal` has
    installed its handler (a graceful stop), however early the pipe closes.
    """
    import os
    import threading

    def watch() -> None:
        # os.read on the descriptor, not sys.stdin's buffered reader: a daemon thread blocked in the
        # reader holds its lock, and the interpreter aborts at exit when it cannot take it.
        while os.read(sys.stdin.fileno(), 65536):
            pass
        loop.call_soon_threadsafe(os.kill, os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


async def _serve(name: str, config: SwitchyardConfig, fixed_slots: int) -> None:
    from switchyard.common import process_metrics
    from switchyard.common.server import serve_until_signal, start_server
    from switchyard.serve import make_service, profile_endpoint

    service = make_service(name, config)
    if fixed_slots:
        service.scheduler.capacity = FixedSlots(fixed_slots)
    srv = await start_server([service], "127.0.0.1", 0, config.server)
    # as `switchyard serve` does: /debug/pprof/profile beside /metrics, so `switchyard profile` reads a bench's stack
    metrics_port = process_metrics.start_metrics_server(0, name, "127.0.0.1", profile=profile_endpoint(service, config))
    print(json.dumps({"port": srv.port, "metrics_port": metrics_port}), flush=True)
    _stop_when_parent_goes(asyncio.get_running_loop())
    await serve_until_signal(srv, config.server.shutdown_grace_s)


def main(argv: list[str]) -> int:
    import logging

    import uvloop

    parser = argparse.ArgumentParser(prog="python -m switchyard_harness.bench.stack_process")
    parser.add_argument("name", choices=["orchestrator", "retrieval", "dispatcher"])
    parser.add_argument("config_json", type=Path, help="the config, as SwitchyardConfig.model_dump_json() wrote it")
    parser.add_argument("--fixed-slots", type=int, default=0, help="dispatcher capacity of N requests (baseline)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"{args.name}: %(levelname)s %(name)s: %(message)s")
    config = SwitchyardConfig.model_validate_json(args.config_json.read_text(encoding="utf-8"))
    try:
        uvloop.run(_serve(args.name, config, args.fixed_slots))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
