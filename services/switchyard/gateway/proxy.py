"""Which proxy variable applies to a URL, so failures can name it.

httpx itself honours HTTP_PROXY, HTTPS_PROXY, ALL_PROXY and NO_PROXY
(``trust_env``); this module reads the same variables through
:mod:`switchyard.common.envs` with the same rules (curl's NO_PROXY
semantics, as httpx applies them) only to say which one a failed request
went through.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from switchyard.common import envs


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


def _bypassed(host: str, no_proxy: str) -> bool:
    for entry in (item.strip().lower() for item in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        entry = entry.split("://", 1)[-1].split(":", 1)[0] if entry.count(":") <= 1 else entry
        try:
            if "/" in entry and ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            pass
        if host == entry or (entry.startswith(".") and host.endswith(entry)) or host.endswith("." + entry):
            return True
    return False


def proxy_for(url: str) -> ProxyRoute | None:
    """The proxy a request to ``url`` goes through, or None (no variable set, or NO_PROXY matches).

    HTTP_PROXY for http URLs, HTTPS_PROXY for https ones, else ALL_PROXY, as httpx picks them.
    """
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if _bypassed(host, envs.read_standard("NO_PROXY") or ""):
        return None
    for variable in ("HTTPS_PROXY" if parts.scheme == "https" else "HTTP_PROXY", "ALL_PROXY"):
        if address := envs.read_standard(variable):
            return ProxyRoute(variable, address)
    return None


def configured_proxies() -> list[ProxyRoute]:
    """Every proxy variable that is set (for ``switchyard doctor``)."""
    routes = []
    for variable in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        if address := envs.read_standard(variable):
            routes.append(ProxyRoute(variable, address))
    return routes
