"""switchyard top's arithmetic and arguments, on Prometheus text as the services write it."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from switchyard_harness.top import Scrape, histogram_quantile, metrics_url, parse, render, snapshot

pytestmark = pytest.mark.no_gpu

INF = math.inf


def test_histogram_quantile_interpolates_inside_the_bucket_like_promql() -> None:
    # 10 observations: 4 <= 0.1, 6 in (0.1, 0.5]. P50: rank 5, 1 of 6 into (0.1, 0.5].
    buckets = [(0.1, 4), (0.5, 10), (INF, 10)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 1 / 6)
    assert histogram_quantile(0.2, buckets) == pytest.approx(0.05)  # the first bucket starts at 0
    # A rank in the +Inf bucket is the largest finite bound, as in promql/quantile.go.
    assert histogram_quantile(0.99, [(0.1, 4), (0.5, 5), (INF, 10)]) == 0.5
    assert histogram_quantile(0.5, [(0.1, 0), (INF, 0)]) is None
    assert histogram_quantile(0.5, [(0.1, 3)]) is None  # no +Inf bucket


def test_batches_of_one_request_each_read_p95_one_not_an_interpolated_fraction() -> None:
    """A batch holds at least one request: the first bucket (le=1) starts at 1, not PromQL's 0."""
    registry = CollectorRegistry()
    sizes = Histogram("switchyard_batch_size", "", buckets=(1, 2, 4, 8), registry=registry)
    for _ in range(20):
        sizes.observe(1)
    shown = snapshot({"dispatcher": Scrape("dispatcher", "u", parse(generate_latest(registry).decode()), at=1.0)})
    assert shown["batch"]["p95_size"] == 1.0
    assert histogram_quantile(0.95, [(1, 20), (2, 20), (INF, 20)]) == pytest.approx(0.95)  # PromQL's own rule
    assert histogram_quantile(0.95, [(1, 20), (2, 20), (INF, 20)], lowest=1.0) == 1.0
    assert histogram_quantile(0.5, [(1, 0), (2, 10), (INF, 10)], lowest=1.0) == pytest.approx(1.5)


def _dispatcher_text(ttft: list[float], tokens: int, busy: float, flushes: int) -> str:
    registry = CollectorRegistry()
    h = Histogram("switchyard_ttft_seconds", "", ["priority_class"], buckets=(0.01, 0.1, 1), registry=registry)
    for value in ttft:
        h.labels("core").observe(value)
    Counter("switchyard_generated_tokens", "", registry=registry).inc(tokens)
    Counter("switchyard_engine_busy_seconds", "", registry=registry).inc(busy)
    Gauge("switchyard_engine_decode_bound_tokens_per_second", "", registry=registry).set(1000)
    Counter("switchyard_flushes", "", ["reason"], registry=registry).labels("size").inc(flushes)
    g = Gauge("switchyard_queue_depth", "", ["queue"], registry=registry)
    g.labels("inference").set(128)
    Gauge("switchyard_queue_capacity", "", ["queue"], registry=registry).labels("inference").set(512)
    return generate_latest(registry).decode()


def test_a_window_covers_only_what_happened_between_two_scrapes() -> None:
    before = Scrape("dispatcher", "u", parse(_dispatcher_text([0.005] * 10, tokens=1000, busy=2.0, flushes=5)), at=10.0)
    # Since then: 10 slow first tokens, 500 tokens in 1 busy second, 3 flushes.
    after = Scrape("dispatcher", "u", parse(_dispatcher_text([0.005] * 10 + [0.5] * 10, 1500, 3.0, 8)), at=11.0)

    since_start = snapshot({"dispatcher": after})
    assert since_start["window_s"] is None
    assert since_start["classes"]["core"]["ttft_count"] == 20
    assert since_start["classes"]["core"]["ttft_p50_s"] == pytest.approx(0.01)  # rank 10 of 20: top of (0, 0.01]
    assert since_start["engine"]["roofline_efficiency"] == pytest.approx(1500 / 3.0 / 1000)

    window = snapshot({"dispatcher": after}, {"dispatcher": before})
    assert window["window_s"] == 1.0
    assert window["classes"]["core"]["ttft_count"] == 10
    assert window["classes"]["core"]["ttft_p50_s"] == pytest.approx(0.1 + 0.9 * 5 / 10)  # all 10 in (0.1, 1]
    assert window["engine"]["roofline_efficiency"] == pytest.approx(500 / 1.0 / 1000)
    assert window["batch"]["flushes"] == {"size": 3}
    assert window["queues"]["inference"]["saturation"] == 0.25


def test_a_counter_reset_counts_from_zero() -> None:
    before = Scrape("dispatcher", "u", parse(_dispatcher_text([], tokens=1000, busy=2.0, flushes=5)), at=1.0)
    restarted = Scrape("dispatcher", "u", parse(_dispatcher_text([], tokens=40, busy=0.5, flushes=1)), at=2.0)
    window = snapshot({"dispatcher": restarted}, {"dispatcher": before})
    assert window["batch"]["flushes"] == {"size": 1}
    assert window["engine"]["roofline_efficiency"] == pytest.approx(40 / 0.5 / 1000)


def test_dispatcher_replicas_are_read_as_one_fleet_and_a_dead_one_is_shown() -> None:
    """switchyard up --dispatchers 2: top read the first dispatcher only (half the fleet's figures) and called the
    stack up with the second one dead."""
    one = Scrape("dispatcher", "u1", parse(_dispatcher_text([0.005] * 10, tokens=1000, busy=2.0, flushes=5)), at=1.0)
    two = Scrape("dispatcher-2", "u2", parse(_dispatcher_text([0.5] * 10, tokens=500, busy=1.0, flushes=3)), at=1.0)
    fleet = snapshot({"dispatcher": one, "dispatcher-2": two})
    assert fleet["classes"]["core"]["ttft_count"] == 20  # both replicas' first tokens
    assert fleet["batch"]["flushes"] == {"size": 8}
    assert fleet["queues"]["inference"]["depth"] == 256 and fleet["queues"]["inference"]["saturation"] == 0.25
    assert fleet["engine"]["roofline_efficiency"] == pytest.approx(1500 / 3.0 / 1000)  # the bound is per engine
    dead = Scrape("dispatcher-2", "u2", error="URLError: refused")
    half = snapshot({"dispatcher": one, "dispatcher-2": dead})
    assert half["services"]["dispatcher-2"]["up"] is False and half["classes"]["core"]["ttft_count"] == 10


def test_a_replica_that_dies_or_restarts_changes_no_window_but_its_own_share() -> None:
    """Each replica's increase is taken against its own previous scrape: summing first read a dead replica's
    absence as a counter reset and showed the fleet's lifetime total as the window's."""
    def replica(name: str, flushes: int, at: float) -> Scrape:
        return Scrape(name, name, parse(_dispatcher_text([], tokens=0, busy=1.0, flushes=flushes)), at=at)

    before = {"dispatcher": replica("dispatcher", 1000, 1.0), "dispatcher-2": replica("dispatcher-2", 5000, 1.0)}
    one_died = {"dispatcher": replica("dispatcher", 1010, 2.0),
                "dispatcher-2": Scrape("dispatcher-2", "u2", error="URLError: refused", at=2.0)}
    assert snapshot(one_died, before)["batch"]["flushes"] == {"size": 10}
    restarted = {"dispatcher": replica("dispatcher", 1500, 2.0), "dispatcher-2": replica("dispatcher-2", 5, 2.0)}
    assert snapshot(restarted, before)["batch"]["flushes"] == {"size": 500 + 5}


def test_an_up_file_that_lists_no_service_is_no_crash(tmp_path, capsys) -> None:
    (tmp_path / "up.json").write_text('{"pid": 1, "services": {}}')
    from switchyard_harness.top import main

    assert main(["--once", "--json", "--up-file", str(tmp_path / "up.json")]) in (0, 1)


def test_once_exits_1_naming_every_service_down_when_none_answers(tmp_path) -> None:
    """Every service down (nothing listens at any endpoint): ``--once`` exits non-zero, with and without
    ``--json``, and stderr names each one down, so that a script can rely on the exit status."""
    ports = []
    for _ in range(3):  # three ports nothing listens on (bound, then closed)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    flags = [f"--{name}=127.0.0.1:{port}" for name, port in zip(("orchestrator", "retrieval", "dispatcher"), ports)]
    for extra in (["--json"], []):
        out = subprocess.run([sys.executable, "-m", "switchyard.cli", "top", "--once", *extra, *flags],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 1, (extra, out.returncode, out.stderr)
        assert "switchyard top: 3 of 3 services down: orchestrator (" in out.stderr, out.stderr
        assert "retrieval (" in out.stderr and "dispatcher (" in out.stderr, out.stderr


def test_an_up_file_that_gives_no_endpoints_is_named_with_why(tmp_path) -> None:
    """The config's ports are used, and the header says why the up file gave none; a folder, a binary file and a
    JSON file with no services read '(PATH not found)'."""
    import argparse

    from switchyard_harness.top import SERVICES, endpoints_from

    (tmp_path / "binary.json").write_bytes(b"\xc7\x00\xff")
    (tmp_path / "other.json").write_text('{"meta": {}}')
    for name, why in (("absent.json", "not found"), (".", "is a directory, not an up file"),
                      ("binary.json", "is not an up file (not JSON)"),
                      ("other.json", "is not an up file (no services with their metrics_url)")):
        path = tmp_path / name
        args = argparse.Namespace(up_file=str(path), config_dir=None, **{s: None for s in SERVICES})
        urls, source = endpoints_from(args)
        assert source == f"config ({path} {why})" and set(urls) == set(SERVICES)


def test_a_header_names_the_flags_beside_the_up_file_the_rest_came_from(tmp_path) -> None:
    """`switchyard top --dispatcher X` read X, and the header said 'endpoints from up file PATH' alone."""
    import argparse
    import json

    from switchyard_harness.top import SERVICES, endpoints_from

    path = tmp_path / "up.json"
    path.write_text(json.dumps({"pid": os.getpid(), "services": {
        name: {"address": "127.0.0.1:1", "metrics_url": f"http://127.0.0.1:{i + 1}/metrics", "pid": os.getpid()}
        for i, name in enumerate(SERVICES)}}))
    flags = {s: None for s in SERVICES} | {"dispatcher": "127.0.0.1:9"}
    urls, source = endpoints_from(argparse.Namespace(up_file=str(path), config_dir=None, **flags))
    assert source == f"--dispatcher, the rest from up file {path}", source
    assert urls["dispatcher"] == "http://127.0.0.1:9/metrics"
    everything = {s: "127.0.0.1:9" for s in SERVICES}
    assert endpoints_from(argparse.Namespace(up_file=str(path), config_dir=None, **everything))[1] == "flags"


def test_a_stale_up_file_the_user_names_is_said_to_be_stale_and_never_removed(tmp_path, monkeypatch) -> None:
    """`switchyard top --up-file X` (and `switchyard profile --up-file X`) removed X when its switchyard up was
    gone, and every up-<pid>.json of a gone launcher in X's folder with it: a viewer deleted files the user
    named. It now says X is stale and reads the config's ports, leaving the files as they are; the shared up file
    ($SWITCHYARD_UP_FILE here) is still cleaned up by whoever reads it."""
    import argparse
    import json
    import subprocess

    from switchyard_harness.top import SERVICES, endpoints_from

    done = subprocess.Popen(["true"])
    done.wait()
    dead = done.pid
    named, beside = tmp_path / "mine.json", tmp_path / f"up-{dead}.json"
    record = {"pid": dead, "services": {"orchestrator": {"address": "127.0.0.1:1",
                                                         "metrics_url": "http://127.0.0.1:1/metrics", "pid": dead}}}
    for path in (named, beside):
        path.write_text(json.dumps(record))
    shared = tmp_path / "shared" / "up.json"
    shared.parent.mkdir()
    shared.write_text(json.dumps(record))
    monkeypatch.setenv("SWITCHYARD_UP_FILE", str(shared))
    args = argparse.Namespace(up_file=str(named), config_dir=None, **{s: None for s in SERVICES})
    urls, source = endpoints_from(args)
    assert source == f"config ({named} is stale: its switchyard up, pid {dead}, is gone; left in place)", source
    assert urls["orchestrator"] != "http://127.0.0.1:1/metrics" and set(urls) == set(SERVICES)  # not read
    assert named.exists() and beside.exists() and shared.exists()
    urls, source = endpoints_from(argparse.Namespace(up_file=None, config_dir=None, **{s: None for s in SERVICES}))
    assert source == f"config ({shared} removed: its switchyard up, pid {dead}, is gone)", source
    assert not shared.exists() and named.exists() and beside.exists()


def test_profile_says_a_stale_up_file_it_was_named_is_stale(tmp_path, monkeypatch, capsys) -> None:
    """`switchyard profile --up-file X` with X stale profiled the config's port and said nothing of X (its help
    says a stale file is said to be stale): it now says where the endpoint came from and why, and leaves X."""
    import json
    import subprocess

    from switchyard_harness.cpu_profile import profile_url

    done = subprocess.Popen(["true"])
    done.wait()
    named = tmp_path / "mine.json"
    named.write_text(json.dumps({"pid": done.pid, "services": {"dispatcher": {
        "address": "127.0.0.1:1", "metrics_url": "http://127.0.0.1:1/metrics", "pid": done.pid}}}))
    monkeypatch.setenv("SWITCHYARD_UP_FILE", str(tmp_path / "shared" / "up.json"))
    url = profile_url("dispatcher", str(named), None, 1.0)
    assert "127.0.0.1:1/" not in url and named.exists()
    said = capsys.readouterr().err
    assert said == (f"switchyard profile: the dispatcher's endpoint from the config ({named} is stale: its switchyard "
                    f"up, pid {done.pid}, is gone; left in place)\n"), said


def test_an_unreachable_service_is_reported_not_raised() -> None:
    snap = snapshot({"orchestrator": Scrape("orchestrator", "http://x/metrics", error="URLError: refused")})
    assert snap["services"] == {"orchestrator": {"url": "http://x/metrics", "up": False, "error": "URLError: refused"}}
    assert snap["tasks_in_flight"] is None and "engine" not in snap


def test_metrics_url_takes_host_port_or_a_url() -> None:
    assert metrics_url("127.0.0.1:9103") == "http://127.0.0.1:9103/metrics"
    assert metrics_url("http://10.0.0.7:9103") == "http://10.0.0.7:9103/metrics"
    assert metrics_url("https://d.example/prom/metrics") == "https://d.example/prom/metrics"
    with pytest.raises(ValueError, match="host:port or a URL"):
        metrics_url("dispatcher")
    for past in ("127.0.0.1:99999", "http://127.0.0.1:99999/metrics", "127.0.0.1:0"):  # dialled modulo 65536
        with pytest.raises(ValueError, match="a port in 1-65535"):
            metrics_url(past)


@pytest.mark.parametrize(("args", "says"), [
    (["--json"], "--json: expected together with --once"),
    (["--once", "--dispatcher", "nohost"], "--dispatcher: expected host:port or a URL"),
    (["--interval", "0"], "--interval: expected seconds in [0.1, 60]"),
])
def test_bad_arguments_name_the_flag(args: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "switchyard.cli", "top", *args], capture_output=True, text=True)
    assert out.returncode == 2 and says in out.stderr, out.stderr


def _upstream_text(calls: int, endings: dict[str, int], circuit: str = "closed", endpoints: int = 1) -> str:
    registry = CollectorRegistry()
    Counter("switchyard_gateway_requests", "", ["model", "outcome"], registry=registry).labels("sim-7b", "ok").inc(calls)
    Gauge("switchyard_upstream_concurrency_limit", "", registry=registry).set(24.0)  # streams: the pool admits whole ones (PoolLimit.limit)
    Gauge("switchyard_upstream_concurrency_knee", "", registry=registry).set(22)
    Gauge("switchyard_upstream_in_flight", "", registry=registry).set(20)
    ended = Counter("switchyard_upstream_stream_endings", "", ["ending"], registry=registry)
    for ending, n in endings.items():
        ended.labels(ending).inc(n)
    state = Gauge("switchyard_gateway_circuit_state", "", ["model", "state"], registry=registry)
    for name in ("closed", "open", "half_open"):
        state.labels("sim-7b", name).set(endpoints if name == circuit else 0)  # endpoints per state
    return _dispatcher_text([], tokens=0, busy=0.0, flushes=0) + generate_latest(registry).decode()


def test_a_stream_engine_shows_its_upstream_instead_of_an_idle_engine() -> None:
    """With the openai engine the dispatcher's own engine and KV read 0 (the model server holds them): top
    shows the upstream's limit, knee, streams, their endings and any circuit not closed instead."""
    from rich.console import Console

    before = Scrape("dispatcher", "u", parse(_upstream_text(10, {"done_marker": 10})), at=1.0)
    after = Scrape("dispatcher", "u", parse(_upstream_text(40, {"done_marker": 25, "finish_reason": 5, "cut": 1},
                                                           circuit="open")), at=2.0)
    up = snapshot({"dispatcher": after}, {"dispatcher": before})["upstream"]
    assert up == {"limit": 24.0, "knee": 22, "in_flight": 20, "circuits": {"sim-7b": {"open": 1}},
                  "endpoints": None, "endpoints_down": [],
                  "stream_endings": {"done_marker": 15, "finish_reason": 5, "whole_answer": 0, "error": 0,
                                     "cut": 1, "timeout": 0, "cancelled": 0}}
    console = Console(width=120, record=True)
    console.print(render(snapshot({"dispatcher": after}, {"dispatcher": before}), "flags"))
    text = console.export_text()
    assert "upstream  in flight 20 of limit 24   knee 22   circuits: sim-7b open" in text
    assert "finish_reason 5, whole_answer 0, error 0, cut 1, timeout 0, cancelled 0" in text
    assert "engine  busy" not in text
    # a step engine (no upstream call made, none in flight) keeps its engine line
    idle = _upstream_text(0, {}).replace("switchyard_upstream_in_flight 20.0", "switchyard_upstream_in_flight 0.0")
    assert snapshot({"dispatcher": Scrape("dispatcher", "u", parse(idle), at=1.0)})["upstream"] is None
    # a pool: the gauge counts endpoints, two of three open (top read "all closed": it looked for a value of 1)
    pool = Scrape("dispatcher", "u", parse(_upstream_text(40, {"done_marker": 25}, circuit="open", endpoints=2)),
                  at=2.0)
    assert snapshot({"dispatcher": pool}, {"dispatcher": before})["upstream"]["circuits"] == {"sim-7b": {"open": 2}}


def test_top_shows_streams_that_ended_with_an_error_inside_them() -> None:
    """The gateway counts the stream endings; top showed all but and left out ``error`` (an error object inside
    the stream, as vLLM sends when a request fails mid-answer), so a server failing streams that way read as
    healthy."""
    from rich.console import Console

    before = Scrape("dispatcher", "u", parse(_upstream_text(10, {"finish_reason": 10})), at=1.0)
    after = Scrape("dispatcher", "u", parse(_upstream_text(17, {"finish_reason": 12, "error": 5})), at=2.0)
    snap = snapshot({"dispatcher": after}, {"dispatcher": before})
    assert snap["upstream"]["stream_endings"] == {"done_marker": 0, "finish_reason": 2, "whole_answer": 0,
                                                  "error": 5, "cut": 0, "timeout": 0, "cancelled": 0}
    console = Console(width=120, record=True)
    console.print(render(snap, "flags"))
    assert ("stream endings: done_marker 0, finish_reason 2, whole_answer 0, error 5, cut 0, timeout 0, cancelled 0"
            in console.export_text())


def test_the_upstream_shows_while_its_first_streams_are_in_flight() -> None:
    """A request is counted in ``switchyard_gateway_requests_total`` when it ends: while a fresh dispatcher's
    first streams ran (long answers), top showed the engine line instead of the upstream's, with no stream, no
    limit and no circuit in view."""
    first = Scrape("dispatcher", "u", parse(_upstream_text(0, {})), at=1.0)  # the gauges: 20 streams in flight
    up = snapshot({"dispatcher": first})["upstream"]
    assert up is not None and up["in_flight"] == 20 and up["limit"] == 24.0


def test_a_pool_endpoint_that_is_down_shows_in_the_upstream_line() -> None:
    """One of a pool's two model servers killed: its circuits stay closed (no call reaches it), so top read
    "circuits: all closed" and showed nothing of the endpoint the dispatcher had marked down."""
    from rich.console import Console

    registry = CollectorRegistry()
    up = Gauge("switchyard_gateway_endpoint_up", "", ["endpoint"], registry=registry)
    up.labels("10.0.0.7:8000").set(1)
    up.labels("10.0.0.8:8000").set(0)
    text = _upstream_text(12, {"finish_reason": 12}) + generate_latest(registry).decode()
    snap = snapshot({"dispatcher": Scrape("dispatcher", "u", parse(text), at=1.0)})
    assert snap["upstream"]["endpoints"] == 2 and snap["upstream"]["endpoints_down"] == ["10.0.0.8:8000"]
    console = Console(width=160, record=True)
    console.print(render(snap, "flags"))
    assert "circuits: all closed   endpoints up 1 of 2 (down: 10.0.0.8:8000)" in console.export_text()


@pytest.fixture
def metrics_endpoint():
    """A real Prometheus endpoint on 127.0.0.1 (prometheus_client's own server) with a dispatcher's figures,
    its GPU utilisation NaN as a dispatcher without NVML exports it; yields its host:port."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    Gauge("switchyard_engine_busy_ratio", "", registry=registry).set(0.25)
    Gauge("switchyard_gpu_utilization_ratio", "", registry=registry).set(math.nan)
    Gauge("switchyard_compute_score", "", registry=registry).set(math.inf)
    g = Gauge("switchyard_queue_depth", "", ["queue"], registry=registry)
    g.labels("inference").set(3)
    Gauge("switchyard_queue_capacity", "", ["queue"], registry=registry).labels("inference").set(512)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def _endpoint_flags(address: str) -> list[str]:
    return [flag for name in ("orchestrator", "retrieval", "dispatcher") for flag in (f"--{name}", address)]


def test_once_json_is_valid_json_with_null_for_a_nan_gauge(metrics_endpoint: str) -> None:
    out = subprocess.run([sys.executable, "-m", "switchyard.cli", "top", "--once", "--json",
                          *_endpoint_flags(metrics_endpoint)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr

    def refuse(constant: str) -> None:  # what a strict parser (jq, JSON.parse) does with NaN and Infinity
        raise ValueError(f"not JSON: {constant}")

    snap = json.loads(out.stdout, parse_constant=refuse)
    assert snap["engine"]["gpu_utilization_ratio"] is None and snap["engine"]["compute_score"] is None
    assert snap["engine"]["busy_ratio"] == 0.25 and snap["queues"]["inference"]["depth"] == 3


def test_json_output_writes_null_for_every_non_finite_number() -> None:
    from switchyard_harness.json_output import dumps

    value = {"a": math.nan, "b": [1.5, math.inf, (-math.inf, 2)], "c": {"d": math.nan, "e": "NaN"}, "f": None}
    assert json.loads(dumps(value)) == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": None, "e": "NaN"},
                                        "f": None}
    assert "NaN" not in dumps({"x": math.nan}, indent=2)


def test_in_a_pipe_each_frame_is_written_as_it_is_drawn(metrics_endpoint: str) -> None:
    """`switchyard top | head`: each frame reaches the pipe when it is drawn, not one frame when top ends."""
    import select
    import time

    proc = subprocess.Popen([sys.executable, "-m", "switchyard.cli", "top", "--interval", "1.5", "--frames", "2",
                             *_endpoint_flags(metrics_endpoint)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        started = time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "nothing written to the pipe"
        first = proc.stdout.readline()
        assert first.startswith("switchyard top") and proc.poll() is None  # the first frame, while top runs
        assert time.monotonic() - started < 20
        rest = proc.stdout.read()  # through the same buffered reader as the first line (communicate() is not)
        err = proc.stderr.read()
        proc.wait(60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err
    text = first + rest
    assert text.count("switchyard top") == 3  # the first frame and 2 refreshes, all of them
    assert text.count("engine  busy 25 %") == 3 and "last 1.5 s" in text


def test_without_rich_the_live_view_says_how_to_install_this_tree_extra(monkeypatch, capsys) -> None:
    """The project is not on PyPI (a package of its name there is another project): the hint installs
    this tree's ``top`` extra, not ``switchyard[top]`` from the index."""
    from switchyard_harness import top

    monkeypatch.setitem(sys.modules, "rich", None)  # import rich raises ImportError
    assert top.main(["--orchestrator", "127.0.0.1:1", "--retrieval", "127.0.0.1:1",
                     "--dispatcher", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[top]'" in err
    assert "switchyard[" not in err


def test_a_grpc_port_given_for_metrics_is_named_not_a_crash(capsys) -> None:
    """`switchyard top --orchestrator HOST:GRPC_PORT` and `switchyard profile HOST:GRPC_PORT` (the port switchyard up
    prints first, not its metrics port) ended in a traceback of http.client.BadStatusLine that printed the gRPC
    server's binary answer to the terminal."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from switchyard_harness import cpu_profile
    from switchyard_harness.top import NOT_HTTP1, main

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert main(["--once", "--json", "--orchestrator", f"127.0.0.1:{port}"]) in (0, 1)
        snap = json.loads(capsys.readouterr().out)
        assert cpu_profile.main([f"127.0.0.1:{port}", "--seconds", "1"]) == 1
        said = capsys.readouterr().err
    finally:
        server.stop(None)
    orchestrator = snap["services"]["orchestrator"]
    assert orchestrator["up"] is False and orchestrator["error"] == f"ValueError: {NOT_HTTP1}", orchestrator
    assert said.endswith(f"/debug/pprof/profile?seconds=1: {NOT_HTTP1}\n"), said
    assert "\x00" not in said


def test_the_task_store_state_shows_beside_the_dram_tiers() -> None:
    """The task store has its own Redis client (or SQLite file): with it down every SubmitTask, GetTaskStatus and
    CancelTask answered 503 while top said "DRAM tier up" and nothing of the store. It shows
    ``switchyard_task_store_up`` beside the tier."""
    from rich.console import Console

    def orchestrator(store_up: float) -> Scrape:
        registry = CollectorRegistry()
        Gauge("switchyard_agents_concurrent", "", registry=registry).set(3)
        Gauge("switchyard_dram_up", "", registry=registry).set(1)
        Gauge("switchyard_task_store_up", "", registry=registry).set(store_up)
        return Scrape("orchestrator", "u", parse(generate_latest(registry).decode()), at=1.0)

    for store_up, says in ((0.0, "task store DOWN (SubmitTask, GetTaskStatus, CancelTask answer UNAVAILABLE)"),
                           (1.0, "task store up")):
        dispatcher = Scrape("dispatcher", "u", parse(_upstream_text(0, {})), at=1.0)
        snap = snapshot({"orchestrator": orchestrator(store_up), "dispatcher": dispatcher})
        assert snap["task_store_up"] is (store_up == 1.0) and snap["dram"]["up"]
        console = Console(width=200, record=True)
        console.print(render(snap, "flags"))
        assert f"tasks in flight 3   DRAM tier up, outages -, degraded operations -   {says}" in (
            console.export_text()), console.export_text()
    assert snapshot({})["task_store_up"] is None
