"""``switchyard top``: a live terminal view of a running stack, read from its ``/metrics``.

    switchyard top                                   # the stack `switchyard up` started (its up file)
    switchyard top --dispatcher 10.0.0.7:9103 ...    # any endpoints, as host:port or URLs
    switchyard top --once --json                     # one snapshot for scripts

Every ``--interval`` seconds (default 1) it scrapes the three services'
Prometheus endpoints and shows, per queue, depth, capacity and wait; batch
size and flushes by reason; engine busy ratio, roofline efficiency and compute
score; running and waiting sequences, preemptions and TTFT P50/P95 per priority
class; the DRAM tier's state (up, outages, degraded operations), the task
store's (up or down) and the bytes held in each memory tier. Rates and
quantiles cover the last interval (the difference of two scrapes); the first
frame, and ``--once``, cover everything since each process started. It draws
plain text with ``rich`` (no full-screen mode), so it works over SSH and in a
pipe: on a terminal each frame replaces the last; in a pipe or a file each frame
(the first, then one per refresh) is written below the last and flushed as it is
drawn. Ctrl-C ends it. ``--once --json`` writes valid JSON: a figure that is not
known (a gauge the service does not read, NaN in its metrics) is ``null``.

Endpoints come from flags, else from the up file that ``switchyard up`` writes
(``switchyard.common.up_files.default_path``; one a killed launcher left is removed, not read),
or the one ``--up-file`` names (one a killed launcher left is said to be stale and not read, and
left in place: a file the user names is never removed), else from the configured metrics ports.

Exit status: 0 when ``--once`` read every service; 1 when it could not reach one or more (every one down
included): a line on stderr names each service down and why, and the JSON says so too (``up``, ``error``);
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import os
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client.parser import text_string_to_metric_families

from switchyard_harness import json_output
from switchyard.common.cli_text import parser_for
from switchyard.common.priority import LABELS
from switchyard.gateway.metrics import STREAM_ENDINGS

SERVICES = ("orchestrator", "retrieval", "dispatcher")
CLASSES = LABELS
QUEUES = ("orchestration", "retrieval", "inference")

Key = tuple[str, tuple[tuple[str, str], ...]]
"""A sample: its name and its sorted labels."""


# --------------------------------------------------------------------------- scraping


@dataclass
class Scrape:
    """One service's endpoint read once: its samples, or why it could not be read."""

    service: str
    url: str
    samples: dict[Key, float] = field(default_factory=dict)
    error: str | None = None
    at: float = 0.0
    """``time.monotonic()`` of the read."""


def parse(text: str) -> dict[Key, float]:
    """Prometheus text exposition -> ``{(sample name, sorted labels): value}``.

    Raises:
        ValueError: the text is not the Prometheus text format.
    """
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


NOT_HTTP1 = ("something answers there that is not an HTTP/1.x server (a gRPC port? a Redis?): a service's "
             "metrics are on its metrics_port (orchestrator 9101, retrieval 9102, dispatcher 9103 by default; "
             "switchyard up prints each)")
"""What a metrics reader says where the address answered, but not in HTTP/1.x (urllib's ``BadStatusLine``,
whose text is the bytes that came, not shown: a gRPC server's answer is binary)."""


def read(url: str, timeout: float = 10.0) -> dict[Key, float]:
    """Read the Prometheus endpoint ``url`` once and :func:`parse` it.

    Raises:
        OSError: it could not be read (refused, timed out, closed without an answer).
        ValueError: it did not answer the Prometheus text format, or did not answer HTTP/1.x
            (:data:`NOT_HTTP1`).
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return parse(response.read().decode())
    except http.client.HTTPException as exc:
        if isinstance(exc, OSError):  # RemoteDisconnected: closed without an answer
            raise
        raise ValueError(NOT_HTTP1) from None


def matching(samples: dict[Key, float], name: str, **labels: str) -> dict[Key, float]:
    """The samples called ``name`` whose labels include ``labels``."""
    return {k: v for k, v in samples.items()
            if k[0] == name and all(dict(k[1]).get(lk) == lv for lk, lv in labels.items())}


def total(samples: dict[Key, float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(matching(samples, name, **labels).values())


def scrape(service: str, url: str, timeout: float = 0.8) -> Scrape:
    """Read ``url`` once; a failure is kept in ``error`` (never raised)."""
    now = time.monotonic()
    try:
        return Scrape(service, url, read(url, timeout), at=now)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return Scrape(service, url, error=f"{type(exc).__name__}: {reason}", at=now)


def scrape_all(endpoints: dict[str, str], pool: ThreadPoolExecutor) -> dict[str, Scrape]:
    """Read every endpoint at once (one thread each)."""
    futures = {name: pool.submit(scrape, name, url) for name, url in endpoints.items()}
    return {name: future.result() for name, future in futures.items()}


def metrics_url(value: str) -> str:
    """``host:port`` or a URL -> the ``/metrics`` URL.

    Raises:
        ValueError: neither (no port).
    """
    if "://" in value:
        try:
            urllib.parse.urlsplit(value).port  # a port past 65535 is refused here (urllib dialled it modulo 65536)
        except ValueError as exc:
            raise ValueError(f"expected host:port or a URL, a port in 1-65535 (got {value!r}: {exc})") from None
        return value if urllib.parse.urlparse(value).path not in ("", "/") else value.rstrip("/") + "/metrics"
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port or a URL, a port in 1-65535 (got {value!r})")
    return f"http://{host}:{port}/metrics"


def endpoints_from(args: argparse.Namespace) -> tuple[dict[str, str], str]:
    """The metrics URL of each service, and where they came from (flags, up file or config).

    Raises:
        ValueError: a flag is not host:port or a URL (the message names the flag).
    """
    flagged = {}
    for name in SERVICES:
        raw = getattr(args, name)
        if raw:
            try:
                flagged[name] = metrics_url(raw)
            except ValueError as exc:
                raise ValueError(f"--{name}: {exc}") from None
    from switchyard.common import up_files

    path = Path(args.up_file) if args.up_file else up_files.default_path()
    found: dict[str, str] = {}
    source = "flags"
    if args.up_file:  # the user's file: a killed launcher's is said to be stale, never removed
        gone = up_files.gone_launcher(path)
        why_not_read = f"is stale: its switchyard up, pid {gone}, is gone; left in place" if gone is not None else ""
    else:  # the shared up file: a killed launcher's is removed (its ports serve nothing)
        stale = [pid for stale_path, pid in up_files.remove_stale(path) if stale_path == path]
        why_not_read = f"removed: its switchyard up, pid {stale[0]}, is gone" if stale else ""
    if len(flagged) < len(SERVICES):
        try:
            if why_not_read:
                raise LookupError(why_not_read)
            recorded = up_files.recorded_services(path)
            found = {name: recorded[name]["metrics_url"] for name in recorded
                     if replica_of(name) in SERVICES and replica_of(name) not in flagged}
            if not found and not flagged:
                raise KeyError("the up file lists no service")
            source = f"up file {path}"
        except (OSError, ValueError, LookupError) as exc:
            from switchyard.common.config import load_config

            config = load_config(args.config_dir)
            host = config.server.host
            found = {name: f"http://{host}:{getattr(config, name).metrics_port}/metrics" for name in SERVICES}
            source = f"config ({path} {why_not_read or _unread_up_file(exc)})"
        if flagged:  # the header said 'up file' alone for `--dispatcher X`: X's endpoint named nowhere
            source = f"{', '.join(f'--{name}' for name in flagged)}, the rest from {source}"
    return {**found, **flagged}, source


def _unread_up_file(exc: Exception) -> str:
    """Why an up file gave no endpoints, in words: not found, a folder, unreadable, not JSON, or no services."""
    if isinstance(exc, FileNotFoundError):
        return "not found"
    if isinstance(exc, IsADirectoryError):
        return "is a directory, not an up file"
    if isinstance(exc, OSError):
        return f"cannot be read ({exc.strerror or exc})"
    if isinstance(exc, (UnicodeDecodeError, json.JSONDecodeError)):
        return "is not an up file (not JSON)"
    return "is not an up file (no services with their metrics_url)"


# --------------------------------------------------------------------------- arithmetic


def histogram_quantile(q: float, buckets: list[tuple[float, float]], lowest: float = 0.0) -> float | None:
    """The ``q``-quantile of a histogram, as PromQL's ``histogram_quantile`` computes it.

    ``buckets``: ``(upper bound, cumulative count)`` pairs, any order, ``+Inf``
    included. Linear interpolation inside the bucket that holds the rank; a rank
    in the ``+Inf`` bucket gives the largest finite bound (Prometheus,
    promql/quantile.go ``bucketQuantile``). None when there are no observations.
    ``lowest``: the least value an observation can take, where the first bucket's
    interpolation starts (PromQL's 0; a batch holds at least 1 request, so that
    batches of one each read as 1, not 0.95).
    """
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    previous_bound, previous_count = min(lowest, ordered[0][0]), 0.0
    for index, (bound, count) in enumerate(ordered):
        if count >= rank:
            if math.isinf(bound):
                return ordered[-2][0]
            if index == 0 and bound <= 0:
                return bound
            in_bucket = count - previous_count
            if in_bucket <= 0:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / in_bucket
        previous_bound, previous_count = bound, count
    return ordered[-2][0]


class Window:
    """Values over the window between two scrapes of one service (``previous`` None: since start)."""

    def __init__(self, current: Scrape, previous: Scrape | None) -> None:
        self.current = current
        self.previous = previous if previous is not None and not previous.error else None

    def gauge(self, name: str, **labels: str) -> float | None:
        return self.current.samples.get((name, tuple(sorted(labels.items()))))

    def increase(self, name: str, **labels: str) -> float | None:
        """Sum over matching series of their increase in the window (a reset counts from 0)."""
        now = matching(self.current.samples, name, **labels)
        if not now:
            return None
        before = matching(self.previous.samples, name, **labels) if self.previous else {}
        total = 0.0
        for key, value in now.items():
            old = before.get(key, 0.0)
            total += value - old if value >= old else value
        return total

    def bucket_increases(self, name: str, **labels: str) -> dict[float, float]:
        """Histogram ``name``'s cumulative bucket counts gained in the window, by upper bound (summed across
        series; a reset counts from 0)."""
        per_bound: dict[float, float] = {}
        now = matching(self.current.samples, f"{name}_bucket", **labels)
        before = matching(self.previous.samples, f"{name}_bucket", **labels) if self.previous else {}
        for key, value in now.items():
            bound = float(dict(key[1])["le"])
            old = before.get(key, 0.0)
            per_bound[bound] = per_bound.get(bound, 0.0) + (value - old if value >= old else value)
        return per_bound

    def quantile(self, q: float, name: str, lowest: float = 0.0, **labels: str) -> float | None:
        """``q``-quantile of histogram ``name`` over the window (``lowest`` as :func:`histogram_quantile`'s)."""
        return histogram_quantile(q, list(self.bucket_increases(name, **labels).items()), lowest)

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({dict(k[1])[label] for k in self.current.samples if k[0] == name and label in dict(k[1])})


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def snapshot(current: dict[str, Scrape], previous: dict[str, Scrape] | None = None) -> dict[str, Any]:
    """What ``top`` shows, as JSON-ready data (seconds, bytes, ratios 0-1; None where unknown).

    Keys: ``window_s`` (None: since each process started), ``services`` (url,
    up, error), ``queues`` (per queue: depth, capacity, saturation, wait_p50_s,
    wait_p95_s, rejected), ``batch`` (mean_size, p95_size, flushes by reason),
    ``engine`` (busy_ratio, roofline_efficiency, compute_score,
    gpu_utilization_ratio, kv_fragmentation_ratio, kv_oom since start and kv_oom_in_window), ``classes`` (per priority class: running, waiting,
    preemptions, ttft_p50_s, ttft_p95_s, ttft_count), ``tasks_in_flight``,
    ``tiers`` (bytes per tier gauge, once the dispatcher exports any), ``upstream`` (a stream engine's model
    server, once the dispatcher has called one: limit, knee, in_flight, stream_endings in the window by
    ending (each of the gateway's: ``switchyard.gateway.metrics.STREAM_ENDINGS``), endpoints (a pool's
    endpoints, None without a pool) and endpoints_down (their names, sorted), circuits not closed as model -> {state: endpoints in it}; None before),
    ``dram`` (the DRAM tier's Redis as the orchestrator sees it: up,
    outages, degraded_operations; None without an orchestrator scrape), ``task_store_up`` (whether the
    orchestrator's task store answers, ``switchyard_task_store_up``: SubmitTask, GetTaskStatus and CancelTask
    need it; None without an orchestrator scrape).
    """
    prev = previous or {}
    windows = windows_of(current, prev)
    gaps = [s.at - prev[n].at for n, s in current.items() if n in prev and not s.error and not prev[n].error]
    out: dict[str, Any] = {
        "window_s": round(min(gaps), 3) if gaps and previous else None,
        "services": {n: {"url": s.url, "up": s.error is None, "error": s.error} for n, s in current.items()},
    }
    queues: dict[str, Any] = {}
    for w in windows.values():
        for queue in w.label_values("switchyard_queue_depth", "queue"):
            depth = w.gauge("switchyard_queue_depth", queue=queue)
            capacity = w.gauge("switchyard_queue_capacity", queue=queue)
            queues[queue] = {
                "depth": depth, "capacity": capacity, "saturation": _ratio(depth, capacity),
                "wait_p50_s": w.quantile(0.5, "switchyard_queue_wait_seconds", queue=queue),
                "wait_p95_s": w.quantile(0.95, "switchyard_queue_wait_seconds", queue=queue),
                "rejected": {r: w.increase("switchyard_queue_rejected_total", queue=queue, reason=r) or 0.0
                             for r in ("full", "timeout")},
            }
    out["queues"] = {q: queues[q] for q in sorted(queues, key=lambda q: (QUEUES + (q,)).index(q))}
    d = windows.get("dispatcher")
    if d is not None:
        tokens, busy = d.increase("switchyard_generated_tokens_total"), d.increase("switchyard_engine_busy_seconds_total")
        bound = d.gauge("switchyard_engine_decode_bound_tokens_per_second")
        per_busy = _ratio(tokens, busy)
        out["batch"] = {
            "mean_size": _ratio(d.increase("switchyard_batch_size_sum"), d.increase("switchyard_batch_size_count")),
            "p95_size": d.quantile(0.95, "switchyard_batch_size", lowest=1.0),
            "flushes": {r: d.increase("switchyard_flushes_total", reason=r) or 0.0
                        for r in d.label_values("switchyard_flushes_total", "reason")},
        }
        out["engine"] = {
            "busy_ratio": d.gauge("switchyard_engine_busy_ratio"),
            "roofline_efficiency": per_busy / bound if per_busy is not None and bound else None,
            "compute_score": d.gauge("switchyard_compute_score"),
            "gpu_utilization_ratio": d.gauge("switchyard_gpu_utilization_ratio"),
            "kv_fragmentation_ratio": d.gauge("switchyard_kv_fragmentation_ratio"),
            "kv_oom": d.gauge("switchyard_kv_oom_total"),
            "kv_oom_in_window": d.increase("switchyard_kv_oom_total"),
        }
        out["classes"] = {
            c: {
                "running": d.gauge("switchyard_running_agents", priority_class=c),
                "waiting": d.gauge("switchyard_waiting_agents", priority_class=c),
                "preemptions": d.increase("switchyard_preemptions_total", priority_class=c),
                "ttft_p50_s": d.quantile(0.5, "switchyard_ttft_seconds", priority_class=c),
                "ttft_p95_s": d.quantile(0.95, "switchyard_ttft_seconds", priority_class=c),
                "ttft_count": d.increase("switchyard_ttft_seconds_count", priority_class=c),
            }
            for c in CLASSES
        }
        out["upstream"] = _upstream(d)
        # Memory tiers: any dispatcher gauge named switchyard_*tier*_bytes, by its labels.
        out["tiers"] = {
            name + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else ""): value
            for (name, labels), value in sorted(d.current.samples.items())
            if "tier" in name and name.endswith("_bytes")
        }
    o = windows.get("orchestrator")
    out["tasks_in_flight"] = o.gauge("switchyard_agents_concurrent") if o is not None else None
    out["dram"] = None if o is None or o.gauge("switchyard_dram_up") is None else {
        "up": o.gauge("switchyard_dram_up") == 1,
        "outages": o.increase("switchyard_dram_outages_total"),
        "degraded_operations": o.increase("switchyard_dram_degraded_operations_total"),
    }
    store_up = o.gauge("switchyard_task_store_up") if o is not None else None
    out["task_store_up"] = None if store_up is None else store_up == 1
    return out


PER_ENGINE = ("switchyard_compute_score", "switchyard_engine_decode_bound_tokens_per_second")
"""Gauges of one engine each (besides every ``*_ratio``): the fleet's is their mean over the replicas, not a sum."""


def replica_of(name: str) -> str:
    """The service a scraped endpoint belongs to: ``dispatcher-2`` (``switchyard up --dispatchers N``) ->
    ``dispatcher``."""
    kind, _, index = name.rpartition("-")
    return kind if kind in SERVICES and index.isdigit() else name


class FleetWindow:
    """One service's replicas over the window, read as one (:class:`Window`'s interface): each replica's
    increases, bucket counts and gauges taken against its own previous scrape (its own resets, its own
    absence), then summed; a ratio or per-engine gauge (:data:`PER_ENGINE`) their mean. A replica that died
    or came back changes the sum of what the others did, never the window's increase."""

    def __init__(self, members: list[Window]) -> None:
        self.members = members
        samples: dict[Key, float] = {}
        for member in members:
            for key, value in member.current.samples.items():
                samples[key] = samples.get(key, 0.0) + value
        self.current = Scrape(members[0].current.service, ", ".join(m.current.url for m in members), samples,
                              at=min(m.current.at for m in members))
        """The replicas' samples summed (what a direct read of their gauges by label sees)."""

    def gauge(self, name: str, **labels: str) -> float | None:
        values = [v for m in self.members if (v := m.gauge(name, **labels)) is not None]
        if not values:
            return None
        return sum(values) / len(values) if name.endswith("_ratio") or name in PER_ENGINE else sum(values)

    def increase(self, name: str, **labels: str) -> float | None:
        values = [v for m in self.members if (v := m.increase(name, **labels)) is not None]
        return sum(values) if values else None

    def bucket_increases(self, name: str, **labels: str) -> dict[float, float]:
        per_bound: dict[float, float] = {}
        for member in self.members:
            for bound, value in member.bucket_increases(name, **labels).items():
                per_bound[bound] = per_bound.get(bound, 0.0) + value
        return per_bound

    def quantile(self, q: float, name: str, lowest: float = 0.0, **labels: str) -> float | None:
        return histogram_quantile(q, list(self.bucket_increases(name, **labels).items()), lowest)

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({v for m in self.members for v in m.label_values(name, label)})


def windows_of(current: dict[str, Scrape], previous: dict[str, Scrape]) -> dict[str, Window | FleetWindow]:
    """A window per service that answered: its own, or its replicas' (``dispatcher``, ``dispatcher-2``, ...) as
    one :class:`FleetWindow`, each against its own previous scrape."""
    groups: dict[str, list[Window]] = {}
    for name, scrape in current.items():
        if not scrape.error:
            groups.setdefault(replica_of(name), []).append(Window(scrape, previous.get(name)))
    return {service: members[0] if len(members) == 1 else FleetWindow(members) for service, members in groups.items()}


def _upstream(d: Window | FleetWindow) -> dict[str, Any] | None:
    """The dispatcher's model server as its ``openai`` engine meets it (see :func:`snapshot`); None while no
    upstream call was made (a step engine, or none yet): none has ended and none is in flight."""
    calls = matching(d.current.samples, "switchyard_gateway_requests_total")
    if not any(calls.values()) and not d.gauge("switchyard_upstream_in_flight"):
        return None
    circuits: dict[str, dict[str, int]] = {}  # the gauge counts endpoints per state (a pool: several)
    endpoints: dict[str, bool] = {}  # a pool's endpoints (model_gateway.pool), each up or down; none for base_url
    for (name, labels), value in d.current.samples.items():
        label = dict(labels)
        if name == "switchyard_gateway_circuit_state" and value >= 1 and label["state"] != "closed":
            circuits.setdefault(label["model"], {})[label["state"]] = int(value)
        elif name == "switchyard_gateway_endpoint_up":
            endpoints[label["endpoint"]] = endpoints.get(label["endpoint"], False) or value >= 1
    return {
        "endpoints": len(endpoints) or None,
        "endpoints_down": sorted(e for e, up in endpoints.items() if not up),
        "limit": d.gauge("switchyard_upstream_concurrency_limit"),
        "knee": d.gauge("switchyard_upstream_concurrency_knee") or None,
        "in_flight": d.gauge("switchyard_upstream_in_flight"),
        "stream_endings": {e: d.increase("switchyard_upstream_stream_endings_total", ending=e) or 0.0
                           for e in STREAM_ENDINGS},
        "circuits": circuits,
    }


def _upstream_line(up: dict[str, Any]) -> str:
    endings = ", ".join(f"{e} {_n(v)}" for e, v in up["stream_endings"].items())
    circuits = ", ".join(f"{m} {state}" + (f" x{n}" if n > 1 else "")
                         for m, states in sorted(up["circuits"].items())
                         for state, n in sorted(states.items())) or "all closed"
    pool = ""
    if up.get("endpoints"):
        down = up["endpoints_down"]
        pool = (f"   endpoints up {up['endpoints'] - len(down)} of {up['endpoints']}"
                + (f" (down: {', '.join(down)})" if down else ""))
    return (f"upstream  in flight {_n(up['in_flight'])} of limit {_n(up['limit'])}   knee {_n(up['knee'])}   "
            f"circuits: {circuits}{pool}\n          stream endings: {endings}\n")


# --------------------------------------------------------------------------- drawing


def _s(value: float | None) -> str:
    """Seconds, in the unit that reads best."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _n(value: float | None, digits: int = 0) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.0f} %"


def _bytes(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return "-"


def _dram_line(dram: dict[str, Any] | None) -> str:
    if dram is None:
        return ""
    state = "up" if dram["up"] else "DOWN"
    return (f"   DRAM tier {state}, outages {_n(dram['outages'])}, "
            f"degraded operations {_n(dram['degraded_operations'])}")


def _task_store_line(up: bool | None) -> str:
    """The task store's state: it has a Redis client (or SQLite file) of its own, so the DRAM tier's state does
    not tell it (top said only "DRAM tier up" while every SubmitTask was answered 503)."""
    if up is None:
        return ""
    return "   task store " + ("up" if up else "DOWN (SubmitTask, GetTaskStatus, CancelTask answer UNAVAILABLE)")


def render(snap: dict[str, Any], source: str) -> Any:
    """The snapshot as rich renderables (one group)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    window = "since start" if snap["window_s"] is None else f"last {snap['window_s']:.1f} s"
    status = "  ".join(
        f"[green]{n}[/]" if s["up"] else f"[red]{n} down[/] ({s['error']})" for n, s in snap["services"].items()
    )
    head = Text.from_markup(f"[bold]switchyard top[/]  {status}  [dim]{window}; endpoints from {source}[/]")
    parts: list[Any] = [head]

    queues = Table(title="queues", title_justify="left", expand=False)
    for col in ("queue", "depth", "capacity", "saturation", "wait P50", "wait P95", "rejected full", "rejected timeout"):
        queues.add_column(col, justify="left" if col == "queue" else "right")
    for name, q in snap["queues"].items():
        queues.add_row(name, _n(q["depth"]), _n(q["capacity"]), _pct(q["saturation"]), _s(q["wait_p50_s"]),
                       _s(q["wait_p95_s"]), _n(q["rejected"]["full"]), _n(q["rejected"]["timeout"]))
    parts.append(queues)

    if "engine" in snap:
        e, b = snap["engine"], snap["batch"]
        flushes = ", ".join(f"{r} {_n(v)}" for r, v in b["flushes"].items()) or "-"
        # A stream engine's model server keeps its own engine and KV: its limit and streams stand there instead.
        parts.append(Text(
            (_upstream_line(snap["upstream"]) if snap.get("upstream") else
             f"engine  busy {_pct(e['busy_ratio'])}   roofline efficiency {_pct(e['roofline_efficiency'])}   "
             f"compute score {_n(e['compute_score'], 1)}   GPU util {_pct(e['gpu_utilization_ratio'])}\n"
             f"KV      fragmentation {_pct(e['kv_fragmentation_ratio'])}   OOM {_n(e['kv_oom'])} "
             f"(+{_n(e['kv_oom_in_window'])})\n") +
            f"batch   mean {_n(b['mean_size'], 1)}   P95 {_n(b['p95_size'], 1)}   flushes: {flushes}\n"
            f"tasks in flight {_n(snap['tasks_in_flight'])}" + _dram_line(snap["dram"])
            + _task_store_line(snap["task_store_up"])
        ))
        work = Table(title="priority classes", title_justify="left")
        for col in ("class", "running", "waiting", "preemptions", "TTFT P50", "TTFT P95", "first tokens"):
            work.add_column(col, justify="left" if col == "class" else "right")
        for c, v in snap["classes"].items():
            work.add_row(c, _n(v["running"]), _n(v["waiting"]), _n(v["preemptions"]), _s(v["ttft_p50_s"]),
                         _s(v["ttft_p95_s"]), _n(v["ttft_count"]))
        parts.append(work)
        if snap["tiers"]:
            tiers = Table(title="memory tiers", title_justify="left")
            tiers.add_column("series")
            tiers.add_column("bytes", justify="right")
            for name, value in snap["tiers"].items():
                tiers.add_row(name, _bytes(value))
            parts.append(tiers)
    return Group(*parts)


# --------------------------------------------------------------------------- command


def main(argv: list[str]) -> int:
    parser = parser_for("switchyard top", __doc__)
    for name in SERVICES:
        parser.add_argument(f"--{name}", metavar="ADDR", help=f"{name} metrics endpoint: host:port or URL")
    parser.add_argument("--up-file", help="endpoints file written by switchyard up (default: $SWITCHYARD_UP_FILE "
                        "or <temp dir>/switchyard-<uid>/up.json); one whose switchyard up is gone is said to be "
                        "stale and left in place")
    parser.add_argument("--config-dir",
                        help="config folder for the fallback ports (default: $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print the snapshot as JSON")
    parser.add_argument("--frames", type=int, default=0,
                        help="stop after this many refreshes, the first frame and N more drawn (default 0: until Ctrl-C)")
    args = parser.parse_args(argv)
    if args.json and not args.once:
        parser.error("--json: expected together with --once (a live view is not JSON)")
    if args.frames < 0:
        parser.error(f"--frames: expected a count >= 0 (got {args.frames})")
    if not 0.1 <= args.interval <= 60:
        parser.error(f"--interval: expected seconds in [0.1, 60] (got {args.interval})")
    try:
        endpoints, source = endpoints_from(args)
    except ValueError as exc:
        parser.error(str(exc))

    if not args.json:
        try:
            import rich  # noqa: F401
        except ImportError:
            print("switchyard top: the live view needs rich: pip install -e '.[top]' from the repository root "
                  "(or use --once --json)", file=sys.stderr)
            return 2
    with ThreadPoolExecutor(max_workers=max(1, len(endpoints))) as pool:
        if args.once:
            snap = snapshot(scrape_all(endpoints, pool))
            if args.json:
                print(json_output.dumps(snap, indent=2))
            else:
                _console().print(render(snap, source))
            down = {name: s["error"] for name, s in snap["services"].items() if not s["up"]}
            if down:  # on stderr: a script reading the JSON, or the view, on stdout still learns which, and why
                print(f"switchyard top: {len(down)} of {len(snap['services'])} services down: "
                      + "; ".join(f"{name} ({error})" for name, error in down.items()), file=sys.stderr)
            return 1 if down else 0

        console = _console()
        current = scrape_all(endpoints, pool)
        try:
            with _frames(console, render(snapshot(current), source)) as draw:
                frames = 0
                while not args.frames or frames < args.frames:
                    last = min((s.at for s in current.values()), default=time.monotonic())
                    time.sleep(max(0.0, args.interval - (time.monotonic() - last)))
                    previous, current = current, scrape_all(endpoints, pool)
                    draw(render(snapshot(current, previous), source))
                    frames += 1
        except KeyboardInterrupt:
            pass
        return 0


PIPE_WIDTH = 160
"""Columns of the view written to a pipe or a file (rich's 80 cut the tables' headers to "capaci…")."""


def _console() -> Any:
    """rich's Console: the terminal's width on a terminal, :data:`PIPE_WIDTH` elsewhere (``COLUMNS`` wins)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=PIPE_WIDTH)
    return console


@contextlib.contextmanager
def _frames(console: Any, first: Any) -> Iterator[Callable[[Any], None]]:
    """Draw ``first`` now; yields ``draw(frame)`` for each later frame.

    On a terminal each frame replaces the last in place (rich's ``Live``). Anywhere else (a pipe, a file,
    ``ssh host switchyard top | ...``) ``Live`` would write nothing until it stops, and then only the last
    frame: there each frame is printed below the last, a blank line between them, and flushed as it is
    drawn, so a reader sees every frame when it is drawn.
    """
    if console.is_terminal:
        from rich.live import Live

        with Live(first, console=console, auto_refresh=False) as live:
            yield lambda frame: live.update(frame, refresh=True)
        return

    def draw(frame: Any, gap: bool = True) -> None:
        if gap:
            console.print()
        console.print(frame)
        console.file.flush()

    draw(first, gap=False)
    yield draw


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
