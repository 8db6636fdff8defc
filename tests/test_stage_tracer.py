"""Stage spans cost nothing while tracing is off, and are real spans once a provider is installed."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from switchyard.common import telemetry


def test_off_yields_the_invalid_span_and_leaves_the_context_alone():
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # tests install no global provider
    tracer = telemetry.get_tracer("t")
    before = trace.get_current_span()
    with tracer.start_as_current_span("stage", attributes={"k": "v"}) as span:
        assert span is trace.INVALID_SPAN and not span.is_recording()
        assert trace.get_current_span() is before
    explicit = tracer.start_span("queue_wait", start_time=1)
    explicit.end(end_time=2)
    assert explicit is trace.INVALID_SPAN


def test_on_delegates_to_the_installed_provider(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = telemetry.get_tracer("t")
    monkeypatch.setattr(tracer, "_inner", provider.get_tracer("t"))
    monkeypatch.setattr(telemetry, "_tracing_off", lambda: False)
    with tracer.start_as_current_span("stage") as span:
        assert span.is_recording() and trace.get_current_span() is span
        tracer.start_span("child").end()
    assert sorted(s.name for s in exporter.get_finished_spans()) == ["child", "stage"]
    provider.shutdown()
