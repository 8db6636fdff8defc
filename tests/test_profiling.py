"""CPU profiles on demand: /debug/pprof/profile on a real metrics port, read back with a parser compiled
from pprof's own profile.proto at test time (grpcio-tools' protoc), and `switchyard profile`'s report."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import importlib
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from grpc_tools import protoc

from switchyard_harness import cpu_profile
from switchyard.common import process_metrics
from switchyard.common.auth import BearerTokens
from switchyard.common.config import AuthConfig
from switchyard.common.profiling import GcPauses, LoopProfiler, ProfileEndpoint, top_functions

pytestmark = pytest.mark.no_gpu
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pprof_schema(tmp_path_factory):
    """profile_pb2 compiled now from proto/profile.proto (github.com/google/pprof), not the committed module."""
    out = tmp_path_factory.mktemp("pprof")
    assert protoc.main(["protoc", f"-I{ROOT / 'proto'}", f"--python_out={out}", str(ROOT / "proto" / "profile.proto")]) == 0
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module("profile_pb2")
    finally:
        sys.path.remove(str(out))
        sys.modules.pop("profile_pb2", None)


def render_prompt_like_work(n: int) -> int:
    """CPU work with a name to find in the profile."""
    return sum(len(str(i * i)) for i in range(n))


async def busy_loop(stop: asyncio.Event) -> None:
    """A busy service's loop: CPU work in callbacks, and a wait for I/O between them (1 ms), where the loop
    lets go of the GIL. ``sleep(0)`` never waits, so the loop would hold the GIL but for the interpreter's
    switch interval, and the metrics server's threads (each socket call gives the GIL up and waits to take it
    back) could starve for tens of seconds on a machine whose threads are slow to be woken."""
    while not stop.is_set():
        render_prompt_like_work(20_000)
        gc.collect(0)  # a collection in the window: its pause is reported
        await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def profiled_service(host: str = "127.0.0.1", mode: str = "loopback", tokens=None):
    """A metrics port on 127.0.0.1 serving the profile of this test's loop, which runs busy_loop."""
    endpoint = ProfileEndpoint(LoopProfiler(asyncio.get_running_loop()), mode, host, 60, tokens)
    port = process_metrics.start_metrics_server(0, "test", "127.0.0.1", profile=endpoint)
    stop = asyncio.Event()
    work = asyncio.create_task(busy_loop(stop))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        await work
        process_metrics.stop_metrics_servers()


def fetch(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    return fetch_with_headers(url, headers)[:2]


def fetch_with_headers(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as reply:
            return reply.status, reply.read(), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


async def test_a_profile_is_pprof_that_profile_proto_parses_naming_the_busy_function(pprof_schema):
    assert sys.getprofile() is None and not any(isinstance(c, GcPauses) for c in gc.callbacks)
    async with profiled_service() as base:
        status, data = await asyncio.to_thread(fetch, f"{base}/debug/pprof/profile?seconds=1")
        assert status == 200
        metrics_status, metrics = await asyncio.to_thread(fetch, f"{base}/metrics")
        assert metrics_status == 200 and b"switchyard_service_info" in metrics  # the same port still serves metrics
    assert sys.getprofile() is None and not any(isinstance(c, GcPauses) for c in gc.callbacks)  # nothing left running
    profile = pprof_schema.Profile.FromString(gzip.decompress(data))  # on disk pprof is gzip'd
    strings = profile.string_table
    assert strings[0] == "" and [strings[t.type] for t in profile.sample_type] == ["samples", "wall"]
    assert strings[profile.sample_type[1].unit] == "nanoseconds" and profile.duration_nanos >= 0.9e9
    assert strings[profile.default_sample_type] == "wall"  # a string-table index (profile.proto), not a position
    location_ids = {loc.id for loc in profile.location}
    assert profile.sample and all(set(s.location_id) <= location_ids for s in profile.sample)
    rows = {r.name: r for r in top_functions(profile)}
    busy = rows["render_prompt_like_work"]
    assert busy.cum_ns > 0 and busy.filename.endswith("test_profiling.py")
    assert busy.cum_ns >= rows["<genexpr>"].cum_ns  # the caller's cumulative time holds its callee's
    notes = dict(strings[i].split("=", 1) for i in profile.comment if "=" in strings[i] and " " not in strings[i])
    assert int(notes["gc_collections"]) > 0 and int(notes["gc_pause_ns"]) > 0


async def test_the_profile_command_prints_top_functions_and_gc_pauses(capsys):
    async with profiled_service() as base:
        address = base.removeprefix("http://")
        code = await asyncio.to_thread(cpu_profile.main, [address, "--seconds", "1", "--top", "40"])
    out = capsys.readouterr().out
    assert code == 0
    assert "GC pauses:" in out and "collections" in out and "cum%" in out
    assert "render_prompt_like_work" in out


async def test_who_may_profile_loopback_by_default_tokens_elsewhere_never_when_off(tmp_path):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text("tok-ops-1\ntok-agents-2 agent.AgentService/*\n")
    tokens = BearerTokens(AuthConfig(enabled=True, tokens_file=str(tokens_file), tokens_env=""))
    url = "/debug/pprof/profile?seconds=0.2"
    async with profiled_service(host="10.1.2.3") as base:  # listening on a non-loopback address, no tokens
        status, body = await asyncio.to_thread(fetch, base + url)
        assert status == 403 and b"server.cpu_profile" in body
    async with profiled_service(host="0.0.0.0", mode="on") as base:
        assert (await asyncio.to_thread(fetch, base + url))[0] == 200
    async with profiled_service(mode="off") as base:
        assert (await asyncio.to_thread(fetch, base + url))[0] == 404
    async with profiled_service(host="10.1.2.3", tokens=tokens) as base:
        unauthenticated = await asyncio.to_thread(fetch_with_headers, base + url)
        assert unauthenticated[0] == 401 and unauthenticated[2]["WWW-Authenticate"].startswith("Bearer")
        forbidden = await asyncio.to_thread(fetch, base + url, {"Authorization": "Bearer tok-agents-2"})
        assert forbidden[0] == 403 and b"switchyard.Debug/CpuProfile" in forbidden[1]
        assert (await asyncio.to_thread(fetch, base + url, {"Authorization": "Bearer tok-ops-1"}))[0] == 200


async def test_one_profile_at_a_time_and_seconds_is_checked(monkeypatch):
    recording = asyncio.Event()  # the first profile holds the slot and records (a fixed 0.5 s let a loaded
    record = LoopProfiler._record  # machine's second request arrive first: it got the slot, the first a 409)

    async def recorded(self, seconds, stop):  # type: ignore[no-untyped-def]
        recording.set()
        return await record(self, seconds, stop)

    monkeypatch.setattr(LoopProfiler, "_record", recorded)
    async with profiled_service() as base:
        first = asyncio.create_task(asyncio.to_thread(fetch, f"{base}/debug/pprof/profile?seconds=1.5"))
        await asyncio.wait_for(recording.wait(), 60)  # a bound on a hang, not a speed
        status, body, headers = await asyncio.to_thread(fetch_with_headers, f"{base}/debug/pprof/profile?seconds=1")
        assert status == 409 and b"already" in body and b"ends in" in body  # and when: its caller may be gone
        assert 1 <= int(headers["Retry-After"]) <= 2
        assert (await first)[0] == 200
        for bad in ("0", "abc", "61", "0_1", "1_0", "nan", "inf", "%201", "1e0", "", "1&seconds=2"):
            status, body = await asyncio.to_thread(fetch, f"{base}/debug/pprof/profile?seconds={bad}")
            assert status == 400 and b"seconds: expected one plain decimal number in (0, 60]" in body, bad
        for method in ("HEAD", "POST"):  # a HEAD took the one profile slot and threw the profile away
            request = urllib.request.Request(f"{base}/debug/pprof/profile?seconds=0.1", method=method)
            with pytest.raises(urllib.error.HTTPError) as refused:
                await asyncio.to_thread(urllib.request.urlopen, request, timeout=10)
            assert refused.value.code == 405 and refused.value.headers["Allow"] == "GET", method


def test_report_sums_match_the_profile():
    from switchyard.api import profile_pb2
    from switchyard.common.profiling import to_pprof

    records = [(["main\x00a.py\x001", "step\x00a.py\x0010"], 0.003), (["main\x00a.py\x001"], 0.001),
               (["main\x00a.py\x001", "step\x00a.py\x0010", "step\x00a.py\x0010"], 0.002)]
    data = gzip.compress(to_pprof(records, 0.0, 0.006, ["gc_pause_ns=1500000", "gc_collections=3"]).SerializeToString())
    rows = {r.name: r for r in top_functions(profile_pb2.Profile.FromString(gzip.decompress(data)))}
    assert rows["main"].cum_ns == 6_000_000 and rows["main"].flat_ns == 1_000_000
    assert rows["step"].cum_ns == 5_000_000 and rows["step"].flat_ns == 5_000_000  # recursion counted once
    text = cpu_profile.report(data, 5)
    assert "GC pauses: 1.5 ms in 3 collections" in text and text.index("main") < text.index("step")
    assert "on every sample, not listed: main" in text  # the entry frame; the table starts at the work


def test_the_event_loops_waiting_is_its_own_line_not_the_hottest_function():
    """uvloop waits in C below Runner.run: 73 % "flat" in Runner.run read as the hottest function."""
    from switchyard.common.profiling import to_pprof

    runner, work = "Runner.run\x00/usr/lib/python3.11/asyncio/runners.py\x00118", "render\x00w.py\x005"
    records = [(["<module>\x00m.py\x001", runner], 0.0075), (["<module>\x00m.py\x001", runner, work], 0.0025)]
    text = cpu_profile.report(gzip.compress(to_pprof(records, 0.0, 0.01, []).SerializeToString()), 5)
    assert "event loop waiting: 75.0 % of the samples" in text
    assert "on every sample, not listed: Runner.run, <module>" in text
    table = text.split("function\n", 1)[1]
    assert "render" in table and "Runner.run" not in table and "<module>" not in table


@pytest.mark.parametrize(("service", "says"), [
    ("dispatchr", "expected one of orchestrator, retrieval, dispatcher, a metrics endpoint host:port or URL, or a "
                  "saved profile's file (got 'dispatchr'); did you mean 'dispatcher'?"),
    ("nosuch", "(got 'nosuch')"),
    ("nonexist.pprof", "(got 'nonexist.pprof' (no such profile file))"),
    ("localhost:", "expected host:port or a URL, a port in 1-65535 (got 'localhost:')"),
])
def test_a_service_that_is_neither_a_name_nor_an_address_is_named(service, says):
    from switchyard_harness.cpu_profile import profile_url

    with pytest.raises(ValueError) as err:
        profile_url(service, None, None, 1.0)
    assert says in str(err.value)


def _profile_file(kind: str, path) -> None:
    from switchyard.api import profile_pb2

    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "broken gzip":
        path.write_bytes(b"\x1f\x8b\x08\x00" + b"garbage" * 10)
    else:
        p = profile_pb2.Profile()
        p.string_table.extend(["", "wall", "nanoseconds", "gc_pause_ns=abc"])
        p.sample_type.add(type=1, unit=2)
        if kind == "comment index out of range":
            p.comment.append(99)
        elif kind == "comment not a number":
            p.comment.append(3)
        else:  # a sample without its value
            p.sample.add()
        path.write_bytes(p.SerializeToString())


@pytest.mark.parametrize("kind", ["empty", "broken gzip", "comment index out of range", "comment not a number",
                                  "sample without a value"])
def test_a_file_that_is_not_a_profile_is_named_not_a_traceback(tmp_path, kind):
    import subprocess
    import sys

    saved = tmp_path / "agent_cpu.pprof"
    _profile_file(kind, saved)
    run = subprocess.run([sys.executable, "-m", "switchyard.cli", "profile", str(saved)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1 and "is not a pprof profile" in run.stderr and "Traceback" not in run.stderr, run.stderr


async def test_a_profile_whose_caller_went_away_is_stopped_and_frees_the_slot():
    """`go tool pprof` interrupted, curl -m 1, a client's timeout: the profile ran its whole window (up to
    server.cpu_profile_max_s) with the profiler's cost on the service's loop, and every other caller was answered
    409 until it ended. As Go's net/http/pprof does, a profile whose caller closed its connection stops, and the
    next one is served."""
    import time

    import httpx

    async with profiled_service() as base:
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):  # the caller gives up after half a second of a 60 s window
            async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.5)) as client:
                await client.get(f"{base}/debug/pprof/profile?seconds=60")
        for _ in range(200):
            status, body = await asyncio.to_thread(fetch, f"{base}/debug/pprof/profile?seconds=0.2")
            if status != 409:
                break
            await asyncio.sleep(0.1)
        assert status == 200 and gzip.decompress(body), body[:200]
        assert time.monotonic() - started < 60  # within the abandoned window: it was stopped, not run out


async def test_a_profile_is_served_in_a_process_holding_more_than_1024_descriptors():
    """A service with many connections (gRPC streams, an upstream pool's connections) holds descriptors past 1024,
    and the profile's check for a caller that went away used select(), which cannot take them: ValueError, the
    caller answered 500 after a quarter of a second while the profile ran its whole window on the loop, its
    slot given back (a second profile could start beside it)."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}: no descriptor past 1024 can be opened")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the metrics server's socket gets a high one
    try:
        async with profiled_service() as base:
            status, body = await asyncio.to_thread(fetch, f"{base}/debug/pprof/profile?seconds=0.5")
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert status == 200 and gzip.decompress(body), body[:200]
