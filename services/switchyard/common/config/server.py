"""``switchyard.json`` ``server``: gRPC servers and channels of every service, TLS, and the port fields
of each service's section."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from switchyard.common.config.base import ConfigError, _Strict


class TlsConfig(_Strict):
    """TLS on every hop between Switchyard's services (and for their clients), from PEM files.

    Off by default (``make run``). One setting for all three services: each server
    presents ``cert_file``/``key_file``; every channel checks the peer against
    ``ca_file``. With ``require_client_auth`` (mTLS) servers demand a client
    certificate signed by ``ca_file`` and channels present ``cert_file``/``key_file``.
    """

    enabled: bool = Field(False, description="Serve and connect over TLS.")
    cert_file: str = Field("", description="PEM certificate chain this service presents.")
    key_file: str = Field("", description="PEM private key of cert_file.")
    ca_file: str = Field("", description="PEM CA bundle that signs the peers' certificates.")
    require_client_auth: bool = Field(False, description="mTLS: servers require client certificates from ca_file.")
    server_name: str = Field(
        "", description="Name to check in the server's certificate instead of the target host (e.g. when "
        "connecting by IP address); empty: the target's host.",
    )

    @model_validator(mode="after")
    def _files_when_enabled(self) -> "TlsConfig":
        if not self.enabled:
            return self
        if not self.ca_file:
            raise ValueError("tls.enabled needs ca_file (PEM CA bundle that signs the peers' certificates)")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls: give cert_file and key_file together")
        if self.require_client_auth and not self.cert_file:
            raise ValueError("tls.require_client_auth needs cert_file and key_file (the certificate to present)")
        return self

    def read(self) -> tuple[bytes | None, bytes | None, bytes]:
        """(certificate chain or None, private key or None, CA bundle) as bytes.

        Raises:
            ConfigError: a file cannot be read (naming the key and the path).
        """
        out: list[bytes | None] = []
        for name, path in (("cert_file", self.cert_file), ("key_file", self.key_file), ("ca_file", self.ca_file)):
            if not path:
                out.append(None)
                continue
            try:
                out.append(Path(path).read_bytes())
            except OSError as exc:
                from switchyard.common.config.loader import set_by_environment  # the loader imports this module

                raise ConfigError(f"tls.{name} {path}{set_by_environment('server', f'tls.{name}')}: "
                                  f"{exc.strerror or exc}; expected a PEM file this user can read") from None
        assert out[2] is not None
        return out[0], out[1], out[2]


class ServerConfig(_Strict):
    """gRPC server and channel settings every service shares: ``switchyard.json`` ``server``."""

    host: str = Field(
        "127.0.0.1", min_length=1,
        description="Interface the services listen on and the host clients reach them at, a host name or IP "
        "address (0.0.0.0 in containers: SWITCHYARD_HOST).",
    )
    shutdown_grace_s: float = Field(10.0, ge=0, le=600, description="In-flight streams get this long to finish, seconds.")
    max_message_bytes: int = Field(
        16 * 1024 * 1024, ge=4096, le=1 << 30, description="Largest gRPC message, bytes, sent or received."
    )
    tls: TlsConfig = Field(default_factory=TlsConfig, description="TLS (and optional mTLS) on every hop.")
    max_pending_rpcs: int = Field(
        100_000, ge=1000, le=10_000_000,
        description="Calls received but not yet handed to a servicer before grpc core refuses more, calls "
        "(its defaults, 1,000/3,000, cancel a burst's calls at random, unseen). Overload is refused by the "
        "queues, by name.",
    )
    max_unrequested_time_s: int = Field(
        3600, ge=1, le=86_400,
        description="Seconds a call received but not yet handed to a servicer may wait before grpc core cancels "
        "it with a bare CANCELLED (grpc.server_max_unrequested_time_in_server; grpc's default, 30 s, cancels a "
        "burst's tail unseen). A waiting call is bounded by its caller's deadline and the queues' timeouts.",
    )
    keepalive_time_s: float = Field(
        20.0, ge=10, le=7200,
        description="Seconds between keepalive pings on a quiet connection, by clients and servers alike; "
        "at least 10 s, the interval servers accept (gRFC A8).",
    )
    keepalive_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Seconds a ping may go unanswered before its connection is closed as dead."
    )
    max_connection_age_s: float = Field(
        30.0, ge=1, le=86_400,
        description="A server sends GOAWAY to a connection this old (gRPC adds +/-10 % jitter): its client "
        "re-resolves the target and reconnects, so replicas added by the autoscaler get calls within this "
        "time (gRFC A9).",
    )
    max_connection_age_grace_s: float = Field(
        600.0, ge=0, le=86_400,
        description="Calls still running on a connection sent GOAWAY for its age get this long to finish "
        "before it is closed, seconds; at least the longest orchestrator.task_time_limit_s (checked where both "
        "are read), so no stream of a task within its limit is cut.",
    )
    cpu_profile: Literal["loopback", "on", "off"] = Field(
        "loopback",
        description="Who may ask a service's metrics port for /debug/pprof/profile, a name. loopback: served when "
        "the service listens on a loopback address, and on any address by a service that checks bearer tokens "
        "(the orchestrator with orchestrator.auth on; then a token is required); on: served on any address "
        "(behind tokens where the service checks them); off: never.",
    )
    cpu_profile_max_s: float = Field(
        300, gt=0, le=3600, description="Longest profile one request may ask for, seconds."
    )


def _port(default: int) -> Any:
    return Field(default, ge=0, le=65535, description="TCP port; 0 picks a free port.")


def _health_port() -> Any:
    return Field(
        None, ge=0, le=65535,
        description="Plain-text port serving only grpc.health.v1 (no application service, no reflection), for "
        "probes that cannot speak TLS (kubelet's grpc probes) while server.tls is on; null: off; 0: a free port.",
    )

def _metrics_port(default: int) -> Any:
    return Field(default, ge=0, le=65535, description="TCP port of the Prometheus /metrics endpoint; 0 picks a free port.")


def distinct_ports(section: str, ports: dict[str, int | None]) -> None:
    """Refuse two of one service's listening ports (``ports``: key under ``section`` -> port; None: off, 0: a
    free one, never a clash) set to the same number: the second bind failed once the service had started,
    naming neither key (``metrics port 127.0.0.1:9102 for retrieval: Address already in use``).

    Raises:
        ValueError: naming both keys and the port (:func:`port_clash`).
    """
    clash = port_clash({f"{section}.{key}": port for key, port in ports.items()})
    if clash is not None:
        raise ValueError(clash)


def port_clash(ports: dict[str, int | None]) -> str | None:
    """What is wrong with listening ports bound on one host (``ports``: what names each -> its number; None: off,
    0: a free one, never a clash): two of the same number, naming both, or a number past 65535; None when each
    has its own."""
    seen: dict[int, str] = {}
    for key, port in ports.items():
        if not port:
            continue
        if not 0 < port <= 65535:
            return f"{key} is {port}: expected a TCP port, 1 to 65535 (0 picks a free one)"
        if port in seen:
            return f"{seen[port]} and {key} are both {port}: expected a port of its own for each (0 picks a free one)"
        seen[port] = key
    return None
