"""Per-process metrics: cgroup v1/v2 CPU throttling, event-loop lag, the metrics endpoint."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.common import process_metrics
from switchyard.common.process_metrics import (
    CgroupCpuThrottlingCollector,
    start_loop_lag_monitor,
    start_metrics_server,
    stop_metrics_servers,
)

pytestmark = pytest.mark.no_gpu

# cgroup v2 cpu.stat with a CPU limit set (cpu.max), as the kernel writes it.
V2_THROTTLED = """usage_usec 86741923
user_usec 60125117
system_usec 26616806
core_sched.force_idle_usec 0
nr_periods 13478
nr_throttled 2215
throttled_usec 187360234
nr_bursts 0
burst_usec 0
"""
# cgroup v1 cpu,cpuacct/cpu.stat: throttled_time in nanoseconds.
V1_THROTTLED = """nr_periods 5321
nr_throttled 412
throttled_time 30512345678
nr_bursts 0
burst_time 0
"""
# cgroup v2 without the cpu controller: usage only, no bandwidth counters.
V2_NO_CPU_CONTROLLER = """usage_usec 1000
user_usec 600
system_usec 400
"""


def _scrape(collector: CgroupCpuThrottlingCollector) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (V2_THROTTLED, (13478, 2215, 187.360234)),
        (V1_THROTTLED, (5321, 412, 30.512345678)),
    ],
    ids=["cgroup-v2", "cgroup-v1"],
)
def test_cpu_throttling_read_from_cpu_stat(tmp_path, content, expected):
    path = tmp_path / "cpu.stat"
    path.write_text(content)
    samples = _scrape(CgroupCpuThrottlingCollector(path))
    periods, throttled, seconds = expected
    assert samples["switchyard_cpu_periods_total"] == periods
    assert samples["switchyard_cpu_throttled_periods_total"] == throttled
    assert samples["switchyard_cpu_throttled_seconds_total"] == pytest.approx(seconds)


def test_cpu_stat_read_at_scrape_time(tmp_path):
    path = tmp_path / "cpu.stat"
    path.write_text(V1_THROTTLED)
    collector = CgroupCpuThrottlingCollector(path)
    assert _scrape(collector)["switchyard_cpu_throttled_periods_total"] == 412
    path.write_text(V1_THROTTLED.replace("nr_throttled 412", "nr_throttled 413"))
    assert _scrape(collector)["switchyard_cpu_throttled_periods_total"] == 413


@pytest.mark.parametrize("content", [V2_NO_CPU_CONTROLLER, "", "garbage line here\n"])
def test_no_bandwidth_counters_means_no_series(tmp_path, content):
    path = tmp_path / "cpu.stat"
    path.write_text(content)
    assert _scrape(CgroupCpuThrottlingCollector(path)) == {}


def test_missing_cpu_stat_means_no_series(tmp_path):
    assert _scrape(CgroupCpuThrottlingCollector(tmp_path / "absent" / "cpu.stat")) == {}


def _histogram() -> tuple[Histogram, CollectorRegistry]:
    registry = CollectorRegistry()
    return Histogram("test_loop_lag_seconds", "lag", buckets=(0.001, 0.01, 0.1, 1), registry=registry), registry


def _samples(registry: CollectorRegistry, name: str) -> dict[str, float]:
    return {
        s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else ""): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name.startswith(name)
    }


async def test_loop_lag_monitor_records_the_time_the_loop_was_blocked():
    histogram, registry = _histogram()
    task = start_loop_lag_monitor(0.01, histogram)
    try:
        await asyncio.sleep(0)  # the monitor starts its first 10 ms sleep
        time.sleep(0.06)  # hold the loop: the monitor wakes at least 50 ms late
        await asyncio.sleep(0.03)  # let it wake and record, then take a few more samples
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    samples = _samples(registry, "test_loop_lag_seconds")
    assert samples["test_loop_lag_seconds_count"] >= 1
    assert samples["test_loop_lag_seconds_sum"] >= 0.05
    # at least one observation above 10 ms: the blocked interval
    assert samples["test_loop_lag_seconds_bucket{le=0.01}"] < samples["test_loop_lag_seconds_count"]


@pytest.mark.parametrize("interval", [0, -1, 61])
async def test_loop_lag_interval_must_be_in_range(interval):
    with pytest.raises(ValueError, match="interval_s"):
        start_loop_lag_monitor(interval)


def test_loop_lag_monitor_needs_a_running_loop():
    with pytest.raises(RuntimeError):
        start_loop_lag_monitor(0.1)


def test_metrics_server_serves_process_metrics_on_a_free_port(tmp_path, monkeypatch):
    cpu_stat = tmp_path / "cpu.stat"
    cpu_stat.write_text(V2_THROTTLED)
    monkeypatch.setattr(process_metrics, "find_cpu_stat", lambda: cpu_stat)
    try:
        port = start_metrics_server(0, "retrieval")
        assert port > 0
        start_metrics_server(0, "retrieval")  # a second server in one process registers nothing twice
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        stop_metrics_servers()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [info] = families["switchyard_service_info"].samples
    assert info.labels["service"] == "retrieval"
    assert families["switchyard_cpu_throttled_periods"].samples[0].value == 2215
    assert "switchyard_event_loop_lag_seconds" in families
    assert "switchyard_queue_wait_seconds" in families


def test_a_metrics_port_answers_404_off_its_metrics_path():
    """prometheus_client serves the exposition at any path: /api/v1/agent/x/status on a metrics port (the
    HTTP face's route, a port mixed up) answered 200 with metrics text."""
    import urllib.error

    try:
        port = start_metrics_server(0, "orchestrator")
        for path in ("/metrics", "/"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
                assert response.status == 200 and b"switchyard_service_info" in response.read()
        for path in ("/api/v1/agent/test-001/status", "/healthz", "/metricsx"):
            with pytest.raises(urllib.error.HTTPError) as missing:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10)
            assert missing.value.code == 404 and b"this is a metrics port: /metrics" in missing.value.read()
        # HEAD answers GET's status and headers without the body (it was 405, Allow: OPTIONS,GET)
        head = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD")
        with urllib.request.urlopen(head, timeout=10) as response:
            assert response.status == 200 and response.read() == b""
            assert response.headers["Content-Type"].startswith("text/plain")
            # the GET's length, not 0 (wsgiref set it from the empty body a HEAD returns)
            assert int(response.headers["Content-Length"]) > len(b"switchyard_service_info")
    finally:
        stop_metrics_servers()


def test_a_metrics_port_serves_a_bounded_number_of_connections_and_closes_idle_ones(monkeypatch, capsys):
    """Each connection held a thread of the service's process for as long as its client kept it open: 300 idle
    connections to a running orchestrator's metrics port took 50 to 180 threads from it, and kept them while
    open. One past the bound is answered 503 at once; a connection that sends nothing is closed."""
    import socket
    import urllib.error

    def scrape(port: int) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
                response.read()
                return response.status
        except urllib.error.HTTPError as exc:
            assert exc.headers["Retry-After"] == "1"
            assert exc.read() == b"metrics port busy: 3 connections open, the most it serves at once; retry\n"
            return exc.code

    monkeypatch.setattr(process_metrics, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(process_metrics, "IDLE_TIMEOUT_S", 600.0)  # held by their clients until closed below
    try:
        port = start_metrics_server(0, "orchestrator")
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        for sock in idle:
            sock.sendall(b"G")  # a byte of a request line, no more
        # until the server has taken all three, each on a thread of its own: then 503, at once
        assert next(status for status in (scrape(port) for _ in range(500)) if status != 200) == 503
        for sock in idle:
            sock.close()
        assert next(status for status in (scrape(port) for _ in range(500)) if status != 503) == 200  # freed

        monkeypatch.setattr(process_metrics, "IDLE_TIMEOUT_S", 0.2)
        port = start_metrics_server(0, "retrieval")
        quiet = socket.create_connection(("127.0.0.1", port))
        quiet.settimeout(30)  # a guard, never reached: the server closes it once idle past IDLE_TIMEOUT_S
        assert quiet.recv(100) == b""
        quiet.close()
        assert scrape(port) == 200
    finally:
        stop_metrics_servers()
    assert "Traceback" not in capsys.readouterr().err  # an idle client closed is not an error


def test_metrics_port_in_use_names_the_port():
    try:
        port = start_metrics_server(0, "dispatcher")
        with pytest.raises(OSError, match=f"metrics port 127.0.0.1:{port} for dispatcher: is another process using "
                                          r"it\? Choose another port \(dispatcher.metrics_port"):
            start_metrics_server(port, "dispatcher")
    finally:
        stop_metrics_servers()


def test_serve_with_its_metrics_port_taken_says_so_and_nothing_else():
    """`switchyard serve dispatcher --metrics-port P` with P taken logged "[Errno 98] metrics port ... Address already
    in use" (no key, no way out, unlike a taken gRPC port) and then a traceback: "Exception ignored in
    Server.__del__ ... RuntimeError: Event loop is closed" (its gRPC server, started before the metrics port, was
    never stopped). The metrics port is bound first now: nothing else to undo."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "SWITCHYARD_DRAM_ADDR": "127.0.0.1:1"}  # no Redis wanted: the start fails before
        done = subprocess.run([sys.executable, "-m", "switchyard.cli", "serve", "dispatcher", "--port", "0",
                               "--metrics-port", str(port)], capture_output=True, text=True, timeout=120, env=env)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert (f"dispatcher failed to start: [Errno 98] could not bind the metrics port 127.0.0.1:{port} for dispatcher: "
            "is another process using it? Choose another port (dispatcher.metrics_port") in said, said
    assert "Traceback" not in said and "Exception ignored" not in said, said


@pytest.mark.parametrize("accept", [
    None,  # curl, a browser
    "text/plain;version=0.0.4;q=1,*/*;q=0.1",
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;"
    "version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,"
    "*/*;q=0.2",  # Prometheus 3's scrape
    "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",  # Prometheus 2's
])
def test_every_services_metrics_parse_with_the_parser_of_the_format_served(accept):
    """Every metric the three services register, served as Prometheus asks for them, read back by
    prometheus_client's own parser of the format the Content-Type names (OpenMetrics when asked): a metric that
    one of the two parsers refuses fails a scrape, and with it every figure the services export."""
    import gzip

    import switchyard.common.http_telemetry  # noqa: F401 - registers the services' metrics in this process
    import switchyard.dispatcher.metrics  # noqa: F401
    import switchyard.gateway.metrics  # noqa: F401
    import switchyard.orchestrator.metrics  # noqa: F401
    import switchyard.retrieval.metrics  # noqa: F401
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families

    switchyard.common.http_telemetry.observe_refused(431)  # a labelled histogram with samples
    try:
        port = start_metrics_server(0, "orchestrator")
        headers = {"Accept-Encoding": "gzip", **({"Accept": accept} if accept else {})}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            body, content_type = response.read(), response.headers["Content-Type"]
            if response.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
    finally:
        stop_metrics_servers()
    text = body.decode()
    if accept and accept.startswith("application/openmetrics-text"):
        assert content_type.startswith("application/openmetrics-text; version=1.0.0"), content_type
        assert text.endswith("# EOF\n")
        samples = {s.name for f in openmetrics_families(text) for s in f.samples}
    else:
        assert content_type.startswith("text/plain; version=0.0.4"), content_type
        samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"switchyard_agents_concurrent", "switchyard_running_sequences", "switchyard_service_info",
            "switchyard_event_loop_lag_seconds_count", "http_server_request_duration_seconds_bucket"} <= samples, sorted(samples)[:20]
