"""locust/locustfile.py headless against a real HTTP face with bearer tokens on (tests/test_http_face.py's stack):
the token comes from SWITCHYARD_AUTH_TOKEN, as switchyard run reads it, or --token-file."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_http_face import http_stack

pytestmark = [pytest.mark.slow, pytest.mark.no_gpu]
LOCUSTFILE = Path(__file__).resolve().parents[2] / "locust" / "locustfile.py"


def run_locust(host: str, out: Path, env: dict[str, str], *extra: str) -> tuple[subprocess.CompletedProcess[str],
                                                                                 dict[str, dict[str, str]]]:
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--users", "4", "--spawn-rate", "4",
         "--run-time", "3s", "--host", host, "--csv", str(out / "run"), "--watch-csv", str(out / "watch.csv"),
         "--switchyard-metrics", "http://127.0.0.1:1/metrics", "--submit-weight", "1", "--streaming-weight", "1",
         "--only-summary", *extra],
        capture_output=True, text=True, timeout=120, cwd=out, env=env)
    stats: dict[str, dict[str, str]] = {}
    if (out / "run_stats.csv").exists():
        with open(out / "run_stats.csv", newline="") as f:
            stats = {row["Name"]: row for row in csv.DictReader(f)}
    return run, stats


async def test_the_locustfile_sends_the_bearer_token_of_switchyard_auth_token_or_token_file(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-full-1\n")
    auth = {"orchestrator.auth": {"enabled": True, "tokens_file": str(tokens), "tokens_env": ""}}
    env = {k: v for k, v in os.environ.items() if k != "SWITCHYARD_AUTH_TOKEN"}
    async with http_stack(**auth) as (client, _, _down):
        host = str(client.base_url).rstrip("/")
        token_file = tmp_path / "token"
        token_file.write_text("tok-full-1\n")
        for name in ("none", "env", "file"):
            (tmp_path / name).mkdir()
        # the three runs side by side (each its own process, stats and token): their run times overlap
        (none, none_stats), (by_env, env_stats), (by_file, file_stats) = await asyncio.gather(
            asyncio.to_thread(run_locust, host, tmp_path / "none", env),
            asyncio.to_thread(run_locust, host, tmp_path / "env", {**env, "SWITCHYARD_AUTH_TOKEN": "tok-full-1"}),
            asyncio.to_thread(run_locust, host, tmp_path / "file", {**env, "SWITCHYARD_AUTH_TOKEN": "tok-wrong"},
                              "--token-file", str(token_file)))
    assert none.returncode == 1  # every request refused: 401
    refused = none_stats["Aggregated"]  # whichever routes its users reached before the stop
    assert int(refused["Request Count"]) > 0 and refused["Failure Count"] == refused["Request Count"], none_stats

    # Each run: every request it made was let in (or, without a token, refused), whichever route it was. A route's
    # own row is in run_stats.csv only if one of its requests ended before locust's last CSV snapshot (one a second,
    # none at the stop), and a stream may outlast the last one: the Aggregated row is read (CI: KeyError
    # '/api/v1/agent/submit' when the run was cut short by its import time, fixed in the locustfile).
    assert by_env.returncode == 0, by_env.stdout + by_env.stderr
    assert int(env_stats["Aggregated"]["Request Count"]) > 0, env_stats
    assert int(env_stats["Aggregated"]["Failure Count"]) == 0, env_stats
    assert by_file.returncode == 0, by_file.stdout + by_file.stderr  # the file wins over the variable
    assert int(file_stats["Aggregated"]["Request Count"]) > 0, file_stats
    assert int(file_stats["Aggregated"]["Failure Count"]) == 0, file_stats


@pytest.fixture(scope="module")
def refused_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str], dict[str, dict[str, str]]]:
    """One run against a port where nothing listens (every request fails), its folder, result and stats: the
    tests below only read its files, so they share it (a run is 3 s of locust plus its start)."""
    out = tmp_path_factory.mktemp("refused-run")
    run, stats = run_locust("http://127.0.0.1:1", out, dict(os.environ), "--json-file", str(out / "run"))
    return out, run, stats


def test_the_runs_csv_series_and_the_watch_end_with_the_runs_last_requests(refused_run):
    """Every series of a run ends with the run's total, as the JSON written at the exit: locust's --csv files, and
    the watch's last row."""
    folder, run, stats = refused_run
    assert run.returncode in (0, 1), run.stdout + run.stderr  # 1: every request failed (nothing listens there)
    with open(folder / "run.json") as f:
        total = sum(entry["num_requests"] for entry in json.load(f))
    assert total > 0
    assert int(stats["Aggregated"]["Request Count"]) == total, (stats["Aggregated"], total)
    with open(folder / "run_stats_history.csv", newline="") as f:
        history = [row for row in csv.DictReader(f) if row["Name"] == "Aggregated"]
    assert int(history[-1]["Total Request Count"]) == total, (history[-3:], total)
    with open(folder / "watch.csv", newline="") as f:
        watched = list(csv.DictReader(f))
    assert int(watched[-1]["requests"]) == total, (watched[-1], total)


def test_locusts_csv_files_count_the_requests_of_the_runs_last_second(tmp_path):
    """locust's --csv writer writes every second and closes its files at the exit without a last write: the stats
    CSV and its history missed the requests after its last round (a 60 s run's _stats.csv counted 379 of its 385
    requests, its series ending a second early). Its writer, driven as locust's main drives it: a round, a request
    after it, then the exit (the quit event, then the files closed)."""
    probe = f"""
import csv, sys, types
import gevent
from locust import events, stats
from locust.env import Environment
sys.path.insert(0, "locust")
import locustfile

prefix = sys.argv[1]
env = Environment(events=events, parsed_options=types.SimpleNamespace(
    csv_prefix=prefix, watch_csv=prefix + "_watch.csv", watch_interval=5.0, submit_weight=1, streaming_weight=1,
    switchyard_metrics="", token_file=""))
events.init.fire(environment=env, runner=None, web_ui=None)  # the locustfile reads the options
writer = stats.StatsCSVFileWriter(env, stats.PERCENTILES_TO_REPORT, prefix, False)
gevent.spawn(writer.stats_writer)
gevent.sleep(0.1)  # its first round, before any request
env.stats.log_request("POST", "/api/v1/agent/submit", 5, 0)  # the run's last request
events.quit.fire(exit_code=0)
writer.close_files()
with open(prefix + "_stats.csv", newline="") as f:
    final = {{row["Name"]: row["Request Count"] for row in csv.DictReader(f)}}
with open(prefix + "_stats_history.csv", newline="") as f:
    series = [row["Total Request Count"] for row in csv.DictReader(f)]
print(final.get("Aggregated"), series[-1])
"""
    run = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=120, cwd=LOCUSTFILE.parents[1])
    assert run.stdout.split() == ["1", "1"], run.stdout + run.stderr


def test_an_unreadable_token_file_stops_the_run_before_it_starts(tmp_path):
    run, stats = run_locust("http://127.0.0.1:1", tmp_path, dict(os.environ), "--token-file", str(tmp_path / "no"))
    assert run.returncode == 2 and f"locustfile: --token-file {tmp_path / 'no'}: cannot read it" in run.stderr
    assert "Traceback" not in run.stderr and not stats


def test_a_watch_csv_where_no_file_can_be_written_stops_the_run_before_it_starts(tmp_path):
    """--watch-csv naming a folder: exit 2 naming the option, no load; the run went on without its watch after
    'Uncaught exception in event handler' and an IsADirectoryError traceback."""
    (tmp_path / "folder").mkdir()
    run, stats = run_locust("http://127.0.0.1:1", tmp_path, dict(os.environ), "--watch-csv", str(tmp_path / "folder"))
    assert run.returncode == 2, run.stderr
    assert f"locustfile: --watch-csv: expected a file that can be written ({tmp_path / 'folder'} is a directory)" \
        in run.stderr
    assert "Traceback" not in run.stderr and not stats


def test_a_watch_csv_in_a_folder_that_cannot_be_made_stops_the_run_before_it_starts(tmp_path):
    """/proc/x/watch.csv: os.access said the missing folder could be made in /proc; the run began, the watch
    failed in a FileNotFoundError traceback ('Uncaught exception in event handler'), exit 2 after the load."""
    run, stats = run_locust("http://127.0.0.1:1", tmp_path, dict(os.environ), "--watch-csv", "/proc/x/watch.csv")
    assert run.returncode == 2, run.stderr
    assert "locustfile: --watch-csv: expected a file that can be written (cannot make the folder /proc/x" in run.stderr
    assert "Traceback" not in run.stderr and not stats


def test_a_host_that_is_not_an_http_url_stops_the_run_before_it_starts(tmp_path):
    """--host nohost: each request was a MissingSchema traceback, and the stop reported them as submits 'cut by
    the stop before their answer'."""
    run, stats = run_locust("nohost", tmp_path, dict(os.environ))
    assert run.returncode == 2, run.stderr
    assert "locustfile: --host: expected an http:// or https:// URL" in run.stderr and "'nohost'" in run.stderr
    assert "Traceback" not in run.stderr and not stats


def test_a_switchyard_metrics_that_is_not_an_http_url_stops_the_run_before_it_starts(tmp_path):
    """--switchyard-metrics nohost: the run went on, each watch row's error 'not Prometheus metrics (unknown url
    type)'."""
    run, stats = run_locust("http://127.0.0.1:1", tmp_path, dict(os.environ), "--switchyard-metrics", "nohost")
    assert run.returncode == 2, run.stderr
    assert "locustfile: --switchyard-metrics: expected an http:// or https:// URL" in run.stderr
    assert "Traceback" not in run.stderr and not stats


async def test_a_host_with_a_trailing_slash_reaches_the_routes(tmp_path):
    """--host http://h:8080/ sent every request to //api/v1/agent/submit: 404 each, the whole run failed."""
    async with http_stack() as (client, _, _down):
        host = str(client.base_url).rstrip("/") + "/"
        run, stats = await asyncio.to_thread(run_locust, host, tmp_path, dict(os.environ))
    assert run.returncode == 0, run.stdout + run.stderr
    # every request reached its route (a 404 is a failure), whichever routes ended a request within the run
    answered = stats["Aggregated"]
    assert int(answered["Request Count"]) > 0 and int(answered["Failure Count"]) == 0, stats
    assert not any(name.startswith("//") for name in stats)


def test_the_watch_reads_the_dispatcher_of_the_stack_under_test_not_the_first_one_up(tmp_path):
    """Two stacks: the second one's endpoints are in up-<pid>.json; the watch read the first's idle dispatcher."""
    import json

    def up(name: str, http_port: int, metrics_port: int) -> None:
        (tmp_path / name).write_text(json.dumps({"pid": 1, "services": {
            "orchestrator": {"address": "127.0.0.1:1", "metrics_url": "http://127.0.0.1:2/metrics", "pid": 1,
                             "http_port": http_port},
            "dispatcher": {"address": "127.0.0.1:3", "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
                           "pid": 1}}}))

    up("up.json", 8080, 9103)
    up("up-4242.json", 35583, 41000)
    two = json.loads((tmp_path / "up-4242.json").read_text())  # switchyard up --dispatchers 2: both read
    two["services"]["dispatcher-2"] = {"address": "127.0.0.1:4", "metrics_url": "http://127.0.0.1:41001/metrics",
                                       "pid": 1}
    (tmp_path / "up-4242.json").write_text(json.dumps(two))
    # one interpreter (locustfile's gevent patching keeps it out of this one) asks for each --host in turn
    probe = ("import sys; sys.path.insert(0, 'locust'); import locustfile as f; "
             "[print(f.dispatcher_metrics_url('', host)[0]) for host in sys.argv[1:]]")
    env = {**os.environ, "SWITCHYARD_UP_FILE": str(tmp_path / "up.json")}
    cases = {"http://127.0.0.1:35583": "http://127.0.0.1:41000/metrics http://127.0.0.1:41001/metrics",
             "http://127.0.0.1:8080": "http://127.0.0.1:9103/metrics",
             "": "http://127.0.0.1:9103/metrics"}
    run = subprocess.run([sys.executable, "-c", probe, *cases], capture_output=True, text=True, env=env, timeout=120)
    assert run.stdout.splitlines() == list(cases.values()), run.stdout + run.stderr


def test_the_watch_writes_its_rows_on_a_fixed_cadence():
    """Rows are due at start + k x interval: a read that took 0.7 s leaves 4.3 s to the next slot (waiting the
    whole interval after each read drifted rows to 5.0-5.7 s apart under load, losing rows over a long run),
    and a read longer than the interval skips the slot it missed instead of writing two rows at once."""
    probe = ("import sys; sys.path.insert(0, 'locust'); import locustfile as f; "
             "print([round(f.until_next_row(100.0, now, 5.0), 3) for now in (100.0, 100.7, 104.9, 105.2, 111.5)])")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "[5.0, 4.3, 0.1, 4.8, 3.5]", run.stdout + run.stderr


def test_a_watch_interval_or_weights_that_cannot_run_are_refused_naming_the_option():
    """--watch-interval nan hung the run past its --run-time and past SIGTERM (gevent.sleep(nan) in the hub), 0
    ended the watch in a ZeroDivisionError traceback, -1 read /metrics nonstop; weights both 0 ran no user and
    exited 0. The init listener exits 2 with what option_problem says, before any load."""
    cases = {"nan, 1, 1": "--watch-interval: expected a finite number of seconds >= 0.1, got nan",
             "0.0, 1, 1": "--watch-interval: expected a finite number of seconds >= 0.1, got 0",
             "5.0, -1, 1": "--submit-weight: expected a weight >= 0 (0: no user of its class), got -1",
             "5.0, 0, 0": "--submit-weight and --streaming-weight: expected one of them above 0 (both 0 run no user)",
             "5.0, 0, 1": ""}
    probe = ("import sys, types; sys.path.insert(0, 'locust'); import locustfile as f\n"
             "for case in sys.argv[1:]:\n"
             "    interval, submit, streaming = case.split(', ')\n"
             "    print(f.option_problem(types.SimpleNamespace(watch_interval=float(interval), "
             "submit_weight=int(submit), streaming_weight=int(streaming))))")
    run = subprocess.run([sys.executable, "-c", probe, *cases], capture_output=True, text=True, timeout=120,
                         cwd=LOCUSTFILE.parents[1])
    assert run.stdout.split("\n")[:-1] == list(cases.values()), run.stdout + run.stderr


def test_the_watch_names_a_metrics_address_where_grpc_answers_and_goes_on():
    """--switchyard-metrics at a gRPC port: the watch's read raised http.client.BadStatusLine, which its loop did not
    catch (OSError only), and the watch file stopped."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from switchyard_harness.top import NOT_HTTP1

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        probe = ("import sys; sys.path.insert(0, 'locust'); import locustfile as f; "
                 "print(f.read_watched(sys.argv[1])['error'])")
        run = subprocess.run([sys.executable, "-c", probe, f"http://127.0.0.1:{port}/metrics"], capture_output=True,
                             text=True, timeout=120)
    finally:
        server.stop(None)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"http://127.0.0.1:{port}/metrics: {NOT_HTTP1}", run.stdout + run.stderr


def test_a_stream_that_got_no_answer_names_why_not_status_0(refused_run):
    """A stack stopped during a run: each RunTask stream's failure read '0: ' (the status of no answer and an
    empty body), the submits' beside it 'ConnectionRefusedError(111, ...)'."""
    folder, _run, _stats = refused_run
    with open(folder / "run_failures.csv", newline="") as f:
        failures = {row["Name"]: row["Error"] for row in csv.DictReader(f)}
    assert "/api/v1/agent/run (SSE)" in failures and "/api/v1/agent/submit" in failures, failures
    assert "Connection refused" in failures["/api/v1/agent/run (SSE)"], failures
    assert not failures["/api/v1/agent/run (SSE)"].startswith("0:"), failures
