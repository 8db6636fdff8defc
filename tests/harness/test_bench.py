"""The load generator against a real grpc.aio AgentService on port 0; its report against ghz's schema."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

import grpc
import jsonschema
import pytest

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard_harness.bench import cli
from switchyard_harness.bench.calldata import CallDataError, parse_calldata, request_for
from switchyard_harness.bench.ghz_schema import GHZ_REPORT_SCHEMA, SWITCHYARD_REPORT_SCHEMA
from test_tls import pki  # noqa: F401 - fixture
from switchyard_harness.bench.loadgen import LoadPlan, auto_procs, go_code_name, run_load, run_part
from switchyard_harness.bench.report import build_report, error_kind, histogram, latency_distribution, summary_text
from switchyard.common.config import ServerConfig
from switchyard.common.server import running

pytestmark = pytest.mark.no_gpu

TOKENS = 5
MIX = [
    {"task_id": "t-{{.RequestNumber}}", "payload": "what is a with statement", "task_type": "rag_answer",
     "priority": "CORE"},
    {"task_id": "t-{{.RequestNumber}}", "payload": "hello", "task_type": "chat", "priority": "NORMAL"},
    {"task_id": "t-{{.RequestNumber}}", "payload": "fail", "task_type": "react_loop", "priority": "BATCH"},
]


class StreamingAgent(agent_pb2_grpc.AgentServiceServicer):
    """Streams accepted, one stage, TOKENS tokens and a final; payload "fail" ends in RESOURCE_EXHAUSTED."""

    def __init__(self) -> None:
        self.seen: list[agent_pb2.RunTaskRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.deadlines: list[float | None] = []

    async def RunTask(self, request, context):
        self.seen.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata() or ()})
        self.deadlines.append(context.time_remaining())  # None: the call has no deadline
        yield agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id=request.task_id, queue_position=0))
        await asyncio.sleep(0.001)
        yield agent_pb2.TaskEvent(stage=agent_pb2.StageEvent(name="render_prompt", duration_s=0.001))
        if request.payload == "fail":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "inference queue saturated")
        if request.payload == "late":  # fails after two tokens, each message naming its own task and time
            for i in range(2):
                yield agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text=f"w{i} ", index=i))
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"task {request.task_id}-{uuid.uuid4().hex[:12]} ran out of time after "
                                f"{0.4 + len(self.seen) / 1000:.3f} s (the caller's gRPC deadline)")
        for i in range(TOKENS):
            yield agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text=f"w{i} ", index=i))
        timings = agent_pb2.Timings(queue_wait_s={"orchestration": 0.002, "inference": 0.004}, ttft_s=0.003)
        yield agent_pb2.TaskEvent(final=agent_pb2.FinalEvent(task_id=request.task_id, timings=timings))


class AgentOnly:
    name = "fake-orchestrator"
    grpc_service_names = ("agent.AgentService",)

    def __init__(self) -> None:
        self.servicer = StreamingAgent()

    def register(self, server) -> None:
        agent_pb2_grpc.add_AgentServiceServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@pytest.fixture
async def agent_server():
    service = AgentOnly()
    async with running([service], ServerConfig()) as srv:
        yield f"127.0.0.1:{srv.port}", service.servicer


def _validate(report: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(SWITCHYARD_REPORT_SCHEMA)
    jsonschema.Draft202012Validator(GHZ_REPORT_SCHEMA).validate(report)
    jsonschema.Draft202012Validator(SWITCHYARD_REPORT_SCHEMA).validate(report)


async def test_report_has_ghz_fields_and_units(agent_server):
    host, servicer = agent_server
    plan = LoadPlan(host=host, calldata=parse_calldata(MIX), total=30, concurrency=4, rps=0)
    load = await run_part(plan)
    report = build_report(load, plan, name="unit")
    _validate(report)

    assert report["count"] == 30 and len(report["details"]) == 30
    assert [r.task_id for r in servicer.seen[:3]] == ["t-0", "t-1", "t-2"]
    assert report["statusCodeDistribution"] == {"OK": 20, "ResourceExhausted": 10}
    assert report["errorDistribution"] == {
        "rpc error: code = ResourceExhausted desc = inference queue saturated": 10
    }
    # durations are integer nanoseconds; total matches the wall time
    assert isinstance(report["total"], int) and report["total"] == round(load.wall_s * 1e9)
    assert 0 < report["fastest"] <= report["slowest"]
    assert report["rps"] == pytest.approx(30 / load.wall_s)
    assert [d["percentage"] for d in report["latencyDistribution"]] == [10, 25, 50, 75, 90, 95, 99]
    assert sum(b["count"] for b in report["histogram"]) == 20

    sy = report["switchyard"]
    assert sy["tokens"] == 20 * TOKENS
    assert set(sy["byPriority"]) == {"CORE", "NORMAL", "BATCH"}
    assert sy["byPriority"]["BATCH"]["errors"] == 10 and sy["byPriority"]["BATCH"]["ttftDistribution"] is None
    assert set(sy["byTaskType"]) == {"rag_answer", "chat", "react_loop"}
    assert sy["queueWait"]["inference"]["average"] == 4_000_000
    assert sy["ttftDistribution"][0]["latency"] <= report["latencyDistribution"][-1]["latency"]
    assert "Latency distribution:" in summary_text(report)


async def test_paced_run_with_duration_ends_by_timeout(agent_server):
    host, _ = agent_server
    plan = LoadPlan(host=host, calldata=parse_calldata(MIX[:2]), total=1, concurrency=2, rps=50, duration_s=0.2)
    load = await run_part(plan)
    assert load.end_reason == "timeout"
    assert 1 <= len(load.results) <= 11  # at most rps x duration + the call at t=0
    _validate(build_report(load, plan))


async def test_a_paced_run_stops_at_its_duration_not_at_the_next_calls_due_time(agent_server):
    """-c 8 --rps 1 -z 0.6s: calls 1..7 would be due at 1..7 s. The run ends at 0.6 s (ghz stops at -z),
    and Total and Requests/sec are those of 0.6 s, not of the 7 s the last worker used to sleep."""
    host, _ = agent_server
    plan = LoadPlan(host=host, calldata=parse_calldata(MIX[1]), total=1, concurrency=8, rps=1, duration_s=0.6)
    started = time.monotonic()
    load = await run_part(plan)
    assert time.monotonic() - started < 1.5
    assert load.end_reason == "timeout" and [r.number for r in load.results] == [0]
    assert 0.55 <= load.wall_s < 1.0
    report = build_report(load, plan)
    assert report["total"] == round(load.wall_s * 1e9) and report["rps"] == pytest.approx(1 / load.wall_s)
    _validate(report)


async def test_several_client_processes_split_the_calls(agent_server):
    host, servicer = agent_server
    plan = LoadPlan(host=host, calldata=parse_calldata(MIX[:2]), total=12, concurrency=4, procs=2)
    load = await asyncio.to_thread(run_load, plan)
    assert load.procs == 2
    assert [r.number for r in load.results] == list(range(12))
    assert sorted(r.task_id for r in servicer.seen) == sorted(f"t-{i}" for i in range(12))
    assert load.cpu_s > 0 and load.cpu_saturation > 0
    _validate(build_report(load, plan))


async def test_cli_run_writes_a_valid_report(agent_server, tmp_path):
    host, _ = agent_server
    data_file = tmp_path / "data.json"
    data_file.write_text(json.dumps(MIX[:2]))
    out = tmp_path / "report.json"
    argv = ["run", "--host", host, "-n", "6", "-c", "2", "-D", str(data_file), "-o", str(out), "--procs", "1"]
    # the CLI runs its own event loop: give it a thread so this loop keeps serving
    assert await asyncio.to_thread(cli.main, argv) == 0
    report = json.loads(out.read_text())
    _validate(report)
    assert report["count"] == 6 and report["options"]["call"] == "agent.AgentService.RunTask"


class FourThenHangs(agent_pb2_grpc.AgentServiceServicer):
    """Answers the first four calls at once; every later one hangs until its caller cancels it."""

    def __init__(self) -> None:
        self.completed, self.hanging = 0, 0

    async def RunTask(self, request, context):
        yield agent_pb2.TaskEvent(accepted=agent_pb2.Accepted(task_id=request.task_id))
        if self.completed < 4:
            self.completed += 1
            yield agent_pb2.TaskEvent(token=agent_pb2.TokenEvent(text="w ", index=0))
            yield agent_pb2.TaskEvent(final=agent_pb2.FinalEvent(task_id=request.task_id))
            return
        self.hanging += 1
        try:
            await asyncio.Event().wait()
        finally:
            self.hanging -= 1


@pytest.mark.parametrize(("procs", "group"), [("1", False), ("2", False), ("2", True)])
async def test_an_interrupted_run_prints_and_writes_the_report_of_the_calls_that_completed(tmp_path, procs, group):
    """ghz, interrupted (Ctrl-C), reports the calls that completed. `switchyard bench run` printed a
    KeyboardInterrupt traceback and no report. It now prints the summary (saying it was interrupted), writes the
    JSON report (endReason cancel, ghz's) with the completed calls alone, and exits 130; with several client
    processes too, SIGINT sent to the command alone or, as Ctrl-C on a terminal sends it, to its process group."""
    import os
    import signal
    import sys
    from pathlib import Path

    servicer = FourThenHangs()
    service = AgentOnly()
    service.servicer = servicer
    out = tmp_path / "report.json"
    async with running([service], ServerConfig()) as srv:
        bench = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "switchyard.cli", "bench", "run", f"127.0.0.1:{srv.port}", "-n", "100", "-c", "2",
            "--procs", procs, "-o", str(out), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=group)
        try:
            while servicer.completed < 4 or servicer.hanging < 2:  # four done, both workers' next calls in flight
                assert bench.returncode is None
                await asyncio.sleep(0.01)
            if group:
                os.killpg(bench.pid, signal.SIGINT)
            else:
                bench.send_signal(signal.SIGINT)
            stdout, stderr = await asyncio.wait_for(bench.communicate(), 60)
        finally:
            if bench.returncode is None:
                bench.kill()
                await bench.wait()
        while servicer.hanging:  # the calls in flight were cancelled
            await asyncio.sleep(0.01)
    assert bench.returncode == 130, stderr.decode()
    assert "Traceback" not in stderr.decode(), stderr.decode()
    assert "Interrupted:" in stdout.decode() and "Count:\t\t4" in stdout.decode(), stdout.decode()
    assert "interrupted; the report covers the 4 calls that completed" in stderr.decode()
    report = json.loads(out.read_text())
    _validate(report)
    assert report["endReason"] == "cancel" and report["count"] == 4
    assert report["statusCodeDistribution"] == {"OK": 4}


async def test_cli_run_takes_ghz_output_format_flags(agent_server, tmp_path, capsys):
    host, _ = agent_server
    out = tmp_path / "out.json"
    # as ghz users type it: -O json -o out.json writes compact JSON there, nothing else
    png = tmp_path / "run.png"
    argv = ["run", "--host", host, "-n", "4", "-c", "2", "-O", "json", "-o", str(out), "--procs", "1", "--plot", str(png)]
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # latency, TTFT and throughput panels
    text = out.read_text()
    assert "\n  " not in text  # compact
    _validate(json.loads(text))
    capsys.readouterr()
    argv = ["run", "--host", host, "-n", "2", "-c", "1", "-O", "pretty", "--procs", "1"]
    assert await asyncio.to_thread(cli.main, argv) == 0
    _validate(json.loads(capsys.readouterr().out))  # pretty JSON alone on stdout
    with pytest.raises(SystemExit):
        cli.main(["run", "-O", "csv"])


def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for flag, path in (("-o", tmp_path / "file" / "x.json"), ("--plot", "/proc/x.png")):
        with pytest.raises(SystemExit) as caught:  # no server at the target: refused before any call
            cli.main(["run", "-n", "1", flag, str(path), "127.0.0.1:1"])
        assert caught.value.code == 2 and "expected a file that can be written" in capsys.readouterr().err


def test_a_ghz_config_or_data_file_of_the_wrong_shape_is_refused_naming_the_key_never_a_traceback(tmp_path, capsys):
    """Each key the plan reads must have its JSON type, and a file that cannot be read says why, under the flag
    that named it: a list, null, [1], {}, a number for a path, Infinity, and a non-UTF-8 file were AttributeError,
    TypeError, OverflowError and UnicodeDecodeError tracebacks; 1.5 calls ran as 1; -D's missing file named no
    flag."""
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xc7\x00{}")
    cases = [
        ("[]", "--config {path}: expected a JSON object of ghz's keys, got list []"),
        ('{"total": null}', "--config {path}: total: expected a whole number, got null"),
        ('{"total": 1.5}', "--config {path}: total: expected a whole number, got 1.5"),
        ('{"total": 1e999}', "--config {path}: total: expected a whole number, got Infinity"),
        ('{"concurrency": true}', "--config {path}: concurrency: expected a whole number, got true"),
        ('{"rps": {}}', "--config {path}: rps: expected a number, got {{}}"),
        ('{"duration": null}', '--config {path}: duration: expected a duration such as "10s" or seconds, got null'),
        ('{"data-file": 5}', "--config {path}: data-file: expected a file's path as a string, got 5"),
        ('{"insecure": "x"}', '--config {path}: insecure: expected true or false, got "x"'),
        ('{"data-file": "absent.json"}', "--config {path}: data-file: absent.json: cannot read it (No such file"),
    ]
    for i, (text, words) in enumerate(cases):
        path = tmp_path / f"config-{i}.json"
        path.write_text(text)
        with pytest.raises(SystemExit) as caught:  # no server at the target: refused before any call
            cli.main(["run", "--config", str(path), "127.0.0.1:1"])
        assert caught.value.code == 2 and words.format(path=path) in capsys.readouterr().err, text
    bom = tmp_path / "bom.json"  # an editor's byte order mark is no error: the type check below is reached
    bom.write_bytes(b"\xef\xbb\xbf" + b'{"total": null}')
    for argv, words in ((["--config", str(bom)], f"--config {bom}: total: expected a whole number, got null"),
                        (["--config", str(binary)], f"--config {binary}: expected a ghz JSON config ('utf-8' codec"),
                        (["--config", str(tmp_path)], f"--config {tmp_path}: cannot read it (Is a directory)"),
                        (["-D", str(binary)], f"-D/--data-file: {binary}: expected UTF-8 JSON ('utf-8' codec"),
                        (["-D", str(tmp_path / "absent")], f"-D/--data-file: {tmp_path / 'absent'}: cannot read it")):
        with pytest.raises(SystemExit) as caught:
            cli.main(["run", *argv, "127.0.0.1:1"])
        assert caught.value.code == 2 and words in capsys.readouterr().err, argv
    from switchyard_harness.bench.calldata import load_calldata_file

    data = tmp_path / "data.json"
    data.write_bytes(b"\xef\xbb\xbf" + b'{"payload": "hi", "task_type": "chat"}')
    assert load_calldata_file(data) == [{"payload": "hi", "task_type": "chat"}]


def test_every_benchmarks_output_path_that_cannot_be_written_is_refused_before_its_run(tmp_path, capsys):
    """route, agents, pool, fault and compare: a folder where the file goes, or a file where a folder goes, is
    exit 2 naming the option, before anything runs (route and agents ran, then failed with a traceback; pool,
    fault and compare after minutes of load)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "report.png").mkdir()  # where agents' PNG beside its --out report goes
    for argv, words in (  # the quick ones first: before the fix, route failed with a traceback at once
        (["route", "--replicas", "2", "--agents", "2", "--json", str(tmp_path)], f"--json: expected a file that "
                                                                                 f"can be written ({tmp_path} is a directory)"),
        (["route", "--replicas", "2", "--agents", "2", "--plot", str(blocker / "x.png")], f"--plot: expected a "
                                                                                          f"file that can be written ({blocker} is not a folder)"),
        (["agents", "--agents", "1", "--out", str(blocker / "x.json")], f"--out: expected a file that can be "
                                                                        f"written ({blocker} is not a folder)"),
        (["agents", "--agents", "1", "--out", str(tmp_path / "report.json")], "--out's PNG: expected a file that "
                                                                              "can be written"),
        (["pool", "--json", str(tmp_path)], "--json: expected a file that can be written"),
        (["fault", "--json", str(tmp_path)], "--json: expected a file that can be written"),
        (["compare", "--out", str(blocker)], f"--out: expected a folder that can be made or written ({blocker} is "
                                             f"not a folder)"),
    ):
        with pytest.raises(SystemExit) as caught:
            cli.main(argv)
        assert caught.value.code == 2, argv
        assert words in capsys.readouterr().err, argv
    assert not (tmp_path / "report.json").exists() and blocker.read_text() == ""


def test_a_plots_title_shows_metadata_keys_never_their_values():
    from switchyard_harness.bench.cli import shown_argv

    token = '{"authorization": "Bearer s3cret"}'
    for argv in (["-m", token], ["--metadata", token], [f"--metadata={token}"], [f"-m{token}"]):
        shown = " ".join(shown_argv(["-n", "4", *argv, "127.0.0.1:50051"]))
        assert "s3cret" not in shown and "authorization: ***" in shown, shown
    with pytest.raises(SystemExit) as caught:  # an abbreviation (argparse's default) would pass unmasked
        cli.main(["run", "--meta", token, "--plot", "x.png", "127.0.0.1:1"])
    assert caught.value.code == 2


def test_percentiles_follow_ghz_nearest_rank():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    dist = latency_distribution(values)
    assert [d["latency"] for d in dist] == [ms * 1_000_000 for ms in (10, 25, 50, 75, 90, 95, 99)]
    assert latency_distribution([]) is None


def test_every_bench_reports_its_percentiles_by_the_one_rule():
    """The scheduler, policy and RAG benches kept two more nearest-rank percentiles beside the report's (ghz's
    rule, the same for the P50, P95 and P99 they report); they use the report's."""
    from switchyard_harness.bench import program_policies, rag_prefill, report, sched_bench

    assert sched_bench.percentile is program_policies.percentile is rag_prefill.percentile is report.percentile


def test_histogram_has_eleven_marks_from_fastest_to_slowest():
    values = sorted([0.010, 0.011, 0.012, 0.020, 0.030])
    buckets = histogram(values)
    assert len(buckets) == 11
    assert buckets[0]["mark"] == 0.010 and buckets[-1]["mark"] == 0.030
    assert sum(b["count"] for b in buckets) == 5
    assert sum(b["frequency"] for b in buckets) == pytest.approx(1.0)


def test_calldata_round_robin_templates_and_errors():
    items = parse_calldata(json.dumps(MIX))
    assert request_for(items, 4).task_id == "t-4" and request_for(items, 4).task_type == "chat"
    assert request_for(items, 0).priority == agent_pb2.CORE
    with pytest.raises(CallDataError, match="not an agent.RunTaskRequest"):
        parse_calldata({"task_id": "x", "prompt": "typo"})
    with pytest.raises(CallDataError, match="non-empty array"):
        parse_calldata([])
    with pytest.raises(CallDataError, match="not valid JSON"):
        parse_calldata("{task_id:")


def test_go_code_names_match_ghz():
    assert go_code_name(grpc.StatusCode.OK) == "OK"
    assert go_code_name(grpc.StatusCode.DEADLINE_EXCEEDED) == "DeadlineExceeded"
    assert go_code_name(grpc.StatusCode.CANCELLED) == "Canceled"


def test_auto_procs_grows_with_rps_but_not_past_the_cores():
    items = parse_calldata({"payload": "x", "max_tokens": 128})
    assert auto_procs(LoadPlan("h:1", items, total=64, concurrency=64, rps=50), cpu_count=16) == 1
    assert auto_procs(LoadPlan("h:1", items, total=64, concurrency=64, rps=2000), cpu_count=16) == 14
    assert auto_procs(LoadPlan("h:1", items, total=64, concurrency=64, rps=2000), cpu_count=2) == 2


def test_bad_plans_and_durations_are_rejected():
    with pytest.raises(ValueError, match=r"-n/--total: expected at least as many calls as -c/--concurrency \(10, "):
        LoadPlan("h:1", [{}], total=5, concurrency=10)
    assert cli.parse_duration("1m30s") == 90 and cli.parse_duration("500ms") == 0.5
    with pytest.raises(Exception, match="expected a duration"):
        cli.parse_duration("ten seconds")


def test_reference_ghz_config_resolves_to_the_reference_plan(monkeypatch):
    import argparse
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    parser = argparse.ArgumentParser()
    cli.add_load_options(parser)
    plan = cli.resolve_plan(parser.parse_args(["--config", "ghz/reference.json", "--procs", "1"]), None)
    assert (plan.host, plan.total, plan.concurrency, plan.rps, plan.timeout_s) == ("127.0.0.1:50051", 5000, 64, 200, 30)
    assert {item["task_type"] for item in plan.calldata} == {"rag_answer", "chat", "react_loop"}
    assert {item["priority"] for item in plan.calldata} == {"CORE", "NORMAL", "BATCH"}
    smoke = cli.resolve_plan(parser.parse_args(["--config", "ghz/smoke.json", "-n", "10"]), "127.0.0.1:1")
    assert (smoke.total, smoke.host) == (10, "127.0.0.1:1") and smoke.procs >= 1


async def test_a_ghz_command_line_runs_unchanged_over_tls_with_metadata(pki, tmp_path):
    """ghz's own flags: --proto, --call, --cacert, --cname, -m, and the target as the last argument."""
    from test_tls import tls

    service = AgentOnly()
    async with running([service], tls(pki)) as srv:
        out = tmp_path / "report.json"
        argv = ["run", "--proto", "proto/agent.proto", "--call", "agent.AgentService.RunTask",
                "--cacert", str(pki / "ca.pem"), "--cname", "localhost", "-m", '{"Authorization": "Bearer t-1"}',
                "-d", '{"payload": "hello", "task_type": "chat"}', "-n", "4", "-c", "2", "--procs", "1",
                "-O", "json", "-o", str(out), f"127.0.0.1:{srv.port}"]
        assert await asyncio.to_thread(cli.main, argv) == 0
    report = json.loads(out.read_text())
    assert report["count"] == 4 and report["statusCodeDistribution"] == {"OK": 4}
    assert all(m.get("authorization") == "Bearer t-1" for m in service.servicer.metadata)


async def test_a_run_sends_the_bearer_token_as_switchyard_run_does(agent_server, tmp_path, monkeypatch, capsys):
    """Against a stack with orchestrator.auth on, `bench run` read no SWITCHYARD_AUTH_TOKEN: every call was
    UNAUTHENTICATED while `switchyard run`, `profile` and `bench http` were served with the same variable."""
    addr, servicer = agent_server
    base = ["run", "-d", '{"payload": "hello", "task_type": "chat"}', "-n", "2", "-c", "1", "--procs", "1",
            "-O", "json", "-o", str(tmp_path / "r.json"), addr]
    monkeypatch.setenv("SWITCHYARD_AUTH_TOKEN", "t-env")
    assert await asyncio.to_thread(cli.main, base) == 0
    token_file = tmp_path / "token"
    token_file.write_text("t-file\n")
    assert await asyncio.to_thread(cli.main, [*base, "--token-file", str(token_file)]) == 0
    assert await asyncio.to_thread(cli.main, [*base, "-m", '{"authorization": "Bearer t-m"}']) == 0  # ghz's way wins
    monkeypatch.setenv("MY_TOKEN", "t-other")
    assert await asyncio.to_thread(cli.main, [*base, "--token-env", "MY_TOKEN"]) == 0
    monkeypatch.delenv("SWITCHYARD_AUTH_TOKEN")
    assert await asyncio.to_thread(cli.main, base) == 0
    assert [m.get("authorization") for m in servicer.metadata] == (
        ["Bearer t-env"] * 2 + ["Bearer t-file"] * 2 + ["Bearer t-m"] * 2 + ["Bearer t-other"] * 2 + [None] * 2)
    capsys.readouterr()
    for argv, says in [
        ([*base, "--token-file", str(token_file), "-m", '{"authorization": "Bearer t-m"}'],
         "names authorization too; give the token one way"),
        ([*base, "--token-file", str(tmp_path / "missing")], f"--token-file {tmp_path / 'missing'}: cannot read it"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2, argv
        assert says in capsys.readouterr().err, argv
    assert len(servicer.metadata) == 10  # refused before any call


def test_ghz_connection_flags_are_checked(capsys):
    for argv, says in [
        (["run", "--call", "agent.AgentService.SubmitTask"], "only agent.AgentService.RunTask"),
        (["run", "--cert", "c.pem", "--key", "k.pem"], "give --cacert too"),
        (["run", "-m", "[1]"], "JSON object of strings"),
        (["run", "--insecure", "--cacert", "ca.pem"], "choose plain text or TLS"),
        (["run", "--timeout=-1"], "--timeout: expected a finite value >= 0 (0: no deadline per call), got -1"),
        (["run", "--timeout=1e10"], "--timeout: expected at most 1e+09 s (gRPC's deadline overflows past it; 0: no "
                                    "deadline per call), got 1e+10"),  # every call failed at once, DEADLINE_EXCEEDED
        (["run", "--rps=-2"], "--rps: expected a finite value >= 0"),
        (["run", "--rps=inf"], "--rps: expected a finite value >= 0 (0: unpaced), got inf"),  # an OverflowError
        (["run", "--duration=1e999"], "--duration: expected a finite value >= 0"),
        # `bench run -n 5` said "total (5) cannot be smaller than concurrency (50)": neither flag, nor that 50 is
        # the default -c (ghz's), nor the way out
        (["run", "-n", "5"], "-n/--total: expected at least as many calls as -c/--concurrency (50, given or by "
                             "default), got 5: raise -n or lower -c"),
        (["run", "-n", "0"], "-n/--total: expected at least 1 call (or -z/--duration instead), got 0"),
        (["run", "-c", "0"], "-c/--concurrency: expected at least 1, got 0"),
        (["fault", "--duration=inf"], "--duration: expected a finite number of seconds > 0, got inf"),  # no end
        (["fault", "--dispatchers=65"], "--dispatchers: expected 2 (one is killed) to 64, got 65"),
        (["fault", "--concurrency=0"], "--concurrency: expected at least 1, got 0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2, argv  # a usage error, as argparse's own
        assert says in capsys.readouterr().err, argv


def test_ghz_flags_not_taken_are_named_never_read_as_the_target(capsys, tmp_path):
    """A ghz command line with a flag bench run does not take (``--connections 4``, ghz's old ``-q 200``) was
    refused as "unrecognized arguments: --connections 127.0.0.1:50051": the flag's value had become the target
    and the orchestrator's address the argument not recognised. Each is named with what to use instead."""
    for argv, says in [
        (["run", "--connections", "4", "127.0.0.1:1"], "--connections: a ghz flag that switchyard bench run does "
                                                       "not take; drop it (--procs sets the client processes"),
        (["run", "-q", "200", "127.0.0.1:1"], "-q: a ghz flag that switchyard bench run does not take; use -r/--rps"),
        (["run", "--skipFirst=10", "127.0.0.1:1"], "--skipFirst: a ghz flag"),
        (["run", "-x", "10s", "127.0.0.1:1"], "-x: a ghz flag"),
        (["run", "--load-schedule", "step", "127.0.0.1:1"], "--load-schedule: a ghz flag"),
        (["run", "--protoset", "agent.protoset", "--call", "agent.AgentService.SubmitTask", "127.0.0.1:1"],
         "only agent.AgentService.RunTask"),  # --protoset is taken, as --proto
        (["compare", "--connections", "4"], "--connections: a ghz flag that switchyard bench compare does not take"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err
        assert says in err and "unrecognized arguments" not in err, (argv, err)
    # the same keys of a ghz config file were ignored, unsaid
    for key, value, says in [("skipFirst", 10, "skipFirst: a ghz key switchyard bench does not take; drop it (every call is "
                                                "reported"),
                             ("connections", 4, "connections: a ghz key switchyard bench does not take")]:
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({"call": "agent.AgentService.RunTask", "total": 10, key: value}))
        argv = ["run", "--config", str(path), "127.0.0.1:1"]
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err
        assert says in err and "unrecognized arguments" not in err, (argv, err)


def test_ghz_short_rate_flag_is_taken():
    """ghz's ``-r`` (short for ``--rps``) paces the calls as ``--rps`` does."""
    import argparse

    parser = argparse.ArgumentParser()
    cli.add_load_options(parser)
    plan = cli.resolve_plan(parser.parse_args(["-r", "200", "-n", "100", "--procs", "1"]), "127.0.0.1:1")
    assert plan.rps == 200


async def test_timeout_0_means_no_deadline_as_in_ghz(agent_server, tmp_path):
    """ghz -t 0: no timeout. The calls go out without a gRPC deadline and the report says timeout 0."""
    host, servicer = agent_server
    out = tmp_path / "report.json"
    argv = ["run", "--host", host, "-n", "2", "-c", "1", "-t", "0", "-d", '{"payload": "hi", "task_type": "chat"}',
            "--procs", "1", "-O", "json", "-o", str(out)]
    assert await asyncio.to_thread(cli.main, argv) == 0
    report = json.loads(out.read_text())
    assert report["statusCodeDistribution"] == {"OK": 2} and report["options"]["timeout"] == 0
    assert servicer.deadlines == [None, None]
    _validate(report)
    await asyncio.to_thread(cli.main, argv[:-4] + ["-t", "20s"])
    assert 0 < servicer.deadlines[-1] <= 21  # a 20 s deadline (its remaining time, on the server clock)


def test_a_mistyped_subcommand_is_named_not_taken_for_a_target(capsys):
    from switchyard_harness.bench.cli import main as bench_main

    assert bench_main(["retreival"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'retreival'" in err and "did you mean 'retrieval'?" in err and "host:port" in err


@pytest.mark.parametrize("target", ["127.0.0.1:99999", "127.0.0.1:0", "[::1]:5x", "host:", "http://127.0.0.1:8080"])
def test_a_target_with_no_port_a_client_can_dial_is_refused_naming_it(capsys, target):
    """127.0.0.1:99999 was dialled as 127.0.0.1:34463 (grpc takes the port modulo 65536), another server's."""
    from switchyard_harness.bench.cli import main as bench_main

    with pytest.raises(SystemExit) as refused:
        bench_main([target, "-n", "1", "-c", "1", "--procs", "1"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"target: expected the orchestrator's host:port, a port in 1-65535, got {target!r}" in err, err


def test_an_unreachable_target_is_named(capsys, monkeypatch):
    import socket

    from switchyard_harness.bench import loadgen
    from switchyard_harness.bench.cli import main as bench_main

    monkeypatch.setattr(loadgen, "CONNECT_TIMEOUT_S", 0.5)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert bench_main([f"127.0.0.1:{port}", "-n", "2", "-c", "1", "--procs", "1"]) == 1
    assert f"cannot reach the orchestrator at 127.0.0.1:{port} within 0.5 s" in capsys.readouterr().err


def test_an_unreachable_target_names_the_orchestrator_of_the_stack_switchyard_up_started(tmp_path, capsys,
                                                                                        monkeypatch):
    """After switchyard up --free-ports, bench run dialled the config's 127.0.0.1:50051 and said only 'cannot reach';
    switchyard run names the up file's orchestrator there, and so does bench run now."""
    import json
    import os
    import socket

    from switchyard_harness.bench import loadgen
    from switchyard_harness.bench.cli import main as bench_main

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    up = tmp_path / "up.json"  # a live launcher's (this process): not removed as stale
    up.write_text(json.dumps({"pid": os.getpid(), "services": {"orchestrator": {"address": "127.0.0.1:45111"}}}))
    monkeypatch.setenv("SWITCHYARD_UP_FILE", str(up))
    monkeypatch.setattr(loadgen, "CONNECT_TIMEOUT_S", 0.5)
    assert bench_main([f"127.0.0.1:{port}", "-n", "2", "-c", "1", "--procs", "1"]) == 1
    assert (f"the stack that switchyard up started serves its orchestrator at 127.0.0.1:45111 (its up file {up}): "
            "switchyard bench run 127.0.0.1:45111 ...") in capsys.readouterr().err


async def test_summary_groups_errors_of_one_kind_and_counts_tokens_of_successful_calls_only(agent_server):
    host, _ = agent_server
    late = {"task_id": "t-{{.RequestNumber}}", "payload": "late", "task_type": "chat", "priority": "NORMAL"}
    plan = LoadPlan(host=host, calldata=parse_calldata([MIX[1], late]), total=20, concurrency=4, rps=0)
    report = build_report(await run_part(plan), plan)
    _validate(report)
    sy = report["switchyard"]
    assert report["statusCodeDistribution"] == {"OK": 10, "DeadlineExceeded": 10}
    assert sy["tokens"] == 10 * TOKENS and sy["failedCallTokens"] == 10 * 2
    assert len(report["errorDistribution"]) == 10  # ghz's own map: every message differs
    assert [(g["kind"], g["count"]) for g in sy["errorGroups"]] == [
        ("rpc error: code = DeadlineExceeded desc = task # ran out of time after # s (the caller's gRPC deadline)", 10)]
    text = summary_text(report)
    assert text.count("ran out of time") == 1 and "[10]\trpc error: code = DeadlineExceeded desc = task # ran" in text
    assert f"Tokens:\t{10 * TOKENS} " in text and "20 more streamed by calls that then failed" in text


def test_an_id_is_one_kind_whatever_its_length():
    """ghz/data/mixed.json's ``bench-{{.RequestNumber}}``: bench-8 and bench-43 are one id's two values."""
    kinds = {error_kind(f"rpc error: code = DeadlineExceeded desc = task {task_id} ran out of time after {s} s")
             for task_id, s in (("bench-8", "20"), ("bench-43", "20"), ("t-1", "0.4"), ("task-aa89e934daf4", "3"))}
    assert kinds == {"rpc error: code = DeadlineExceeded desc = task # ran out of time after # s"}
    assert error_kind("upstream 503 from http://127.0.0.1:8000/v1/chat/completions") == (
        "upstream # from http://#:#/#/chat/completions")


def test_the_switchyard_command_list_names_every_bench_subcommand():
    from switchyard.cli import COMMANDS
    from switchyard_harness.bench.cli import SUBCOMMANDS

    bench_help = COMMANDS["bench"][1]
    assert all(name in bench_help.split(": ", 1)[1].split(", ") for name in SUBCOMMANDS), bench_help


@contextlib.contextmanager
def answering_with(reply: bytes):
    """A TCP server on 127.0.0.1 (a thread) that answers every connection with ``reply`` once it has read a little,
    then closes it, as a server of another protocol does with a gRPC client's preface; yields its port."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    conn.recv(1024)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


@pytest.mark.parametrize("reply, says", [
    (b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n", "an HTTP/1.x server answers at"),
    (b"-ERR unknown command 'PRI', with args beginning with: \r\n", "that is not a gRPC server"),  # a Redis
], ids=["http1", "redis"])
def test_a_target_where_something_else_answers_says_what_answers(reply, says, capsys, monkeypatch):
    """bench run pointed at the HTTP face's port (or a metrics port, a Redis) waited out its connect timeout and
    said 'cannot reach the orchestrator ...: start it', though something answered there, as switchyard run did
    for all but the HTTP face ('nothing answers')."""
    from switchyard import client
    from switchyard_harness.bench import loadgen
    from switchyard_harness.bench.cli import main as bench_main

    monkeypatch.setenv("SWITCHYARD_UP_FILE", "/nonexistent/up.json")
    monkeypatch.setattr(loadgen, "CONNECT_TIMEOUT_S", 0.5)
    with answering_with(reply) as port:
        assert bench_main([f"127.0.0.1:{port}", "-n", "2", "-c", "1", "--procs", "1"]) == 1
        bench_err = capsys.readouterr().err
        assert client.main(["--addr", f"127.0.0.1:{port}", "--timeout", "5", "hello"]) == 1
        run_err = capsys.readouterr().err
    assert f"cannot reach the orchestrator at 127.0.0.1:{port}: " in bench_err and says in bench_err, bench_err
    assert "start it" not in bench_err
    assert says in run_err and "nothing answers" not in run_err, run_err
    assert "the orchestrator's gRPC port is orchestrator.port (50051 here); --addr takes that port" in run_err


class NoAgentService:
    """A gRPC server of the stack's kind that serves no AgentService (as a dispatcher's or retrieval's port)."""

    name = "not-the-orchestrator"
    grpc_service_names = ("agent.NotAgentService",)

    def register(self, server) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


async def test_a_target_that_serves_no_agent_service_is_named_with_the_port_to_use(capsys, monkeypatch):
    """`switchyard run --addr` and `bench run` at a dispatcher's or retrieval's port printed "UNIMPLEMENTED: Method
    not found!" (bench run: every call Unimplemented) and no word on why."""
    from switchyard import client
    from switchyard_harness.bench.cli import main as bench_main

    monkeypatch.setenv("SWITCHYARD_UP_FILE", "/nonexistent/up.json")
    async with running([NoAgentService()], ServerConfig()) as srv:
        addr = f"127.0.0.1:{srv.port}"
        assert await asyncio.to_thread(client.main, ["--addr", addr, "--timeout", "5", "hello"]) == 1
        run_err = capsys.readouterr().err
        assert await asyncio.to_thread(bench_main, [addr, "-n", "2", "-c", "1", "--procs", "1"]) == 0
        bench_err = capsys.readouterr().err
    says = f"the gRPC server at {addr} serves no agent.AgentService (a dispatcher's or retrieval's port?)"
    assert "UNIMPLEMENTED" in run_err and says in run_err, run_err
    assert "the orchestrator's gRPC port is orchestrator.port (50051 here); --addr takes that port" in run_err
    assert says in bench_err and "the target takes that port" in bench_err, bench_err


@pytest.mark.parametrize("command", ["run", "compare"])
def test_a_ghz_flag_bench_does_not_take_is_refused_by_name_not_as_the_target_unrecognized(command, capsys):
    """`ghz ... --connections 2 host:port` run as `switchyard bench run` read 'error: unrecognized arguments:
    --connections 127.0.0.1:50051': argparse took the flag's value for the target and named the target as
    unrecognized, and nothing said the flag is ghz's and what to do about it."""
    for argv, flag in [(["--connections", "2"], "--connections"), (["--cpus=1"], "--cpus"), (["-x", "5s"], "-x"),
                       (["--skipFirst", "10"], "--skipFirst"), (["--async"], "--async"),
                       (["-e"], "-e"), (["--count-errors"], "--count-errors")]:
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "-n", "4", "-c", "1", *argv, "127.0.0.1:1"])
        assert exit_.value.code == 2, argv
        err = capsys.readouterr().err
        assert f"switchyard bench: {flag}: a ghz flag that switchyard bench {command} does not take; " in err, err
        assert "127.0.0.1:1" not in err, err  # the target is not named as unrecognized
    with pytest.raises(SystemExit) as exit_:  # a flag ghz does not know either: argparse's own answer
        cli.main([command, "--no-such-flag", "127.0.0.1:1"])
    assert exit_.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
