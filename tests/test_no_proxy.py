"""NO_PROXY as the upstream model client reads it: every form curl, Go and requests accept, IPv6
included; an entry that cannot be parsed is skipped (logged once, listed by doctor), never fatal."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from gateway_fixtures import TEST_KEY, clean_proxy_env, start_sim  # noqa: F401

from proxy_fixtures import start_refusing_proxy
from switchyard.dispatcher.request import Request
from switchyard.gateway import doctor
from switchyard.gateway.proxy import parse_no_proxy, proxy_for
from test_openai_engine import PROMPT, engine_for, run

CONFIG = str(Path(__file__).resolve().parents[1] / "config")
IPV6_ENTRIES = "[::1],fd07:b51a:cc66:f0::/64"  # the failing inputs: dispatcher exit, doctor traceback


@pytest.mark.parametrize(
    ("no_proxy", "host", "port", "bypassed"),
    [
        ("[::1]", "::1", 443, True),
        ("[::1]", "[::1]", 443, True),
        ("::1", "::1", 443, True),
        ("[::1]:8080", "::1", 8080, True),
        ("[::1]:8080", "::1", 443, False),
        ("fd07:b51a:cc66:f0::/64", "fd07:b51a:cc66:f0::17", 443, True),
        ("fd07:b51a:cc66:f0::/64", "fd07:b51a:cc66:f1::17", 443, False),
        ("[fd07:b51a:cc66:f0::/64]", "fd07:b51a:cc66:f0::17", 443, True),
        ("10.0.0.0/8", "10.2.3.4", 80, True),
        ("10.0.0.0/8", "11.2.3.4", 80, False),
        ("127.0.0.1", "127.0.0.1", 80, True),
        ("127.0.0.1:9000", "127.0.0.1", 80, False),
        ("example.com", "api.example.com", 443, True),
        (".example.com", "example.com", 443, True),
        ("*.example.com", "api.example.com", 443, True),
        ("example.com", "notexample.com", 443, False),
        ("example.com:8443", "example.com", 443, False),
        ("localhost", "localhost", 80, True),
        ("https://models.internal", "models.internal", 443, True),
        ("*", "anything.at.all", 443, True),
        ("  Example.COM , ", "API.example.com", 443, True),
    ],
)
def test_no_proxy_forms(no_proxy, host, port, bypassed):
    parsed = parse_no_proxy(no_proxy)
    assert parsed.invalid == ()
    assert parsed.bypasses(host, port) is bypassed


@pytest.mark.parametrize("bad", ["[::1", "fd07::/129", "10.0.0.0/33", "999.1.1.1", "exa mple.com", "example.com:99999",
                                 "[zz]", "host:port"])
def test_an_unparseable_entry_is_skipped_and_the_rest_apply(bad, caplog):
    with caplog.at_level(logging.WARNING, logger="switchyard.gateway.proxy"):
        parsed = parse_no_proxy(f"{bad},[::1],models.internal", "no_proxy")
        parse_no_proxy(f"{bad},[::1],models.internal", "no_proxy")  # parsed again: not logged again
    assert parsed.invalid == (bad,)
    assert parsed.bypasses("::1", 443) and parsed.bypasses("models.internal", 443)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no_proxy" in warnings[0] and repr(bad) in warnings[0]


async def test_openai_engine_starts_and_goes_direct_with_ipv6_no_proxy(clean_proxy_env, monkeypatch):
    """The dispatcher's upstream client is built (it used to exit at start-up) and NO_PROXY still applies."""
    proxy = start_refusing_proxy()
    try:
        with start_sim() as sim:
            monkeypatch.setenv("HTTP_PROXY", proxy.url)
            monkeypatch.setenv("NO_PROXY", f"{IPV6_ENTRIES},[::1,127.0.0.1")
            assert proxy_for(sim.base_url) is None
            items = await run(engine_for(sim.base_url), Request("r1", prompt=PROMPT, prompt_tokens=11))
            assert "".join(str(i) for i in items[:-1]) == "Python lists are mutable sequences. [1]"
            assert proxy.requests == []

            monkeypatch.setenv("NO_PROXY", IPV6_ENTRIES)  # 127.0.0.1 no longer bypassed: through the proxy
            route = proxy_for(sim.base_url)
            assert route is not None and route.variable == "HTTP_PROXY"
            with pytest.raises(Exception, match="503"):  # the proxy's answer
                await run(engine_for(sim.base_url, max_retries=0, fallback_model=""),
                          Request("r2", prompt=PROMPT, prompt_tokens=11))
            # the call (and the gateway's read of the server's /metrics, its queue) went through the proxy
            assert any(r.startswith("POST http://127.0.0.1") for r in proxy.requests), proxy.requests
    finally:
        proxy.shutdown()
        proxy.server_close()


def test_doctor_reports_a_skipped_entry_as_a_finding(clean_proxy_env, monkeypatch, capsys):
    monkeypatch.setenv("TAOTOKEN_API_KEY", TEST_KEY)
    with start_sim(api_key=TEST_KEY) as sim:
        monkeypatch.setenv("no_proxy", f"{IPV6_ENTRIES},[::1")
        code = doctor.main(["--config-dir", CONFIG, "--timeout", "3", "--base-url", sim.base_url])
        out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL  no_proxy" in out and "'[::1'" in out and "CIDR block" in out
    assert "base url" in out.lower() and "Traceback" not in out
    monkeypatch.setenv("no_proxy", IPV6_ENTRIES)
    with start_sim(api_key=TEST_KEY) as sim:
        assert doctor.main(["--config-dir", CONFIG, "--timeout", "3", "--base-url", sim.base_url]) == 0
