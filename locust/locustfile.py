"""The field's locust load test of the orchestrator's HTTP face, plus a streaming RunTask (SSE) user.

Run from the repository root against a running stack (``make run``)::

    locust -f locust/locustfile.py --headless --users 100 --spawn-rate 10 --run-time 10m \\
        --host http://localhost:8080 --csv bench-results/locust

Users:

- ``AgentUser``: the field's user class as written: every 0.1-0.5 s it posts
  ``{"agent_id": "agent-<1..1000>", "priority": "core|normal|batch",
  "task_type": "react_loop", "max_tokens": 512}`` to ``/api/v1/agent/submit``
  with the priority also in the ``X-Priority`` header.
- ``StreamingRunTaskUser``: ``POST /api/v1/agent/run``, the task's events as
  Server-Sent Events, read to the ``final`` event; a stream that ends with an
  ``error`` event or without ``final`` is a failure. Besides the request it
  reports ``SSE TTFT`` (first token) and ``SSE final`` (whole stream) as their
  own rows of locust's stats. One in :data:`STREAMING_SHARE` of the users by
  default (``--streaming-weight`` / ``--submit-weight`` change the mix; a class
  name on the command line runs that class alone).

While the test runs, the three figures the field watches are written every
``--watch-interval`` seconds (default 5) to ``--watch-csv`` (default
``locust_watch.csv``), read from the dispatcher's ``/metrics``: engine busy ratio
and compute score (GPU utilisation too when NVML reports it), KV fragmentation
ratio and the OOM count, each row with locust's own totals at that moment
(requests, failures, requests/s, P50/P95 ms); the last row is written at the run's end (the users stopped,
before the backlog is settled), so the series ends with the run's totals, as locust's own ``--csv`` files do
(their writer's last round is waited for at the exit). The dispatcher's metrics URL comes
from ``--switchyard-metrics``, else the up file of the stack whose HTTP face is
``--host`` (``switchyard up`` records each stack's), else
``http://127.0.0.1:9103/metrics``; the log says which it read. ``switchyard top``
shows the same figures live.

Against a stack with ``orchestrator.auth`` on, every request sends
``Authorization: Bearer <token>``: the value of ``SWITCHYARD_AUTH_TOKEN``
(``--token-env NAME`` for another variable), as ``switchyard run`` sends it, or
the contents of ``--token-file FILE``, which wins over the variable
(switchyard.common.client_token)::

    SWITCHYARD_AUTH_TOKEN=... locust -f locust/locustfile.py --headless ...

An unreadable or empty ``--token-file`` stops the run before it starts (exit 2).

At the test's stop the backlog the users left (tasks AgentUser submitted that are still queued or running) is
cancelled (``POST /api/v1/tasks/{task_id}/cancel``, :data:`SETTLE_CONCURRENCY` at once), so that no load goes on
after locust exits; ``--keep-backlog`` leaves it running. Either way one line reports it (how many were queued,
running, cancelled or kept), and with ``--csv PREFIX`` ``PREFIX_backlog.csv`` lists each task (task_id, its state
when asked, cancelled / kept / done / error). A task that could not be cancelled is an error in the log and exit
status 1.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import random
import sys
import time
import urllib.parse
from pathlib import Path

import gevent
from locust import HttpUser, between, events, task
from prometheus_client.parser import text_string_to_metric_families

from switchyard.common import outputs
from switchyard.common.client_token import TOKEN_ENV, TokenError, authorization, bearer_token
from switchyard.common.priority import LABELS
from switchyard.common.up_files import default_path, recorded_services, remove_stale
from switchyard_harness.arg_types import http_url
from switchyard_harness.backlog import SETTLE_CONCURRENCY, SETTLE_DEADLINE_S, backlog_summary, outcome, task_path

PRIORITIES = LABELS
"""The priority classes a user picks from, as the harness sends them (lower case)."""
STREAMING_SHARE = 5
"""One user in this many is a StreamingRunTaskUser by default (weights 4 : 1)."""
WATCHED = (
    ("engine_busy_ratio", "switchyard_engine_busy_ratio"),
    ("compute_score", "switchyard_compute_score"),
    ("gpu_utilization_ratio", "switchyard_gpu_utilization_ratio"),
    ("kv_fragmentation_ratio", "switchyard_kv_fragmentation_ratio"),
    ("kv_oom_total", "switchyard_kv_oom_total"),
)
"""CSV column -> dispatcher sample (summed over its label sets)."""
STATS_COLUMNS = ("requests", "failures", "current_rps", "p50_ms", "p95_ms")
AUTH_HEADERS: dict[str, str] = {}
"""``Authorization`` for every request, set once the options are read (:func:`_options`); empty for no token."""


class _Authorized:
    """Sends :data:`AUTH_HEADERS` with every request of the user (its session's default headers)."""

    def on_start(self) -> None:
        self.client.headers.update(AUTH_HEADERS)


class AgentUser(_Authorized, HttpUser):
    """The field's user: submits react_loop tasks of random agents and priority classes. Each task it was answered
    accepted joins :data:`SUBMITTED`, the backlog settled at the test's stop (:func:`_settle_backlog`)."""

    wait_time = between(0.1, 0.5)
    weight = STREAMING_SHARE - 1

    @task
    def submit_agent_task(self) -> None:
        priority = random.choice(PRIORITIES)
        answer = None
        try:
            answer = self.client.post(
                "/api/v1/agent/submit",
                json={"agent_id": f"agent-{random.randint(1, 1000)}", "priority": priority,
                      "task_type": "react_loop", "max_tokens": 512},
                headers={"X-Priority": priority},
            )
        finally:  # the stop kills a user mid-request (GreenletExit): its task, if accepted, is not known here
            _remember(answer)


class StreamingRunTaskUser(_Authorized, HttpUser):
    """RunTask over HTTP: one SSE stream per task, read to its final event."""

    wait_time = between(0.1, 0.5)
    weight = 1

    @task
    def run_agent_task(self) -> None:
        priority = random.choice(PRIORITIES)
        agent = f"agent-{random.randint(1, 1000)}"
        started = time.perf_counter()
        first_token: float | None = None
        kind, size, last = "", 0, ""
        with self.client.post(
            "/api/v1/agent/run", stream=True, catch_response=True, name="/api/v1/agent/run (SSE)",
            json={"agent_id": agent, "priority": priority, "task_type": "chat", "max_tokens": 64,
                  "payload": "How does the with statement work?"},
            headers={"X-Priority": priority, "Accept": "text/event-stream"},
        ) as response:
            if response.status_code == 0:  # no answer (refused, reset, timed out): its error, as a submit's reads
                response.failure(response.error)
                return
            if response.status_code != 200:
                response.failure(f"{response.status_code}: {response.text[:300]}")
                return
            for line in response.iter_lines(decode_unicode=True):
                size += len(line) + 1
                if line.startswith("event:"):
                    kind = line[6:].strip()
                    if kind == "token" and first_token is None:
                        first_token = time.perf_counter()
                elif line.startswith("data:"):
                    last = line[5:].strip()
            if kind != "final":
                response.failure(f"stream ended with {kind or 'no event'}: {last[:300]}")
                return
            response.success()
        done = time.perf_counter()
        fire = self.environment.events.request.fire
        if first_token is not None:
            fire(request_type="SSE", name="SSE TTFT", response_time=(first_token - started) * 1000,
                 response_length=0, exception=None, context={})
        fire(request_type="SSE", name="SSE final", response_time=(done - started) * 1000,
             response_length=size, exception=None, context={})


# --------------------------------------------------------------------------- the backlog left at the stop

SUBMITTED: dict[str, None] = {}
"""The task_id of each task AgentUser's submits were answered accepted in this process (a worker holds its own
users'), in order; settled and emptied at the test's stop."""
CUT_SUBMITS = [0]
"""Submits the stop cut before their answer came (their tasks, if accepted, are not known to cancel)."""


def _remember(answer) -> None:
    """Record the task of an accepted submit answer (``{"status": "accepted", "task_id": ...}``) in
    :data:`SUBMITTED`; ``None`` (no answer: the stop cut the request) counts in :data:`CUT_SUBMITS`."""
    if answer is None:
        CUT_SUBMITS[0] += 1
        return
    if answer.status_code != 200:
        return
    try:
        body = answer.json()
        task_id = body["task_id"]
    except (ValueError, KeyError, TypeError):
        return
    if isinstance(task_id, str) and task_id:
        SUBMITTED[task_id] = None


def settle_backlog(host: str, task_ids: list[str], keep: bool, headers: dict[str, str] | None = None,
                   concurrency: int = SETTLE_CONCURRENCY, deadline_s: float = SETTLE_DEADLINE_S,
                   timeout_s: float = 10.0) -> dict[str, tuple[str, str]]:
    """Cancel the tasks ``task_ids`` still queued or running at the HTTP face ``host``, or with ``keep`` only read
    their states (switchyard_harness.backlog, which reads each answer); ``concurrency`` requests at once, each
    within ``timeout_s`` seconds, all within ``deadline_s``.

    Returns:
        task_id -> :func:`switchyard_harness.backlog.outcome` (its state when asked, what became of it), or
        ``("", "error: ...")`` for a task not asked in time or not answered.
    """
    import requests
    from gevent.pool import Pool
    from requests.adapters import HTTPAdapter

    session = requests.Session()
    session.headers.update(headers or {})
    adapter = HTTPAdapter(pool_connections=1, pool_maxsize=concurrency)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    base = host.rstrip("/")
    ends = time.monotonic() + deadline_s

    def settle(task_id: str) -> tuple[str, tuple[str, str]]:
        if time.monotonic() > ends:
            return task_id, ("", f"error: not asked within {deadline_s:g} s")
        path = task_path(base, task_id)
        try:
            reply = session.get(path, timeout=timeout_s) if keep else session.post(f"{path}/cancel", timeout=timeout_s)
        except requests.RequestException as exc:
            return task_id, ("", f"error: {exc}")
        return task_id, outcome(reply.status_code, reply.text, keep)

    try:
        return dict(Pool(concurrency).imap_unordered(settle, task_ids))
    finally:
        session.close()


def _write_backlog_csv(path: str, outcomes: dict[str, tuple[str, str]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task_id", "state", "outcome"])
        writer.writerows([task_id, state, outcome] for task_id, (state, outcome) in sorted(outcomes.items()))


def _settle_backlog(environment, **_kwargs) -> None:
    """At the test's stop: the tasks this process's users submitted that had not finished are cancelled (or, with
    ``--keep-backlog``, read and left running) and reported: a log line, ``<--csv prefix>_backlog.csv`` (each task:
    its state when asked, what became of it), exit status 1 when some could not be cancelled."""
    from locust.runners import MasterRunner

    if isinstance(environment.runner, MasterRunner):  # its workers hold the users, and settle their own
        return
    task_ids, cut = list(reversed(SUBMITTED)), CUT_SUBMITS[0]  # newest first: the queued ones, within the deadline
    SUBMITTED.clear()
    CUT_SUBMITS[0] = 0
    if not task_ids and not cut:
        return
    options = environment.parsed_options
    keep = bool(getattr(options, "keep_backlog", False))
    outcomes = settle_backlog(environment.host or "", task_ids, keep, AUTH_HEADERS)
    failed = any(outcome.startswith("error") for _, outcome in outcomes.values())
    log = logging.getLogger("switchyard.locust")
    (log.error if failed else log.info)("%s", backlog_summary(outcomes, cut, keep))
    if prefix := getattr(options, "csv_prefix", None):
        _write_backlog_csv(f"{prefix}_backlog.csv", outcomes)
    if failed and not keep:  # load nobody asked for goes on
        environment.process_exit_code = 1


# --------------------------------------------------------------------------- the watched figures


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    parser.add_argument("--switchyard-metrics", default="", help="the dispatcher's /metrics URL (default: the up "
                        "file of switchyard up, else http://127.0.0.1:9103/metrics)")
    parser.add_argument("--watch-csv", default="locust_watch.csv", help="where the watched figures go (CSV)")
    parser.add_argument("--watch-interval", type=float, default=5.0, help="seconds between rows (default 5)")
    parser.add_argument("--submit-weight", type=int, default=AgentUser.weight, help="weight of AgentUser")
    parser.add_argument("--streaming-weight", type=int, default=StreamingRunTaskUser.weight,
                        help="weight of StreamingRunTaskUser (0: none)")
    parser.add_argument("--token-file", default="", help="file holding the bearer token to send to a stack with "
                        "orchestrator.auth on (wins over --token-env)")
    parser.add_argument("--keep-backlog", action="store_true", help="leave the tasks the users submitted and that "
                        "had not finished at the stop running (default: they are cancelled and reported)")
    parser.add_argument("--token-env", default=TOKEN_ENV, help=f"variable holding the bearer token, as switchyard "
                        f"run reads it (default {TOKEN_ENV}; unset or empty: no token)")


def dispatcher_metrics_url(flag: str, host: str = "") -> tuple[str, str]:
    """The dispatcher's ``/metrics`` URL the watch reads, and where it came from: ``--switchyard-metrics``; else
    the up file of the stack whose HTTP face is ``host`` (locust's ``--host``: with two stacks running, the second
    one's endpoints are in ``up-<pid>.json`` beside the first's ``up.json``); else ``SWITCHYARD_UP_FILE`` or the
    usual up file; else the default port. An up file whose launcher is gone (killed) is removed, not read."""
    if flag:
        return flag, "--switchyard-metrics"
    default = default_path()
    port = urllib.parse.urlsplit(host).port if host else None
    for stale, pid in remove_stale(default):  # a killed launcher's: its ports serve nothing
        logging.getLogger("switchyard.locust").info("removed %s: its switchyard up (pid %d) is gone", stale, pid)
    candidates = [default, *sorted(default.parent.glob("up*.json"))]
    for path in dict.fromkeys(candidates):
        try:
            services = recorded_services(path)
            if port is None or services["orchestrator"].get("http_port") == port:
                replicas = [services[name]["metrics_url"] for name in services  # switchyard up --dispatchers N
                            if name == "dispatcher" or name.startswith("dispatcher-")]
                return " ".join(replicas) or services["dispatcher"]["metrics_url"], str(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return "http://127.0.0.1:9103/metrics", "the default port (no up file names a stack with this --host)"


def read_watched(urls: str, timeout: float = 3.0) -> dict[str, float | str]:
    """The watched figures from one scrape of each dispatcher in ``urls`` (space-separated: the replicas of
    ``switchyard up --dispatchers N``): the OOM count summed over them, a ratio or the compute score their
    mean; empty values and an ``error`` naming each one that could not be read."""
    import http.client
    import urllib.request

    from switchyard_harness.top import NOT_HTTP1

    per_replica: list[dict[str, float]] = []
    errors: list[str] = []
    for url in urls.split():
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                text = reply.read().decode()
            sums: dict[str, float] = {}
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if not math.isnan(sample.value):  # NaN: not read (GPU utilisation without NVML), an empty cell
                        sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
        except OSError as exc:
            errors.append(f"{url}: {exc}")
            continue
        except http.client.HTTPException:  # something not HTTP/1.x answered (a gRPC port): its bytes not shown
            errors.append(f"{url}: {NOT_HTTP1}")
            continue
        except ValueError as exc:  # HTTP, but not the Prometheus text format
            errors.append(f"{url}: not Prometheus metrics ({exc})")
            continue
        per_replica.append(sums)
    out: dict[str, float | str] = {}
    for column, name in WATCHED:
        values = [sums[name] for sums in per_replica if name in sums]
        if values:
            out[column] = sum(values) if name.endswith("_total") else sum(values) / len(values)
    if errors:
        out["error"] = "; ".join(errors)
    return out


def until_next_row(started: float, now: float, interval: float) -> float:
    """Seconds from ``now`` to the next row's slot, the rows due at ``started + k * interval`` (k = 1, 2, ...):
    a fixed cadence, so the time a row takes to read its figures does not push every later row back (waiting
    ``interval`` after each read put rows 5.0-5.7 s apart under load); a slot already passed is skipped."""
    return interval - (now - started) % interval


class Watch:
    """Writes a CSV row of the watched figures and locust's totals every ``interval`` seconds."""

    def __init__(self, environment, url: str, path: str, interval: float) -> None:
        self.environment, self.url, self.interval = environment, url, interval
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", newline="")  # noqa: SIM115 - closed by stop()
        self.writer = csv.writer(self.file)
        self.writer.writerow(["timestamp", "elapsed_s", *(c for c, _ in WATCHED), *STATS_COLUMNS, "error"])
        self.started = time.time()
        self.greenlet = gevent.spawn(self._loop)

    def row(self) -> None:
        figures = read_watched(self.url)
        total = self.environment.stats.total
        now = time.time()
        self.writer.writerow([
            f"{now:.3f}", f"{now - self.started:.1f}", *(figures.get(c, "") for c, _ in WATCHED),
            total.num_requests, total.num_failures, f"{total.current_rps:.2f}",
            total.get_response_time_percentile(0.5) or "", total.get_response_time_percentile(0.95) or "",
            figures.get("error", ""),
        ])
        self.file.flush()

    def _loop(self) -> None:
        started = time.monotonic()
        while True:
            self.row()
            gevent.sleep(until_next_row(started, time.monotonic(), self.interval))

    def stop(self) -> None:
        self.greenlet.kill()
        self.row()
        self.file.close()


_watch: list[Watch] = []


def option_problem(options) -> str:
    """What is wrong with the numeric options, naming the option; "" when nothing is. ``--watch-interval nan``
    put the watch's gevent.sleep(nan) in the hub and the run never ended, SIGTERM included; 0 ended the watch in
    a ZeroDivisionError traceback after its first row, and a negative one read /metrics nonstop. A negative
    weight ran no user of its class, and both weights 0 ran no user at all: 0 requests, exit 0."""
    if not 0.1 <= options.watch_interval < math.inf:
        return f"--watch-interval: expected a finite number of seconds >= 0.1, got {options.watch_interval:g}"
    for flag, weight in (("--submit-weight", options.submit_weight), ("--streaming-weight", options.streaming_weight)):
        if weight < 0:
            return f"{flag}: expected a weight >= 0 (0: no user of its class), got {weight}"
    if options.submit_weight == options.streaming_weight == 0:
        return "--submit-weight and --streaming-weight: expected one of them above 0 (both 0 run no user)"
    return ""


@events.init.add_listener
def _options(environment, **_kwargs) -> None:
    """The user mix (``--submit-weight``, ``--streaming-weight``) and the bearer token, from the options."""
    options = environment.parsed_options
    try:
        token = bearer_token(getattr(options, "token_file", "") or None,
                             getattr(options, "token_env", TOKEN_ENV))
    except TokenError as exc:
        print(f"locustfile: {exc}", file=sys.stderr)
        sys.exit(2)
    AUTH_HEADERS.clear()
    AUTH_HEADERS.update(authorization(token))
    if environment.host:  # before the load: 'nohost' was a MissingSchema traceback per request, each counted as a
        try:  # submit "cut by the stop"; 'http://h:8080/' sent every request to //api/v1/..., 404
            environment.host = http_url(environment.host)
        except argparse.ArgumentTypeError as exc:
            print(f"locustfile: --host: {exc}", file=sys.stderr)
            sys.exit(2)
    for url in (getattr(options, "switchyard_metrics", "") or "").split():  # before the load: 'nohost' was read
        try:  # every row as "not Prometheus metrics (unknown url type)"
            http_url(url)
        except argparse.ArgumentTypeError as exc:
            print(f"locustfile: --switchyard-metrics: {exc}", file=sys.stderr)
            sys.exit(2)
    if options is not None and (problem := outputs.unwritable(options.watch_csv)):  # before the load, not a
        print(f"locustfile: --watch-csv: expected a file that can be written ({problem})", file=sys.stderr)  # traceback
        sys.exit(2)
    if options is not None and (problem := option_problem(options)):  # before the load
        print(f"locustfile: {problem}", file=sys.stderr)
        sys.exit(2)
    # locust arms --run-time's timer on gevent's loop clock, which moves only when the loop runs: the loop had not
    # run since locust's import, so the timer counted the import of this file (its Switchyard modules) as run
    # time, and a loaded machine's 3 s run ended ~1 s after its start, or before a request came back
    gevent.get_hub().loop.update_now()
    if options is not None:
        _CSV_WRITTEN[0] = bool(getattr(options, "csv_prefix", None))
        AgentUser.weight = options.submit_weight
        StreamingRunTaskUser.weight = options.streaming_weight
        if options.streaming_weight <= 0:
            environment.user_classes = [c for c in environment.user_classes if c is not StreamingRunTaskUser]
            environment.user_classes_by_name.pop("StreamingRunTaskUser", None)


@events.test_start.add_listener
def _start_watch(environment, **_kwargs) -> None:
    from locust.runners import WorkerRunner

    options = environment.parsed_options
    if options is None or isinstance(environment.runner, WorkerRunner):  # the master (or a local run) writes it
        return
    url, source = dispatcher_metrics_url(options.switchyard_metrics, environment.host or "")
    logging.getLogger("switchyard.locust").info("watch: %s, read from %s (from %s), every %g s", options.watch_csv,
                                                url, source, options.watch_interval)
    _watch.append(Watch(environment, url, options.watch_csv, options.watch_interval))


def _stop_watch(environment, **_kwargs) -> None:
    """The watch's last row, at the run's end: the users stopped, every request of the run counted."""
    while _watch:
        _watch.pop().stop()


# test_stop's listeners run in the order added: the watch's last row first, at the run's end, then the backlog's
# settling, which is not the run's (its row came after the settle, seconds past the run's end, its figures read then)
events.test_stop.add_listener(_stop_watch)
events.test_stop.add_listener(_settle_backlog)

_CSV_WRITTEN: list[bool] = [False]
"""Whether locust writes its ``--csv`` files in this process (set from the options at init)."""


@events.quit.add_listener
def _last_csv_write(**_kwargs) -> None:
    """locust's ``--csv`` writer rewrites ``_stats.csv`` and appends to ``_stats_history.csv`` every
    ``CSV_STATS_INTERVAL_SEC`` (1 s), and closes its files at the exit without a last write: both missed the
    requests of the run's last second (``_stats.csv`` counted 379 of a run's 385, its series ending a second
    early). ``quit`` comes after the users stopped and before those files close: waiting a little longer than
    the interval lets the writer's next round, which comes within the interval of its last, write the run's
    final figures."""
    if _CSV_WRITTEN[0]:
        from locust.stats import CSV_STATS_INTERVAL_SEC

        gevent.sleep(CSV_STATS_INTERVAL_SEC * 1.25)
