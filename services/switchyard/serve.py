"""``switchyard serve NAME``: run one service in this process until SIGTERM/SIGINT.

NAME is orchestrator, retrieval or dispatcher (gRPC services), or sim-openai
(the OpenAI-compatible test server of the harness, ``switchyard_harness.sim_openai``,
which takes its own options).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import os
import sys
from typing import Callable

import uvloop

from switchyard.common import outputs
from switchyard.common.auth import TokenGuarded
from switchyard.common.config import (ConfigError, DispatcherConfig, OrchestratorConfig, RetrievalConfig,
                                      SwitchyardConfig, load_config)
from switchyard.common.logs import setup_logging
from switchyard.common.server import Service, serve_until_signal, start_server
from switchyard.common.cli_text import parser_for

log = logging.getLogger(__name__)

GC_GEN0_THRESHOLD = 7000
"""Allocations (net of frees) that start a collection of the youngest generation once a service serves:
ten times CPython's 700, so a loaded loop collects a tenth as often (each collection scans only what is
new since the last, so they take longer by less than that)."""


def freeze_startup_heap() -> None:
    """Once a service is up: collect once, then move everything alive (modules, config, the compiled
    protos, clients, index and model handles) to the permanent generation, so that no later collection
    scans it again (``gc.freeze``), and raise the youngest generation's threshold to
    :data:`GC_GEN0_THRESHOLD`. What start-up built lives as long as the process; the full collections a
    loaded service runs otherwise scan all of it each time (measured under the reference submit load: the
    orchestrator paused 556 ms of 8 s in 127 collections)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


def _orchestrator(config: SwitchyardConfig) -> Service:
    from switchyard.orchestrator.service import OrchestratorService

    return OrchestratorService(config)


def _retrieval(config: SwitchyardConfig) -> Service:
    from switchyard.retrieval.service import RetrievalService

    return RetrievalService(config)


def _dispatcher(config: SwitchyardConfig) -> Service:
    from switchyard.dispatcher.service import DispatcherService

    return DispatcherService(config)


SERVICES: dict[str, Callable[[SwitchyardConfig], Service]] = {
    "orchestrator": _orchestrator,
    "retrieval": _retrieval,
    "dispatcher": _dispatcher,
}
"""Each service's constructor; a service's module is imported only when it is made (the dispatcher's engines,
retrieval's model are not loaded by the others)."""


def make_service(name: str, config: SwitchyardConfig) -> Service:
    """Construct the service called ``name`` (a key of :data:`SERVICES`)."""
    return SERVICES[name](config)


def service_section(config: SwitchyardConfig, name: str) -> OrchestratorConfig | RetrievalConfig | DispatcherConfig:
    """The config section of the service called ``name`` (a key of :data:`SERVICES`): its ports.

    Raises:
        KeyError: ``name`` is not a service.
    """
    if name == "orchestrator":
        return config.orchestrator
    if name == "retrieval":
        return config.retrieval
    if name == "dispatcher":
        return config.dispatcher
    raise KeyError(name)


def write_port_file(path: str, port: int, metrics_port: int, http_port: int | None = None) -> None:
    """Write ``{"pid", "port", "metrics_port", "http_port"}`` to ``path`` (a temporary name, then a rename: a reader never
    sees half of it). The ports are the ones this process bound, so a caller that asked for port 0 learns them
    without a race between picking a port and binding it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"pid": os.getpid(), "port": port, "metrics_port": metrics_port, "http_port": http_port}, handle)
    os.replace(tmp, path)


def _faces(name: str, service: Service, config: SwitchyardConfig) -> list[Service]:
    """The service, and beside the orchestrator its HTTP face (``orchestrator.http``), started after it and
    stopped before it."""
    if name != "orchestrator" or not config.orchestrator.http.enabled:
        return [service]
    from switchyard.orchestrator.http_face import HttpFace

    return [service, HttpFace(service, config)]


def profile_endpoint(service: Service, config: SwitchyardConfig):
    """``/debug/pprof/profile`` of this process's event loop (common/profiling.py), None with
    ``server.cpu_profile = off``; behind the service's bearer tokens where it checks them."""
    import asyncio

    from switchyard.common.profiling import LoopProfiler, ProfileEndpoint

    server = config.server
    if server.cpu_profile == "off":
        return None
    tokens = service.bearer_tokens() if isinstance(service, TokenGuarded) else None
    return ProfileEndpoint(LoopProfiler(asyncio.get_running_loop()), server.cpu_profile, server.host,
                           server.cpu_profile_max_s, tokens)


async def serve(name: str, config: SwitchyardConfig, port_file: str | None = None) -> None:
    """Start ``name`` on its configured port with tracing and metrics; return after a graceful stop.

    With ``port_file``, the bound ports are written there once both are bound (:func:`write_port_file`)."""
    from switchyard.common import process_metrics, telemetry

    shutdown_tracing = telemetry.setup_tracing(name)
    section = service_section(config, name)
    try:
        service = make_service(name, config)
        faces = _faces(name, service, config)
        # The metrics port first: bound after the gRPC server had started, a taken one left that server to be
        # collected after the loop closed ("Exception ignored ... Event loop is closed" under the refusal).
        metrics_port = process_metrics.start_metrics_server(section.metrics_port, name, config.server.host,
                                                            profile=profile_endpoint(service, config))
        srv = await start_server(
            faces, config.server.host, section.port, config.server,
            interceptors=telemetry.server_interceptors(), health_port=section.health_port,
        )
        lag_monitor = process_metrics.start_loop_lag_monitor()
        freeze_startup_heap()
        log.info("%s ready on %s:%d (metrics on port %d)", name, config.server.host, srv.port, metrics_port)
        if port_file:
            http_port = next((face.port for face in faces if face is not service), None)
            write_port_file(port_file, srv.port, metrics_port, http_port)
        try:
            await serve_until_signal(srv, config.server.shutdown_grace_s)
        finally:
            lag_monitor.cancel()
    finally:
        shutdown_tracing()
        log.info("%s: tracing flushed; exiting", name)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "sim-openai":
        from switchyard.cli import HarnessMissing, harness_module

        try:
            sim_openai = harness_module("switchyard_harness.sim_openai", "switchyard serve sim-openai")
        except HarnessMissing as exc:
            print(exc, file=sys.stderr)
            return 1
        return int(sim_openai.main(argv[1:]) or 0)
    parser = parser_for("switchyard serve", __doc__)
    parser.add_argument("name", choices=[*SERVICES, "sim-openai"])
    parser.add_argument("--config-dir", help="config folder (default: $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--port", type=int, help="gRPC port (0 = any free port); overrides the config")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (0 = any free port)")
    parser.add_argument("--health-port", type=int,
                        help="plain-text health-only port (0 = any free port); overrides <service>.health_port")
    parser.add_argument("--port-file", help="write the bound ports here as JSON once serving (for switchyard up)")
    parser.add_argument("--http-port", type=int,
                        help="orchestrator: port of the HTTP face (0 = any free port); overrides orchestrator.http.port")
    args = parser.parse_args(argv)
    # checked before the service starts (a folder there too): it failed once serving, naming no option
    if args.port_file is not None and (problem := outputs.unwritable(args.port_file)):
        parser.error(f"--port-file: expected a path in a folder this user can write, got {args.port_file!r} "
                     f"({problem})")
    # A fatal signal (SIGSEGV, SIGBUS: a memory-mapped SQLite index whose file went away) prints every thread's
    # stack to stderr, the service's log, instead of a silent exit.
    faulthandler.enable()
    from switchyard.common.telemetry import check_tracing_environment

    try:
        setup_logging(args.name)  # a bad SWITCHYARD_LOG_LEVEL is refused here, as a bad override is below
        check_tracing_environment()  # a bad OTEL_* value: refused here, not warned about once serving
        config = load_config(args.config_dir, service=args.name)  # only the sections it reads
        overrides, options = {}, {}
        for option, key, value in (("--port", f"{args.name}.port", args.port),
                                   ("--metrics-port", f"{args.name}.metrics_port", args.metrics_port),
                                   ("--health-port", f"{args.name}.health_port", args.health_port),
                                   ("--http-port", "orchestrator.http.port", args.http_port)):
            if value is not None:
                if option == "--http-port" and args.name != "orchestrator":
                    parser.error("--http-port: only the orchestrator has an HTTP face")
                overrides[key], options[key] = value, f"{option} {value}"
        if overrides:  # a refusal names the option, as it was given
            config = config.with_overrides_from(overrides, options, "command line")
    except (ConfigError, ValueError) as exc:
        print(f"switchyard serve {args.name}: bad configuration:\n{exc}", file=sys.stderr)
        return 2
    try:
        uvloop.run(serve(args.name, config, args.port_file))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # start-up failures: missing index, port in use, ...
        log.error("%s failed to start: %s", args.name, exc)
        return 1
    return 0
