"""Every environment variable Switchyard reads, with its parser and default.

Service code reads settings through this module only; it never calls
``os.environ`` itself. The OpenTelemetry SDK reads the standard ``OTEL_*``
variables and httpx the proxy variables (``HTTP_PROXY``, ``HTTPS_PROXY``,
``ALL_PROXY``, ``NO_PROXY``) under their standard names; they are listed here so that one
file names everything the process looks at. The few variables Switchyard sets for
a library (:data:`LIBRARY_DEFAULTS`) are set here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

from switchyard.common.grpc_target import grpc_target

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One declared variable: its name, parser, default and meaning."""

    name: str
    parse: Callable[[str], T]
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r}: {exc}") from None


def raw_value(name: str) -> str | None:
    """The text of environment variable ``name`` as it is set (None: unset), for a message quoting it."""
    return os.environ.get(name)


def _engine(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("sim", "openai", "torch"):
        raise ValueError("expected one of 'sim', 'openai', 'torch'")
    return value


def _optional(raw: str) -> str | None:
    return raw or None


def _name(raw: str) -> str:
    """A host name or a model id, which hold no surrounding spaces: those of the value (a ConfigMap key made from a
    file ends in its newline) are dropped, as every other variable's parser drops them. A model 'm\\n' went
    upstream as is and every call was NOT_FOUND; a host ' 0.0.0.0' did not resolve. A value of spaces alone is
    kept, for its key to refuse naming it."""
    return raw.strip() or raw


SWITCHYARD_CONFIG_DIR = EnvVar("SWITCHYARD_CONFIG_DIR", str, "config", "Folder holding the config files.")
SWITCHYARD_ENGINE = EnvVar[str | None](
    "SWITCHYARD_ENGINE", _engine, None, "Inference engine (sim, openai, torch); overrides dispatcher.engine."
)
SWITCHYARD_INDEX_DIR = EnvVar[str | None](
    "SWITCHYARD_INDEX_DIR", _optional, None, "Vector index folder; overrides retrieval.index_dir."
)
SWITCHYARD_RETRIEVAL_ADDR = EnvVar[str | None](
    "SWITCHYARD_RETRIEVAL_ADDR", grpc_target, None,
    "gRPC target of retrieval (host:port, dns:///name:port); overrides orchestrator.retrieval_addr."
)
SWITCHYARD_DISPATCHER_ADDR = EnvVar[str | None](
    "SWITCHYARD_DISPATCHER_ADDR", grpc_target, None,
    "gRPC target of the dispatcher (host:port, ipv4:host:port,host:port, dns:///name:port); overrides "
    "orchestrator.dispatcher_addr."
)
def _host_port(raw: str) -> str:
    host, sep, port = raw.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected host:port, e.g. 127.0.0.1:6379")
    return raw.strip()


SWITCHYARD_DRAM_ADDR = EnvVar[str | None](
    "SWITCHYARD_DRAM_ADDR", _host_port, None,
    "host:port of the DRAM tier's Redis; overrides memory_policy.toml [dram] host/port (switchyard up sets it "
    "for the Redis it starts).",
)
SWITCHYARD_HOST = EnvVar[str | None](
    "SWITCHYARD_HOST", _name, None,
    "Interface every service listens on (0.0.0.0 in a container); overrides server.host.",
)


def _http_url(raw: str) -> str:
    value = raw.strip()
    if not value.startswith(("http://", "https://")):
        raise ValueError("expected an http:// or https:// URL ending in /v1, e.g. http://127.0.0.1:8000/v1")
    return value


def _model_or_none(raw: str) -> str:
    value = raw.strip()
    return "" if value.lower() == "none" else value


SWITCHYARD_UPSTREAM_BASE_URL = EnvVar[str | None](
    "SWITCHYARD_UPSTREAM_BASE_URL", _http_url, None,
    "OpenAI-compatible base URL of the model server; overrides model_gateway.base_url (a model server in the "
    "dispatcher's pod: http://127.0.0.1:8000/v1).",
)
SWITCHYARD_UPSTREAM_MODEL = EnvVar[str | None](
    "SWITCHYARD_UPSTREAM_MODEL", _name, None,
    "Model id the model server serves; overrides model_gateway.default_model.",
)
SWITCHYARD_UPSTREAM_FALLBACK_MODEL = EnvVar[str | None](
    "SWITCHYARD_UPSTREAM_FALLBACK_MODEL", _model_or_none, None,
    "Fallback model id, or none (no fallback); overrides model_gateway.fallback_model.",
)


def _task_store(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("sqlite", "redis"):
        raise ValueError("expected one of 'sqlite', 'redis'")
    return value


SWITCHYARD_TASK_STORE = EnvVar[str | None](
    "SWITCHYARD_TASK_STORE", _task_store, None,
    "Task store of the orchestrator (sqlite, redis: shared by replicas); overrides orchestrator.task_store.backend.",
)
SWITCHYARD_TASK_STORE_SQLITE_PATH = EnvVar[str | None](
    "SWITCHYARD_TASK_STORE_SQLITE_PATH", _optional, None,
    "Path of the task store's SQLite file; overrides orchestrator.task_store.sqlite_path (switchyard up --data-dir "
    "sets it to <data dir>/tasks.sqlite3).",
)

def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("true", "false", "1", "0"):
        raise ValueError("expected true or false")
    return value in ("true", "1")


SWITCHYARD_UPSTREAM_API_KEY_REQUIRED = EnvVar[bool | None](
    "SWITCHYARD_UPSTREAM_API_KEY_REQUIRED", _flag, None,
    "Refuse to call the model server without a key (true) or not (false, a server that takes none); overrides "
    "model_gateway.api_key_required.",
)

SWITCHYARD_UPSTREAM_FORWARD_PRIORITY = EnvVar[bool | None](
    "SWITCHYARD_UPSTREAM_FORWARD_PRIORITY", _flag, None,
    "Send each call's priority class in the model server's own field (true) or not (false); overrides "
    "model_gateway.forward_priority (a vLLM started with --scheduling-policy priority: true).",
)


def _port_number(raw: str) -> int:
    if not raw.strip().isdigit() or not 0 <= int(raw) < 65536:
        raise ValueError("expected a TCP port, 0 to 65535")
    return int(raw)


SWITCHYARD_TLS_DIR = EnvVar[str | None](
    "SWITCHYARD_TLS_DIR", _optional, None,
    "Folder of tls.crt, tls.key and ca.crt (a kubernetes.io/tls Secret mounted as files): turns server.tls on "
    "with those files.",
)
SWITCHYARD_TLS_CLIENT_AUTH = EnvVar[bool | None](
    "SWITCHYARD_TLS_CLIENT_AUTH", _flag, None, "mTLS on (true) or off (false); overrides server.tls.require_client_auth."
)
SWITCHYARD_TLS_SERVER_NAME = EnvVar[str | None](
    "SWITCHYARD_TLS_SERVER_NAME", _name, None,
    "Name checked in the peers' certificates when connecting by IP address; overrides server.tls.server_name.",
)
SWITCHYARD_AUTH_TOKENS_FILE = EnvVar[str | None](
    "SWITCHYARD_AUTH_TOKENS_FILE", _optional, None,
    "File of bearer tokens (a Secret mounted as a file): turns orchestrator.auth on with that tokens_file.",
)
SWITCHYARD_HEALTH_PORT = EnvVar[int | None](
    "SWITCHYARD_HEALTH_PORT", _port_number, None,
    "Plain-text health-only port of the service this process serves; overrides its health_port.",
)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The Python logging levels SWITCHYARD_LOG_LEVEL takes (any case; WARN and FATAL too, as :mod:`logging` reads them)."""


def _log_level(raw: str) -> str:
    value = raw.strip().upper()
    if value not in (*LOG_LEVELS, "WARN", "FATAL"):
        raise ValueError(f"expected one of {', '.join(repr(level) for level in LOG_LEVELS)}")
    return value


SWITCHYARD_LOG_LEVEL = EnvVar("SWITCHYARD_LOG_LEVEL", _log_level, "INFO",
                              "Python logging level: DEBUG, INFO, WARNING, ERROR or CRITICAL.")
SWITCHYARD_UP_FILE = EnvVar[str | None](
    "SWITCHYARD_UP_FILE", _optional, None,
    "Where `switchyard up` writes its endpoints and `switchyard top` reads them "
    "(JSON; default <temp dir>/switchyard-<uid>/up.json).",
)

# Read by libraries under their standard names (listed, not parsed, here).
STANDARD_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_SDK_DISABLED",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_EXPORTER_OTLP_INSECURE",
    "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
)


# Set for the libraries, under their standard names, when ``switchyard`` is imported
# (:func:`set_library_defaults`); a value already in the environment is kept.
LIBRARY_DEFAULTS = {
    # ONNX Runtime's official builds (Linux included) start a 1DS usage-telemetry uploader as the
    # module loads: HTTPS to mobile.events.data.microsoft.com, through HTTPS_PROXY when set, and a
    # device id under ~/.cache/Microsoft. `ort.disable_telemetry_events()` comes too late to stop
    # it; only ORT_DISABLE_TELEMETRY=1, read once when onnxruntime initializes, does (onnxruntime's
    # Privacy.md, "Disabling Telemetry"). A service sends nothing anywhere it was not told to.
    "ORT_DISABLE_TELEMETRY": "1",
    # gRPC's fork support (pthread_atfork handlers that pause its threads and poller around every fork) is for a
    # process that forks and keeps using gRPC in the child. Switchyard's children exec at once (the CPU pool's
    # "spawn" workers, subprocesses), and the handlers running around those forks aborted an orchestrator at
    # start-up under load ("Check failed: wakeup_fd_->Wakeup().ok()" in ev_epoll1_linux.cc); gRPC's
    # doc/fork_support.md: fork support is only needed for fork without exec.
    "GRPC_ENABLE_FORK_SUPPORT": "false",
}


def set_library_defaults() -> None:
    """Put :data:`LIBRARY_DEFAULTS` into ``os.environ`` where unset (this process and the ones it starts).

    Called by ``switchyard/__init__.py``, so it runs before any Switchyard code
    can import the library that reads the variable.
    """
    for name, value in LIBRARY_DEFAULTS.items():
        os.environ.setdefault(name, value)


def read_secret(name: str) -> str | None:
    """The raw value of the variable ``name`` (an API key), or None when unset.

    The name comes from config (``model_gateway.api_key_env``), so it cannot be
    declared above. Callers must never log or echo the value.
    """
    return os.environ.get(name)


def read_standard(name: str) -> str | None:
    """The value of one of :data:`STANDARD_VARIABLES` (either case), or None."""
    found = read_standard_named(name)
    return found[1] if found else None


def read_standard_named(name: str) -> tuple[str, str] | None:
    """(the spelling that is set, its value) for one of :data:`STANDARD_VARIABLES`; upper case first."""
    if name not in STANDARD_VARIABLES:
        raise KeyError(f"{name} is not a declared standard variable")
    for spelling in (name, name.lower()):
        if value := os.environ.get(spelling):
            return spelling, value
    return None
