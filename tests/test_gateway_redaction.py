"""The API key never appears in logs, spans, error messages or metrics."""

from __future__ import annotations

import logging

import pytest
from gateway_fixtures import TEST_KEY, clean_proxy_env, gateway_config, start_sim  # noqa: F401
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY, generate_latest

from switchyard.gateway.client import GatewayClient
from switchyard.gateway.errors import GatewayError
from switchyard.gateway.events import ChatRequest
from switchyard_harness.faults import Fault
from switchyard.gateway.keys import ApiKey
from switchyard.gateway.redact import REDACTED, RedactingFilter, redact

KEY_ENV = "SWITCHYARD_TEST_API_KEY"


def span_text(exporter: InMemorySpanExporter) -> str:
    parts = []
    for span in exporter.get_finished_spans():
        parts += [span.name, str(span.status.description), repr(dict(span.attributes or {}))]
        parts += [f"{event.name} {dict(event.attributes or {})}" for event in span.events]
    return "\n".join(parts)


async def test_key_never_in_logs_spans_errors_or_metrics(clean_proxy_env, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    messages: list[str] = []

    async def run(base_url: str, key: str, model: str = "") -> None:
        monkeypatch.setenv(KEY_ENV, key)
        cfg = gateway_config(base_url, api_key_required=True, max_retries=1)
        async with GatewayClient(cfg, tracer=tracer) as client:
            try:
                async for _ in client.stream_chat(ChatRequest([{"role": "user", "content": "hi"}], model=model)):
                    pass
                await client.list_models()
            except GatewayError as exc:
                messages.append(str(exc))

    with start_sim(api_key=TEST_KEY) as good:
        await run(good.base_url, TEST_KEY)  # success
        await run(good.base_url, TEST_KEY, "claude-sonnet-4.5")  # 404 + /models lookup with the key: NOT_FOUND
        await run(good.base_url, TEST_KEY + "\n")  # whitespace
    with start_sim(api_key="another-key", faults={"*": Fault(echo_key=True)}) as echoing:
        await run(echoing.base_url, TEST_KEY)  # 401 whose body echoes the key
    with start_sim(faults={"*": Fault(status=503)}) as failing:
        await run(failing.base_url, TEST_KEY)  # retried, then fallback, then error

    assert len(messages) == 4 and len(exporter.get_finished_spans()) == 5
    assert any(REDACTED in m for m in messages)  # the echoed key was redacted
    haystacks = {
        "logs": caplog.text,
        "spans": span_text(exporter),
        "errors": "\n".join(messages),
        "metrics": generate_latest(REGISTRY).decode(),
    }
    for where, text in haystacks.items():
        assert TEST_KEY not in text, f"API key found in {where}"
        assert TEST_KEY[8:20] not in text, f"part of the API key found in {where}"


def test_redact_removes_key_bearer_tokens_and_sk_keys():
    text = f"got {TEST_KEY} and Authorization: Bearer abcdefghijklmnop and sk-zzzzzzzzzzzz"
    cleaned = redact(text, TEST_KEY + "\n")
    assert TEST_KEY not in cleaned and "abcdefghijklmnop" not in cleaned and "sk-zzzz" not in cleaned
    assert cleaned.count(REDACTED) == 3


def test_redacting_filter_rewrites_log_records():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "key is %s", (TEST_KEY,), None)
    RedactingFilter(TEST_KEY).filter(record)
    assert record.getMessage() == f"key is {REDACTED}"


@pytest.mark.parametrize(
    ("value", "described"),
    [
        (None, "not set"),
        ("abc", "length 3, no whitespace"),
        ("abc\n", "length 4, whitespace: trailing '\\n'"),
        (" a b", "length 4, whitespace: leading ' ', inner whitespace"),
    ],
)
def test_api_key_description_shows_length_and_whitespace_only(value, described):
    key = ApiKey("K", value)
    assert key.describe() == f"K ({described})"
    assert repr(key) == f"ApiKey(env='K', {described})"


def test_log_redaction_installs_once_per_key():
    from switchyard.gateway.redact import install_log_redaction

    root = logging.getLogger()
    handler = logging.NullHandler()
    root.addHandler(handler)
    try:
        install_log_redaction(TEST_KEY)
        install_log_redaction(TEST_KEY)
        assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
    finally:
        root.removeHandler(handler)
