"""``switchyard bench http`` (:mod:`switchyard_harness.bench.http_bench`): its submit and stream
phases against a real HTTP face (the face itself is tested in tests/test_http_face.py)."""

from __future__ import annotations

import pytest

from switchyard_harness.bench import http_bench
from switchyard_harness.bench.report import percentile
from test_http_face import http_stack

pytestmark = pytest.mark.no_gpu

WARMUP_S = 0.1
"""The stream phases' warm-up here (1 s by default, each kind, each run): what they count is the measured rounds'."""
WARMUP = str(WARMUP_S)


async def test_bench_http_counts_every_submit_and_stream_of_a_short_run():
    async with http_stack() as (client, _, down):
        base = str(client.base_url).rstrip("/")
        calls = await http_bench.submit_phase(base, rps=40, concurrency=4, duration_s=0.5, task_type="chat",
                                              max_tokens=16)
        assert len(calls.latencies) == 20 and not calls.failures
        assert calls.summary()["p95_ms"] == round(1000 * percentile(calls.latencies, 95), 3)
        over_grpc = await http_bench.submit_phase(base, rps=40, concurrency=4, duration_s=0.25, task_type="chat",
                                                  max_tokens=16, grpc_addr=down.orchestrator_address)
        assert len(over_grpc.latencies) == 10 and not over_grpc.failures
        streams = await http_bench.stream_phase(base, down.orchestrator_address, streams=2, seconds=0.3, rounds=1,
                                                warmup_s=WARMUP_S)
        for kind in ("sse", "grpc"):
            assert streams[kind].latencies and not streams[kind].failures, (kind, streams[kind].failures)


async def test_an_auth_on_stack_takes_the_token_and_every_call_failing_is_exit_1(tmp_path, monkeypatch, capsys):
    """Before: no way to send a token; against an auth-on stack every submit got 401 and the command said
    '0 ok, 60 errors {'401': 60}' and exited 0. The token comes from SWITCHYARD_AUTH_TOKEN (as switchyard run
    reads it) or --token-file, over HTTP and gRPC; a phase whose calls all failed makes the exit status 1."""
    import asyncio

    tokens = tmp_path / "tokens"
    tokens.write_text("tok-full-1\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(tokens), "tokens_env": ""}}
    monkeypatch.delenv("SWITCHYARD_AUTH_TOKEN", raising=False)
    async with http_stack(**auth) as (client, _, down):
        base = str(client.base_url).rstrip("/")
        argv = ["--http", base, "--grpc", down.orchestrator_address, "--phases", "submit", "--rps", "20", "-c", "4",
                "--duration", "0.5", "--task-type", "chat", "--max-tokens", "16"]

        assert await asyncio.to_thread(http_bench.main, argv) == 1
        captured = capsys.readouterr()
        assert "HTTP submit: 0 ok, 10 errors {'401': 10}" in captured.out
        assert "submit: every call failed (10: {'401': 10})" in captured.err
        assert "set SWITCHYARD_AUTH_TOKEN to one, or pass --token-file FILE" in captured.err

        monkeypatch.setenv("SWITCHYARD_AUTH_TOKEN", "tok-full-1")
        out = tmp_path / "http.json"
        both = ["--phases", "submit,grpc-submit,stream", "--streams", "2", "--stream-seconds", "0.3", "--rounds", "1",
                "--warmup-s", WARMUP]
        assert await asyncio.to_thread(http_bench.main, [*argv, *both, "-o", str(out)]) == 0, capsys.readouterr()
        import json

        results = json.loads(out.read_text())
        assert results["submit"]["ok"] == 10 and results["grpc-submit"]["ok"] == 10
        for kind in ("sse", "grpc"):
            assert results["stream"][kind]["ok"] > 0 and results["stream"][kind]["errors"] == 0, results["stream"]

        monkeypatch.setenv("SWITCHYARD_AUTH_TOKEN", "tok-wrong")
        token_file = tmp_path / "token"
        token_file.write_text("tok-full-1\n")
        assert await asyncio.to_thread(http_bench.main, [*argv, "--token-file", str(token_file)]) == 0  # file wins
        assert await asyncio.to_thread(http_bench.main, argv) == 1
        assert "(the token sent was refused)" in capsys.readouterr().err


def test_an_unreadable_token_file_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        http_bench.main(["--token-file", str(tmp_path / "missing")])
    assert exit_.value.code == 2
    assert f"--token-file {tmp_path / 'missing'}: cannot read it" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--rps", "nan"], "--rps: expected a finite number of calls/s > 0, got nan"),
    (["--rps", "inf"], "--rps: expected a finite number of calls/s > 0, got inf"),
    (["--duration", "-1"], "--duration: expected a finite number of seconds > 0, got -1.0"),
    (["--stream-seconds", "inf"], "--stream-seconds: expected a finite number of seconds > 0, got inf"),
    (["--profile-seconds", "nan"], "--profile-seconds: expected a finite number of seconds >= 1, got nan"),
    (["--streams", "0"], "--streams: expected at least 1, got 0"),
    (["--max-tokens", "-1"], "--max-tokens: expected at least 0 (0: the stack's default), got -1"),  # ran to 400s
    (["--warmup-s", "nan"], "--warmup-s: expected a finite number of seconds >= 0, got nan"),
])
def test_a_rate_or_time_out_of_range_is_refused_naming_its_flag_and_value(argv, words, capsys):
    """nan passed the old `<= 0` checks and --duration, --stream-seconds went unchecked (inf never ended); the
    refusal named every flag at once and no value."""
    with pytest.raises(SystemExit) as exit_:
        http_bench.main(argv)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


async def test_the_tasks_a_submit_phase_left_unfinished_are_cancelled_and_reported(tmp_path, capsys):
    """Before: the submit phases' tasks (react_loop, 512 tokens: 2,000 of them at the reference rate) stayed in the
    orchestrator's backlog, so the stream and profile phases of the same command ran beside them (SSE / gRPC 0.870
    and profiling 0.590 at 3 to 7 tasks/s, against 0.937 and 0.946 at 137 to 146 tasks/s on a stack without them),
    and they ran on for minutes after the command exited. Now each phase's unfinished tasks are cancelled after it
    and reported; --keep-backlog leaves them running."""
    import asyncio
    import json

    from registry_values import metric

    async with http_stack(**{"orchestrator.max_running_submitted_tasks": 2}) as (client, stub, down):
        down.gate = asyncio.Event()  # every model call waits: the submitted tasks stay running or queued
        base = str(client.base_url).rstrip("/")
        argv = ["--http", base, "--grpc", down.orchestrator_address, "--rps", "40", "-c", "4", "--duration", "0.25",
                "--task-type", "chat", "--max-tokens", "16"]
        out = tmp_path / "http.json"
        assert await asyncio.to_thread(http_bench.main, [*argv, "--phases", "submit,grpc-submit", "-o", str(out)]) == 0
        printed = capsys.readouterr().out
        results = json.loads(out.read_text())
        for phase, name in (("submit", "HTTP submit"), ("grpc-submit", "gRPC SubmitTask")):
            counts = results[phase]["backlog"]
            assert counts["submitted"] == 10 and counts["cancelled"] == counts["unfinished"] == 10, counts
            assert counts["running"] == 2 and counts["queued"] == 8 and counts["errors"] == 0, counts
            assert (f"backlog after {name}: 10 of the 10 tasks the phase submitted had not finished (8 queued, "
                    "2 running): cancelled (--keep-backlog keeps them)") in printed, printed
        for state in ("queued", "running"):
            assert metric("switchyard_submitted_tasks", state=state) == 0
        assert not down.requests or down.cancelled  # the running ones' model calls were cancelled too

        assert await asyncio.to_thread(http_bench.main, [*argv, "--phases", "submit", "--keep-backlog"]) == 0
        assert ("10 of the 10 tasks the phase submitted had not finished (8 queued, 2 running): kept "
                "(--keep-backlog), they run on") in capsys.readouterr().out
        assert metric("switchyard_submitted_tasks", state="queued") == 8
        down.gate.set()


async def test_the_summary_lines_count_rounds_and_profiles_in_words(capsys):
    """Before: a run with --rounds 1 printed '(16 streams, 1 rounds of 2 s each)' and its profile phase
    '(1 rounds of 2 s; profiles of [19803] bytes)', a Python list."""
    import asyncio

    async with http_stack() as (client, _, down):
        base = str(client.base_url).rstrip("/")
        argv = ["--http", base, "--grpc", down.orchestrator_address, "--phases", "stream", "--streams", "2",
                "--stream-seconds", "0.3", "--task-type", "chat", "--max-tokens", "16", "--warmup-s", WARMUP]
        assert await asyncio.to_thread(http_bench.main, [*argv, "--rounds", "1"]) == 0
        assert "(2 streams, 1 round of 0.3 s)" in capsys.readouterr().out
        assert await asyncio.to_thread(http_bench.main, [*argv, "--rounds", "2"]) == 0
        assert "(2 streams, 2 rounds of 0.3 s each)" in capsys.readouterr().out
    assert http_bench.profiles_text([19803]) == "a profile of 19803 bytes"
    assert http_bench.profiles_text([19803, 20114]) == "profiles of 19803, 20114 bytes"


async def test_a_run_with_no_endpoint_flags_measures_the_stack_the_up_file_names(tmp_path, monkeypatch):
    """`switchyard up --free-ports` then `switchyard bench http`: the HTTP phases go to the HTTP face the up file
    records, as the gRPC phases go to its orchestrator. Before, --http stayed http://127.0.0.1:8080 while --grpc
    came from the up file: the submit phase failed (or measured another stack on 8080) beside the stream phase's
    gRPC calls to the stack that was meant."""
    import asyncio
    import json
    import os

    async with http_stack() as (client, _, down):
        base = str(client.base_url).rstrip("/")
        up = tmp_path / "up.json"
        up.write_text(json.dumps({"pid": os.getpid(), "services": {"orchestrator": {
            "address": down.orchestrator_address, "metrics_url": "http://127.0.0.1:1/metrics", "pid": os.getpid(),
            "http_port": int(base.rpartition(":")[2])}}}))
        monkeypatch.setenv("SWITCHYARD_UP_FILE", str(up))
        out = tmp_path / "http.json"
        argv = ["--phases", "submit,stream", "--rps", "20", "-c", "2", "--duration", "0.25", "--streams", "2",
                "--stream-seconds", "0.3", "--rounds", "1", "--task-type", "chat", "--max-tokens", "16",
                "--warmup-s", WARMUP, "-o", str(out)]
        assert await asyncio.to_thread(http_bench.main, argv) == 0
    results = json.loads(out.read_text())
    assert (results["http"], results["grpc"]) == (base, down.orchestrator_address)
    assert results["submit"]["ok"] == 5 and results["submit"]["errors"] == 0, results["submit"]
    assert results["stream"]["sse"]["ok"] and not results["stream"]["sse"]["errors"], results["stream"]
