"""What a TLS failure was: the name dialled, the certificate's names and issuer, and why they do not fit.

grpc says only "Tls handshake failed ... CERTIFICATE_VERIFY_FAILED" or "Hostname
Verification Check failed": not which name was checked, which names the
certificate holds, or who signed it. :func:`check_certificate` finds out the
way OpenSSL decides, with Python's ``ssl`` module against the same files
(``server.tls``): one handshake verifying the chain against ``ca_file`` and the
dialled name, and one that only reads the certificate the peer presents (its
subject alternative names, subject and issuer, parsed by ``cryptography``).

The dialled name is ``server.tls.server_name`` when set (grpc's
``ssl_target_name_override``), else the target's host.

Used by the orchestrator's downstream errors (:func:`explain`, cached per
address, when a call failed the way a TLS failure does), by ``switchyard
doctor`` (every address it dials) and logged by a TLS server at start-up.
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import time
from dataclasses import dataclass, field

from switchyard.common.config import TlsConfig

TLS_FAILURE_WORDS = ("tls handshake", "ssl handshake", "handshake failed", "hostname verification",
                     "certificate_verify_failed", "certificate")
"""Words of grpc's status details for a TLS failure (grpc core's TSI and SSL messages)."""

EXPLAIN_TTL_S = 10.0
"""How long one address's explanation is reused for the errors of later calls, seconds."""


def looks_like_tls_failure(details: str) -> bool:
    """True when grpc's status ``details`` read like a failed TLS handshake or certificate check."""
    lowered = details.lower()
    return any(word in lowered for word in TLS_FAILURE_WORDS)


def host_port(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port``, ``[v6]:port``, ``dns:///name:port`` (of ``ipv4:a:p,b:p``, the first).

    Raises:
        ValueError: no port, naming the address.
    """
    rest = address.split("///", 1)[-1] if "///" in address else address.removeprefix("ipv4:").removeprefix("ipv6:")
    rest = rest.split(",", 1)[0]  # of several addresses, the first
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{address!r}: expected host:port")
    return host.strip("[]"), int(port)


def dialled_name(address: str, tls: TlsConfig) -> str:
    """The name a channel to ``address`` checks the server's certificate against."""
    return tls.server_name or host_port(address)[0]


@dataclass
class TlsCheck:
    """What one address's certificate is and whether it fits.

    ``problem`` is "" when the chain verifies against ``ca_file`` and the dialled
    name is among the certificate's names.
    """

    address: str
    dialled: str
    names: list[str] = field(default_factory=list)
    """Subject alternative names, as ``DNS:name`` / ``IP:address``."""
    subject: str = ""
    issuer: str = ""
    not_after: str = ""
    problem: str = ""
    unreachable: bool = False
    """Nothing answered at the address (no TCP connection, or none within the timeout)."""

    @property
    def ok(self) -> bool:
        return not self.problem

    def describe(self) -> str:
        """One sentence naming the dialled name, the certificate's names and issuer, and the problem."""
        names = ", ".join(self.names) or "none"
        seen = (f"the certificate's names (SANs): {names}; subject {self.subject or '?'}; issuer {self.issuer or '?'}"
                if self.subject or self.names else "no certificate was read")
        verdict = f": {self.problem}" if self.problem else ": the certificate fits"
        return f"TLS to {self.address}: dialled name {self.dialled!r}; {seen}{verdict}"


def _context(tls: TlsConfig, verify: bool) -> ssl.SSLContext:
    cert, key, ca = tls.read()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])
    if verify:
        context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if tls.cert_file and tls.key_file:  # under mTLS the server wants ours before it finishes
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


async def _handshake(host: str, port: int, context: ssl.SSLContext, name: str, timeout_s: float) -> bytes:
    """The peer's DER certificate after a handshake with ``context`` (SNI and hostname check: ``name``)."""
    server_hostname = None if _is_ip(name) and not context.check_hostname else name
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=context, server_hostname=server_hostname), timeout_s)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return der or b""
    finally:
        writer.transport.abort()  # no TLS close_notify exchange: a gRPC server does not answer one at once


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _describe_certificate(check: TlsCheck, der: bytes) -> None:
    from cryptography import x509

    certificate = x509.load_der_x509_certificate(der)
    check.subject = certificate.subject.rfc4514_string()
    check.issuer = certificate.issuer.rfc4514_string()
    check.not_after = certificate.not_valid_after_utc.isoformat()
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return
    check.names = [f"DNS:{n}" for n in sans.get_values_for_type(x509.DNSName)] + [
        f"IP:{ip}" for ip in sans.get_values_for_type(x509.IPAddress)]


async def speaks_tls(address: str, timeout_s: float = 2.0) -> bool:
    """Whether a TLS handshake (no certificate checked) completes at ``address``: a client that sent plain text
    there read only grpc's "Socket closed" (the server drops a connection whose first bytes are no ClientHello),
    and was told nothing answers. False where nothing answers, the handshake fails, or the address has no port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.set_alpn_protocols(["h2"])
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        host, port = host_port(address)
        await _handshake(host, port, context, host, timeout_s)
    except (OSError, ssl.SSLError, TimeoutError, ValueError):
        return False
    return True


PLAINTEXT_TO_TLS = ("{address} serves TLS and this client sent plain text: set SWITCHYARD_TLS_DIR to the folder "
                    "holding the CA bundle ca.crt (or --config-dir to a folder whose server.tls is on)")
"""What a client says where :func:`speaks_tls` found TLS at the address it reached in plain text."""


async def check_certificate(address: str, tls: TlsConfig, timeout_s: float = 3.0) -> TlsCheck:
    """Check the certificate ``address`` presents against ``tls`` (``ca_file``, the dialled name).

    Raises nothing: a peer that does not answer, or a file that cannot be read, is the ``problem``.
    """
    dialled = dialled_name(address, tls)
    check = TlsCheck(address, dialled)
    try:
        host, port = host_port(address)
        der = await _handshake(host, port, _context(tls, verify=False), dialled, timeout_s)
        if der:
            _describe_certificate(check, der)
        await _handshake(host, port, _context(tls, verify=True), dialled, timeout_s)
    except ssl.SSLCertVerificationError as exc:
        reason = exc.verify_message or str(exc)
        if "hostname" in reason.lower() or "ip address mismatch" in reason.lower():
            check.problem = (f"{dialled!r} is not among the certificate's names; dial one of them or set "
                             "server.tls.server_name to one")
        else:
            check.problem = f"the certificate does not verify against server.tls.ca_file {tls.ca_file}: {reason}"
    except ssl.SSLError as exc:
        check.problem = f"the TLS handshake failed: {exc.reason or exc}"
    except (OSError, asyncio.TimeoutError) as exc:
        check.unreachable = not check.subject
        check.problem = f"could not complete a TLS handshake: {type(exc).__name__}: {exc}"
    except ValueError as exc:
        check.problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - a certificate cryptography cannot parse, a bad PEM file
        check.problem = f"could not read the certificate: {type(exc).__name__}: {exc}"
    return check


_explained: dict[str, tuple[float, asyncio.Future[str]]] = {}


async def explain(address: str, tls: TlsConfig) -> str:
    """:meth:`TlsCheck.describe` of ``address``, one check per address per :data:`EXPLAIN_TTL_S`
    shared by every caller in this event loop (errors of concurrent calls do not each start a handshake)."""
    now = time.monotonic()
    cached = _explained.get(address)
    if (cached is None or now - cached[0] > EXPLAIN_TTL_S
            or cached[1].get_loop() is not asyncio.get_running_loop()):
        future = asyncio.ensure_future(_describe(address, tls))
        _explained[address] = cached = (now, future)
    return await asyncio.shield(cached[1])


async def _describe(address: str, tls: TlsConfig) -> str:
    return (await check_certificate(address, tls)).describe()


def name_matches(dialled: str, names: list[str]) -> bool:
    """True when ``dialled`` is among certificate ``names`` (``DNS:``/``IP:``), as RFC 6125 matches them:
    an IP address only against ``IP:`` names, a host name case-insensitively, ``*`` as the whole
    leftmost label only."""
    if _is_ip(dialled):
        wanted = ipaddress.ip_address(dialled)
        return any(n.startswith("IP:") and ipaddress.ip_address(n[3:]) == wanted for n in names)
    host = dialled.lower().rstrip(".")
    for name in names:
        if not name.startswith("DNS:"):
            continue
        pattern = name[4:].lower().rstrip(".")
        if pattern == host:
            return True
        if pattern.startswith("*.") and "." in host and host.split(".", 1)[1] == pattern[2:]:
            return True
    return False


def check_certificate_file(tls: TlsConfig, dialled: str, address: str = "") -> TlsCheck:
    """Check ``tls.cert_file`` (what every service presents) offline: its chain (the leaf, then any
    intermediates) issued by ``ca_file``, valid now with the authority that signed it
    (:func:`served_certificate_problem`, what a service checks at start), holding ``dialled`` among its names.
    Raises nothing: what is wrong is the ``problem``."""
    from cryptography import x509

    check = TlsCheck(address or f"server.tls.cert_file {tls.cert_file}", dialled)
    try:
        cert, _, ca = tls.read()
        if cert is None:
            check.problem = "server.tls.cert_file is not set: servers have no certificate to present"
            return check
        chain = x509.load_pem_x509_certificates(cert)
        _describe_certificate(check, chain[0].public_bytes(_der()))
        authorities = x509.load_pem_x509_certificates(ca)
    except Exception as exc:  # noqa: BLE001 - unreadable or unparsable PEM
        check.problem = f"could not read the certificate files: {type(exc).__name__}: {exc}"
        return check
    if not all(_issued_by(lower, upper) for lower, upper in zip(chain, chain[1:])):
        check.problem = ("its certificates are not a chain: each after the first must have signed the one "
                         "before it (the leaf first, then its intermediates)")
    elif not any(_issued_by(chain[-1], authority) for authority in authorities):
        top = chain[-1].issuer.rfc4514_string()
        check.problem = (f"its issuer {top} did not sign it with any certificate of server.tls.ca_file "
                         f"{tls.ca_file}")
    elif (invalid := served_certificate_problem(cert, "server.tls.cert_file", ca)) is not None:
        check.problem = invalid
    elif not name_matches(dialled, check.names):
        check.problem = (f"{dialled!r} is not among the certificate's names; dial one of them or set "
                         "server.tls.server_name to one")
    return check


def not_valid_now(leaf) -> str | None:  # type: ignore[no-untyped-def]
    """Why the certificate ``leaf`` (a ``cryptography`` x509 certificate) is not valid at this moment, naming its
    validity window and the time now (UTC); None while it is valid."""
    now = time.time()
    start, end = leaf.not_valid_before_utc, leaf.not_valid_after_utc
    if start.timestamp() <= now <= end.timestamp():
        return None
    at = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(now))
    what = "it expired" if now > end.timestamp() else "it is not valid yet"
    return f"{what}: valid {start.isoformat()} to {end.isoformat()}, now {at}"


def served_certificate_problem(cert: bytes, cert_setting: str = "server.tls.cert_file", ca: bytes = b"",
                               ca_setting: str = "server.tls.ca_file") -> str | None:
    """Why a server must not present ``cert`` (PEM: the leaf, then any intermediates) with ``ca`` (PEM, the
    bundle every peer and this service's own channels verify against): a certificate of the chain, or the
    authority of ``ca`` that signed its last one, not valid now (expired, or not yet valid: a clock or a
    renewal gone wrong). Every peer's handshake would fail with "certificate has expired" while the server
    answered nothing else and ``switchyard up`` waited out --ready-timeout; an expired CA or intermediate had
    been let through, and up's check then said the (valid) certificate did not verify.

    Returns the reason, starting with the setting of the file at fault and the certificate's subject where it
    is not the leaf; None when all are valid or cannot be parsed (grpc refuses that itself). An authority of
    ``ca`` that signed none of the chain is not judged (a bundle may hold other CAs); of those that did, the
    first in the file is, as grpc's handshake verifies against it: a CA renewed with its key kept serves with
    the renewal first in the bundle, and fails every handshake with the expired one first."""
    from cryptography import x509

    try:
        chain = x509.load_pem_x509_certificates(cert)
    except ValueError:
        return None
    for place, certificate in enumerate(chain):
        if (invalid := not_valid_now(certificate)) is not None:
            if place == 0:
                return f"{cert_setting}: {invalid}"
            return (f"{cert_setting}: its certificate {place + 1} (an intermediate, subject "
                    f"{certificate.subject.rfc4514_string()}): {invalid}")
    try:
        authorities = x509.load_pem_x509_certificates(ca) if ca.strip() else []
    except ValueError:
        return None
    signer = next((authority for authority in authorities if _issued_by(chain[-1], authority)), None)
    if signer is not None and (invalid := not_valid_now(signer)) is not None:
        return (f"{ca_setting}: the authority that signed {cert_setting} (subject "
                f"{signer.subject.rfc4514_string()}, the first in the file that did): {invalid}")
    return None


def _der():  # type: ignore[no-untyped-def]
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.DER


def _issued_by(leaf, authority) -> bool:  # type: ignore[no-untyped-def]
    try:
        leaf.verify_directly_issued_by(authority)
    except Exception:  # noqa: BLE001 - a wrong issuer, signature or key type: not this authority
        return False
    return True


def describe_tls(tls: TlsConfig) -> str:
    """One log line of ``server.tls`` at start-up: the certificate served and the name outgoing
    channels check (``server_name``), so that a later "Hostname Verification Check failed" can be read."""
    if not tls.enabled:
        return "server.tls off: plain text"
    check = check_certificate_file(tls, tls.server_name or "") if tls.cert_file else None
    served = (f"presenting {tls.cert_file} (names: {', '.join(check.names) or 'none'}; issuer {check.issuer})"
              if check is not None and check.subject else "presenting no certificate")
    dialled = (f"server_name {tls.server_name!r} (server.tls.server_name)" if tls.server_name
               else "server_name unset: each target's own host")
    client = "client certificates required (mTLS)" if tls.require_client_auth else "no client certificates"
    return (f"server.tls on: {served}; peers verified against {tls.ca_file}; outgoing channels check "
            f"{dialled}; {client}")
