"""The operator's view against a real stack: Debian's Prometheus scrapes `switchyard up --free-ports`
while tasks of every priority class run; every dashboard expression and recording rule must return
data through its HTTP API, promtool must accept each service's scrape, and `switchyard top --once
--json` must read the same stack (from the launcher's up file and from flags)."""

from __future__ import annotations

import asyncio
import importlib.util
import contextlib
import json
import re
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from prom_tools import require
from stack_fixtures import UpStack
from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.process_metrics import find_cpu_stat
from switchyard.launcher import free_port

pytestmark = [pytest.mark.slow, pytest.mark.no_gpu]

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "switchyard-rules.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "switchyard.json"
SERVICES = ("orchestrator", "retrieval", "dispatcher")
PRIORITIES = {"core": agent_pb2.CORE, "normal": agent_pb2.NORMAL, "batch": agent_pb2.BATCH}
TASKS_PER_CLASS = 3
WAIT_S = 60.0
"""Longest wait for Prometheus to scrape or evaluate something (a readiness wait, not a timing check)."""
POLL_S = 0.1
"""Pause between two queries of such a wait: Prometheus scrapes and evaluates every second, and a query of this
stack's few series is cheap; polled every 0.5 s, each wait overran what it waited for by 0.25 s on average."""


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


dashboard = _load("deploy_grafana_dashboard", REPO / "deploy" / "grafana" / "dashboard.py")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stack(pydoc_index_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """`switchyard up --free-ports` on the session's index (test_e2e builds the same one)."""
    up_file = tmp_path_factory.mktemp("up") / "up.json"
    s = UpStack(pydoc_index_dir, env={"SWITCHYARD_UP_FILE": str(up_file)})
    s.up_file = up_file  # type: ignore[attr-defined]
    s.up_file_seen = []  # type: ignore[attr-defined]  # the up file's contents while the stack started
    try:
        while not s.ready.is_set() and s.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                s.up_file_seen.append(json.loads(up_file.read_text()))  # type: ignore[attr-defined]
            time.sleep(0.005)
        s.wait_ready()
        yield s
    finally:
        s.stop()


class Prometheus:
    """Debian's Prometheus server on a free port, scraping the stack every second once :meth:`scrape` names it.

    Its targets are files (``file_sd_configs``, one job per service), written when the stack has printed its
    ports: Prometheus hands new targets to its scrapers on a 5 s tick (not configurable), so it is started
    before the stack, and that wait passes while the stack starts.
    """

    def __init__(self, binary: str, folder: Path) -> None:
        self.folder = folder
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": name, "file_sd_configs": [{"files": [str(folder / f"{name}.json")]}]}
                               for name in SERVICES],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )

    def scrape(self, stack: UpStack) -> None:
        """Scrape ``stack``'s services: each job's targets file, written whole (a rename)."""
        for name in SERVICES:
            target = stack.metrics_url(name).removeprefix("http://").removesuffix("/metrics")
            partial = self.folder / f"{name}.json.partial"
            partial.write_text(json.dumps([{"targets": [target]}]))
            partial.rename(self.folder / f"{name}.json")

    def query(self, expr: str) -> list[dict]:
        """Instant query through the HTTP API; the result vector. Raises AssertionError on an API error."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, accept) -> list[dict]:
        """Query ``expr`` until ``accept(result)`` holds or WAIT_S passes; the last result."""
        deadline = time.monotonic() + WAIT_S
        while True:
            result = self.query(expr)
            if accept(result) or time.monotonic() > deadline:
                return result
            time.sleep(POLL_S)

    def without_data(self, queries: list[str]) -> list[str]:
        """The ``queries`` that still return no number (only NaN or nothing) once WAIT_S has passed.

        Rules are evaluated and targets scraped every second, so each query is
        retried until it returns a number or the wait runs out.
        """
        pending, deadline = list(queries), time.monotonic() + WAIT_S
        while pending and time.monotonic() < deadline:
            pending = [q for q in pending if not _has_number(self.query(q))]
            if pending:
                time.sleep(POLL_S)
        return pending

    def wait_ready(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited: " + Path(self.log.name).read_text()
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("prometheus not ready: " + Path(self.log.name).read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _has_number(result: list[dict]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


@pytest.fixture(scope="module")
def started_prometheus(tmp_path_factory: pytest.TempPathFactory):
    """Prometheus started with no targets yet (:class:`Prometheus`); set up before ``stack`` (see ``prometheus``)."""
    server = Prometheus(require("prometheus"), tmp_path_factory.mktemp("prometheus"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(started_prometheus: Prometheus, stack: UpStack) -> Prometheus:
    """Prometheus scraping the stack, every service's target up. ``started_prometheus`` comes first among the
    arguments, so that its start (and its 5 s tick) runs while the stack starts."""
    started_prometheus.wait_ready()
    started_prometheus.scrape(stack)
    up = started_prometheus.wait_for("up == 1", lambda r: len(r) == len(SERVICES))
    assert len(up) == len(SERVICES), f"targets not all up: {up}"
    return started_prometheus


async def _run_tasks(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = agent_pb2_grpc.AgentServiceStub(channel)

        async def one(priority: int) -> None:
            request = agent_pb2.RunTaskRequest(payload="What does the with statement do?", priority=priority)
            events = [e async for e in stub.RunTask(request, timeout=120)]
            assert events[-1].WhichOneof("event") == "final", events[-1]

        await asyncio.gather(*(one(p) for p in PRIORITIES.values() for _ in range(TASKS_PER_CLASS)))


@pytest.fixture(scope="module")
def loaded(prometheus: Prometheus, stack: UpStack) -> Prometheus:
    """Tasks of every class have run and Prometheus has scraped their counts."""
    asyncio.run(_run_tasks(stack.address("orchestrator")))
    total = len(PRIORITIES) * TASKS_PER_CLASS
    scraped = prometheus.wait_for("sum(switchyard_tasks_total)", lambda r: r and float(r[0]["value"][1]) >= total)
    assert scraped and float(scraped[0]["value"][1]) >= total, scraped
    return prometheus


# --------------------------------------------------------------------------- Prometheus


def _instantiate(expr: str) -> str:
    """A dashboard expression with its template variables set to "all" and a 1-minute rate window."""
    return expr.replace("$__rate_interval", "1m").replace("$namespace", ".*").replace("$instance", ".*")


# The 1-minute rates hold the tasks' data for a minute after they end: these two run first.
def test_every_recording_rule_returns_data(loaded: Prometheus) -> None:
    records = [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r]
    assert records
    missing = loaded.without_data([f'{{__name__="{name}"}}' for name in records])
    assert not missing, f"recording rules without data: {missing}"


def test_every_dashboard_expression_returns_data(loaded: Prometheus) -> None:
    model = json.loads(DASHBOARD.read_text())
    found = dashboard.expressions(model)
    assert len(found) >= 20, found
    no_cgroup = find_cpu_stat() is None
    assert not loaded.without_data(["switchyard_gpu_available"])  # the dispatcher's own word on NVML, scraped
    gpu_read = any(float(r["value"][1]) > 0 for r in loaded.query("switchyard_gpu_available"))
    titles, queries = {}, []
    for title, expr in found:
        query = _instantiate(expr)
        if no_cgroup and "switchyard_cpu_" in expr:
            loaded.query(query)  # still a valid query; this machine has no cgroup cpu.stat to read
            continue
        if not gpu_read and re.search(r"switchyard_gpu_(memory_)?utilization_ratio", expr):
            # no NVML here: the GPU's utilisation is NaN (not read), not a 0 that reads as an idle GPU
            assert loaded.query(query), f"{title}: {query} has no series at all"
            continue
        titles[query] = title
        queries.append(query)
    missing = loaded.without_data(queries)
    assert not missing, "dashboard expressions without data:\n" + "\n".join(f"{titles[q]}: {q}" for q in missing)


def test_ttft_is_recorded_per_priority_class(loaded: Prometheus) -> None:
    result = loaded.query("sum by (priority_class) (switchyard_ttft_seconds_count)")
    assert {r["metric"]["priority_class"]: float(r["value"][1]) for r in result} == {
        c: float(TASKS_PER_CLASS) for c in PRIORITIES
    }


@pytest.mark.parametrize("service", SERVICES)
def test_promtool_accepts_each_services_scrape(stack: UpStack, loaded: Prometheus, service: str) -> None:
    with urllib.request.urlopen(stack.metrics_url(service), timeout=10) as response:
        text = response.read()
    out = subprocess.run([require("promtool"), "check", "metrics"], input=text, capture_output=True)
    assert out.returncode == 0 and not out.stdout.strip(), (out.stdout + out.stderr).decode()


# --------------------------------------------------------------------------- switchyard top


def _top(*args: str, up_file: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SWITCHYARD_UP_FILE": str(up_file)}
    env["COLUMNS"] = "300"  # one line per header, whatever the temp path
    return subprocess.run([sys.executable, "-m", "switchyard.cli", "top", *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_top_once_json_reads_the_stack_the_launcher_started(stack: UpStack, loaded: Prometheus) -> None:
    out = _top("--once", "--json", up_file=stack.up_file)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    assert {n: s["url"] for n, s in snap["services"].items()} == {n: stack.metrics_url(n) for n in SERVICES}
    assert all(s["up"] for s in snap["services"].values())
    assert {q: v["capacity"] for q, v in snap["queues"].items()} == {  # submitted: the orchestrator's backlog bound
        "orchestration": 2048, "retrieval": 1024, "inference": 512, "submitted": 10000}
    assert {c: v["ttft_count"] for c, v in snap["classes"].items()} == {c: TASKS_PER_CLASS for c in PRIORITIES}
    assert snap["batch"]["mean_size"] >= 1 and sum(snap["batch"]["flushes"].values()) >= 1
    assert 0 < snap["engine"]["roofline_efficiency"] <= 1
    assert snap["dram"] == {"up": True, "outages": 0, "degraded_operations": 0}  # `switchyard up` starts its Redis
    assert {f"switchyard_tier_bytes{{tier={t}}}" for t in ("hbm", "dram", "cold")} <= set(snap["tiers"])
    # top's quantile is PromQL's: the same buckets give Prometheus' own histogram_quantile.
    promql = loaded.query('histogram_quantile(0.95, sum by (le) (switchyard_ttft_seconds_bucket{priority_class="core"}))')
    assert snap["classes"]["core"]["ttft_p95_s"] == pytest.approx(float(promql[0]["value"][1]), rel=1e-9)


def test_top_once_json_takes_addresses_as_flags_and_names_a_service_it_cannot_reach(
    stack: UpStack, loaded: Prometheus, tmp_path: Path
) -> None:
    dead = f"127.0.0.1:{free_port('127.0.0.1')}"
    flags = ["--orchestrator", dead, "--retrieval", stack.metrics_url("retrieval"),
             "--dispatcher", stack.metrics_url("dispatcher").removeprefix("http://").removesuffix("/metrics")]
    out = _top("--once", "--json", *flags, up_file=tmp_path / "absent.json")
    assert out.returncode == 1, out.stderr
    snap = json.loads(out.stdout)
    assert snap["services"]["orchestrator"]["up"] is False
    assert snap["services"]["orchestrator"]["url"] == f"http://{dead}/metrics"
    assert "Connection refused" in snap["services"]["orchestrator"]["error"]
    assert snap["services"]["dispatcher"]["up"] and snap["classes"]["batch"]["ttft_count"] == TASKS_PER_CLASS


def test_top_live_view_refreshes_from_the_stack_and_ends_after_its_frames(stack: UpStack, loaded: Prometheus) -> None:
    # Not a terminal here: each frame is written as it is drawn, the first (totals since start), then one per
    # refresh, the last a window between two scrapes.
    out = _top("--frames", "2", "--interval", "0.2", up_file=stack.up_file)
    assert out.returncode == 0, out.stderr
    assert "switchyard top" in out.stdout and "priority classes" in out.stdout and "inference" in out.stdout
    last = out.stdout.rsplit("switchyard top", 1)[-1]
    assert "since start" not in last and " s; endpoints from up file" in last, out.stdout


def test_a_starting_stack_claims_its_up_file_before_its_services_are_healthy(stack: UpStack) -> None:
    """The file was written only once every service was healthy (seconds, or 40 under load): a second stack
    started meanwhile found none, took the same file, and the first stack's top and locust watch read the
    second's figures. The claim names the launcher and no service yet; then the services."""
    seen = stack.up_file_seen  # type: ignore[attr-defined]
    assert seen and seen[0] == {"pid": stack.proc.pid, "services": {}}, seen[:1]
    assert set(json.loads(stack.up_file.read_text())["services"]) >= {"orchestrator", "retrieval", "dispatcher"}
