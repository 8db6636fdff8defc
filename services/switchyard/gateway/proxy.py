"""The upstream model client's proxy: which proxy variable applies to a URL.

Only the upstream model client (the ``openai`` engine, ``switchyard doctor``)
honours HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY; Switchyard's own
gRPC channels never use a proxy (:mod:`switchyard.common.channels`).

The variables are read here, not by httpx (the clients are built with
``trust_env=False`` and the proxy this module picks), because httpx turns
every NO_PROXY entry into a URL pattern and refuses to build a client when one
does not parse: ``[::1]`` or an IPv6 CIDR such as ``fd07:b51a:cc66:f0::/64``
("Invalid port: ':1]'") stopped the dispatcher at start-up. NO_PROXY follows
curl's rules (``man curl``, ``--noproxy``), with the CIDR blocks that Go's
``httpproxy`` and Python's requests also accept:

- ``*`` bypasses the proxy for every host;
- ``example.com``, ``.example.com`` and ``*.example.com`` match the host and its
  subdomains; ``host:port`` only that port;
- an IP address (``10.1.2.3``, ``::1``, ``[::1]``, ``[::1]:8080``) matches that
  address, a CIDR block (``10.0.0.0/8``, ``fd07:b51a:cc66:f0::/64``) any in it.

An entry that is none of these is logged once, naming the variable and the
entry, and skipped; the others still apply. ``switchyard doctor`` lists it.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import re
import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from switchyard.common import envs

log = logging.getLogger(__name__)

_DOMAIN = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")
_BRACKETED = re.compile(r"\[([^\]]+)\](?::(\d+))?")
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ProxyRoute:
    """The variable that routes a URL through a proxy, and the proxy's address."""

    variable: str
    address: str

    def host_port(self) -> tuple[str, int]:
        """(host, port) of the proxy; port defaults to 80 for http and 443 for https proxies."""
        parts = urlsplit(self.address if "://" in self.address else f"http://{self.address}")
        default = 443 if parts.scheme == "https" else 80
        return parts.hostname or "", parts.port or default


@dataclass(frozen=True)
class _Entry:
    network: _Network | None = None
    domain: str = ""
    port: int | None = None

    def matches(self, host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.network is not None:
            return address is not None and address in self.network
        return host == self.domain or host.endswith("." + self.domain)


@dataclass(frozen=True)
class NoProxy:
    """A parsed NO_PROXY value.

    Attributes:
        variable: the spelling that was set (``NO_PROXY`` or ``no_proxy``).
        everything: ``*`` was given.
        invalid: entries that could not be parsed (skipped).
    """

    variable: str = "NO_PROXY"
    everything: bool = False
    entries: tuple[_Entry, ...] = ()
    invalid: tuple[str, ...] = field(default=())

    def bypasses(self, host: str, port: int) -> bool:
        """True when a request to ``host:port`` goes direct."""
        if self.everything:
            return True
        host = host.lower().strip("[]").rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        return any(entry.matches(host, address, port) for entry in self.entries)


def _port(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(text)
    return int(text)


def _parse_entry(raw: str) -> _Entry:
    """One NO_PROXY entry (lower case, no blanks). Raises ValueError when it is not one of the forms above."""
    entry = raw.split("://", 1)[-1]
    if m := _BRACKETED.fullmatch(entry):
        return _Entry(network=ipaddress.ip_network(m.group(1), strict=False), port=_port(m.group(2)))
    if entry.count(":") >= 2:  # a bare IPv6 address or block: its colons are not a port separator
        return _Entry(network=ipaddress.ip_network(entry, strict=False))
    host, _, port = entry.partition(":")
    port_number = _port(port) if port else None
    try:
        return _Entry(network=ipaddress.ip_network(host, strict=False), port=port_number)
    except ValueError:
        if "/" in host or host.replace(".", "").isdigit():
            raise  # a broken IPv4 address or block, not a host name
    domain = host.removeprefix("*.").lstrip(".").rstrip(".")
    if not domain or not _DOMAIN.fullmatch(domain):
        raise ValueError(raw)
    return _Entry(domain=domain, port=port_number)


@functools.lru_cache(maxsize=8)
def parse_no_proxy(value: str, variable: str = "NO_PROXY") -> NoProxy:
    """Parse a NO_PROXY value (see the module docstring); unparseable entries are logged once and skipped."""
    entries: list[_Entry] = []
    invalid: list[str] = []
    everything = False
    for raw in (item.strip().lower() for item in value.split(",")):
        if not raw:
            continue
        if raw == "*":
            everything = True
            continue
        try:
            entries.append(_parse_entry(raw))
        except ValueError:
            invalid.append(raw)
            log.warning(
                "%s entry %r skipped: expected a host name (example.com, .example.com), an IP address "
                "(10.0.0.1, ::1, [::1]:8080) or a CIDR block (10.0.0.0/8, fd00::/8)", variable, raw,
            )
    return NoProxy(variable, everything, tuple(entries), tuple(invalid))


def no_proxy() -> NoProxy:
    """NO_PROXY (or no_proxy) of this process, parsed."""
    found = envs.read_standard_named("NO_PROXY")
    return parse_no_proxy(found[1], found[0]) if found else NoProxy()


def proxy_for(url: str) -> ProxyRoute | None:
    """The proxy a request to ``url`` goes through, or None (no variable set, or NO_PROXY matches).

    HTTPS_PROXY for https URLs, HTTP_PROXY for http ones, else ALL_PROXY, as curl and httpx pick them.
    """
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if no_proxy().bypasses(parts.hostname or "", port):
        return None
    for variable in ("HTTPS_PROXY" if parts.scheme == "https" else "HTTP_PROXY", "ALL_PROXY"):
        if address := envs.read_standard(variable):
            return ProxyRoute(variable, address)
    return None


def client_settings(url: str) -> dict[str, Any]:
    """``httpx.AsyncClient`` keyword arguments for requests to ``url``'s host: its proxy (or none),
    ``trust_env`` off so httpx does not parse the proxy variables itself, and a TLS context that
    still honours SSL_CERT_FILE / SSL_CERT_DIR."""
    import httpx

    route = proxy_for(url)
    context: ssl.SSLContext = httpx.create_ssl_context(trust_env=True)
    return {"proxy": route.address if route else None, "trust_env": False, "verify": context}


def configured_proxies() -> list[ProxyRoute]:
    """Every proxy variable that is set (for ``switchyard doctor``)."""
    routes = []
    for variable in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        if address := envs.read_standard(variable):
            routes.append(ProxyRoute(variable, address))
    return routes
