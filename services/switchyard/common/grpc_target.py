"""gRPC targets as the orchestrator's settings name its downstream services (``orchestrator.retrieval_addr``,
``orchestrator.dispatcher_addr``, and the ``SWITCHYARD_RETRIEVAL_ADDR`` / ``SWITCHYARD_DISPATCHER_ADDR``
variables): checked where they are read, so that a target no channel can reach is refused naming its key or
variable, not accepted with the orchestrator reporting ready while every task failed UNAVAILABLE."""

from __future__ import annotations

EXPECTED_TARGET = ("a gRPC target with a host and a port in 1-65535: host:port, [v6]:port, "
                   "ipv4:host:port,host:port or dns:///name:port")
"""What a target must be, in an error message's words."""


def _port_problem(port: str) -> str:
    """What keeps ``port`` from being a TCP port a client can connect to (1-65535); "" when nothing does."""
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"port {port!r} is not 1-65535" if port else "no port"
    return ""


def address_problem(address: str) -> str:
    """What keeps ``address`` (``host:port`` or ``[v6]:port``) from naming a server; "" when nothing does. Every
    address a command takes is checked here: grpc dials a port past 65535 as the port modulo 65536
    (127.0.0.1:99999 dialled 127.0.0.1:34463, another server's perhaps). A URL (``http://host:port``, the HTTP
    face's address as ``switchyard up`` prints it) is named as one: its host was read as ``http://host``, and a
    call failed 'Misformatted domain name' after a wait."""
    if "://" in address:
        return f"{address!r} is a URL: give host:port, no scheme; the orchestrator's gRPC port, not its HTTP face's"
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            return f"{address!r} has no port after its bracketed host"
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            return f"{address!r} has no port"
    if not host or any(c.isspace() for c in host):
        return f"{address!r} has no host" if not host else f"host {host!r} holds a space"
    return _port_problem(port)


def static_addresses(target: str) -> list[str] | None:
    """The addresses a target lists (``ipv4:a,b``, ``ipv6:[a]:p,...`` or ``host:port``); None for ``dns:``."""
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("ipv4", "ipv6"):
        return [a for a in rest.split(",") if a]
    if target.startswith("dns:"):
        return None
    return [target]


def dns_name(target: str) -> str | None:
    """The ``name:port`` a ``dns:///name:port`` or ``dns://authority/name:port`` target resolves (the
    authority is the DNS server's); None when nothing follows the authority."""
    rest = target[len("dns:"):]
    if rest.startswith("//"):
        _, slash, rest = rest[2:].partition("/")
        if not slash:
            return None
    return rest


def grpc_target_problem(target: str) -> str:
    """What keeps ``target`` from being a gRPC target the orchestrator can reach (``host:port``, ``[v6]:port``,
    ``ipv4:a:p,b:p``, ``ipv6:[a]:p,...``, ``dns:///name:port``, ``dns://authority/name:port``, ``unix:path``);
    "" when nothing does. A target without a port (gRPC would dial 443), with a port past 65535, or with no host
    is named here, at load: it was accepted, the orchestrator reported ready, and every task failed UNAVAILABLE."""
    scheme, sep, rest = target.partition(":")
    if sep and rest.startswith("//") and scheme not in ("dns", "unix"):
        return (f"scheme {scheme + ':'!r} is not one the orchestrator dials (an http:// URL names an HTTP server, "
                "and xds: needs a bootstrap the services do not set up)")
    if sep and scheme in ("unix", "unix-abstract"):
        return "" if rest.strip("/") else f"{target!r} names no socket path"
    if sep and scheme in ("ipv4", "ipv6") and "" in rest.split(","):
        return f"{target!r} lists an empty address"
    addresses = static_addresses(target)
    if addresses is not None:
        return next((problem for a in addresses if (problem := address_problem(a))), "")
    name = dns_name(target)
    if name is None:
        return f"{target!r} has no name after its authority (dns:///name:port)"
    return address_problem(name)


def grpc_target(raw: str) -> str:
    """``raw``, a target from the environment, stripped (:data:`~switchyard.common.envs.EnvVar` parser).

    Raises:
        ValueError: what keeps it from naming a server (:func:`grpc_target_problem`).
    """
    target = raw.strip()
    if problem := grpc_target_problem(target):
        raise ValueError(f"expected {EXPECTED_TARGET} ({problem})")
    return target
