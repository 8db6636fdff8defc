"""ghz's JSON report for a run, plus the streaming figures ghz lacks.

The ghz part reproduces ghz's own arithmetic (``runner/reporter.go`` of
github.com/bojand/ghz) so numbers from ``switchyard bench`` and ``ghz`` compare:
averages over every call, fastest/slowest/percentiles/histogram over successful
calls only, percentiles by ghz's nearest-rank rule, 10 histogram buckets between
fastest and slowest, ``rps = count / total``. Durations are integer nanoseconds.

Under the extra key ``switchyard``: TTFT distribution (time from the RPC start to
the first token event), tokens and tokens per second of the successful calls
(tokens a failed call streamed before it failed are counted apart, as
``failedCallTokens``), the same figures per priority class and task type,
per-queue waits reported by the server in the final event, the errors grouped
by kind (:func:`error_kind`: the message with its ids and numbers taken out, so
a thousand deadline errors that differ only in task id and elapsed time are one
line) and the client's CPU use (see :mod:`switchyard_harness.bench.loadgen`).
ghz's own ``errorDistribution`` keeps every distinct message, as ghz does.
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections import Counter
from typing import Any, Iterable

from switchyard_harness.bench.ghz_schema import PERCENTILES
from switchyard_harness.bench.loadgen import CallResult, LoadPlan, LoadResult

CALL = "agent.AgentService.RunTask"


def ns(seconds: float) -> int:
    """Seconds -> integer nanoseconds (Go ``time.Duration``)."""
    return int(round(seconds * 1e9))


def percentile_ranks(sorted_values: list[float]) -> list[float]:
    """ghz's percentiles 10..99 of ascending ``sorted_values`` (nearest rank, 0-based)."""
    n = len(sorted_values)
    out = []
    for p in PERCENTILES:
        ip = p / 100 * n
        di = int(ip)
        if ip == di:
            di -= 1
        out.append(sorted_values[max(di, 0)])
    return out


def latency_distribution(values: Iterable[float]) -> list[dict[str, int]] | None:
    """``[{"percentage": p, "latency": ns}, ...]`` for p in 10..99; None when empty (as ghz)."""
    ordered = sorted(values)
    if not ordered:
        return None
    return [{"percentage": p, "latency": ns(v)} for p, v in zip(PERCENTILES, percentile_ranks(ordered))]


def histogram(sorted_values: list[float], buckets: int = 10) -> list[dict[str, float]] | None:
    """ghz's histogram: ``buckets + 1`` marks (seconds) from fastest to slowest with counts and frequency."""
    if not sorted_values:
        return None
    fastest, slowest = sorted_values[0], sorted_values[-1]
    size = (slowest - fastest) / buckets
    marks = [fastest + size * i for i in range(buckets)] + [slowest]
    counts = [0] * (buckets + 1)
    b = 0
    for v in sorted_values:
        while v > marks[b] and b < buckets:
            b += 1
        counts[b] += 1
    total = len(sorted_values)
    return [{"mark": m, "count": c, "frequency": c / total} for m, c in zip(marks, counts)]


def _rfc3339(epoch_s: float, nanos: bool) -> str:
    stamp = dt.datetime.fromtimestamp(epoch_s, tz=dt.timezone.utc)
    text = stamp.isoformat(timespec="microseconds" if nanos else "seconds")
    return text.replace("+00:00", "Z")


def percentile(values: list[float], p: int) -> float:
    """One ghz-rule (nearest-rank) percentile ``p`` (0-100) of unsorted ``values`` (0.0 when empty): the one
    percentile of every bench report, ghz's or the scheduler benches'."""
    if not values:
        return 0.0
    ordered = sorted(values)
    ip = p / 100 * len(ordered)
    di = int(ip) - (1 if ip == int(ip) else 0)
    return ordered[max(di, 0)]


_VARIABLE = re.compile(r"\b\d+(?:\.\d+)+\b|\b(?=[\w-]*\d)[\w-]+\b")
"""What differs between two errors of one kind: numbers (``0.405``, ``127.0.0.1``) and ids, words with a digit
of any length (``bench-8`` and ``bench-43`` are one id's two values)."""


def error_kind(message: str) -> str:
    """``message`` with its ids and numbers replaced by ``#``: errors of one cause read alike.

    ``"task 'task-aa89e934daf4' ran out of time after 0.405 s"`` -> ``"task '#' ran out of time after # s"``, and
    ``"task bench-8 ..."`` reads as ``"task bench-43 ..."`` does.
    """
    return _VARIABLE.sub("#", message)


def error_groups(results: Iterable[CallResult]) -> list[dict[str, Any]]:
    """``[{"kind", "count", "example"}, ...]`` of the failed calls, most frequent first (ties by kind)."""
    counts: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for r in results:
        if r.error:
            kind = error_kind(r.error)
            counts[kind] += 1
            examples.setdefault(kind, r.error)
    return [{"kind": k, "count": n, "example": examples[k]}
            for k, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]


def _group(results: list[CallResult]) -> dict[str, Any]:
    ok = [r for r in results if not r.error]
    return {
        "count": len(results),
        "errors": len(results) - len(ok),
        "average": ns(sum(r.latency_s for r in results) / len(results)) if results else 0,
        "latencyDistribution": latency_distribution(r.latency_s for r in ok),
        "ttftDistribution": latency_distribution(r.ttft_s for r in ok if r.ttft_s is not None),
    }


def streaming_figures(load: LoadResult) -> dict[str, Any]:
    """The ``switchyard`` section: TTFT, tokens/s, per priority class and task type, queue waits, client CPU."""
    results = load.results
    ok = [r for r in results if not r.error]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tokens = sum(r.tokens for r in ok)
    by_priority: dict[str, list[CallResult]] = {}
    by_type: dict[str, list[CallResult]] = {}
    waits: dict[str, list[float]] = {}
    for r in results:
        by_priority.setdefault(r.priority, []).append(r)
        by_type.setdefault(r.task_type, []).append(r)
        for queue, wait in r.queue_wait_s.items():
            waits.setdefault(queue, []).append(wait)
    return {
        "ttftDistribution": latency_distribution(ttfts),
        "ttftAverage": ns(sum(ttfts) / len(ttfts)) if ttfts else 0,
        "tokens": tokens,
        "tokensPerSecond": tokens / load.wall_s if load.wall_s > 0 else 0.0,
        "failedCallTokens": sum(r.tokens for r in results if r.error),
        "errorGroups": error_groups(results),
        "byPriority": {k: _group(v) for k, v in sorted(by_priority.items())},
        "byTaskType": {k: _group(v) for k, v in sorted(by_type.items())},
        "queueWait": {
            q: {"average": ns(sum(w) / len(w)), "p95": ns(percentile(w, 95))} for q, w in sorted(waits.items())
        },
        "client": {
            "processes": load.procs,
            "cpuSeconds": round(load.cpu_s, 4),
            "wallSeconds": round(load.wall_s, 4),
            "cores": os.cpu_count() or 1,
            "saturation": round(load.cpu_saturation, 4),
        },
    }


def build_report(load: LoadResult, plan: LoadPlan, name: str = "", proto: str = "proto/agent.proto") -> dict[str, Any]:
    """The full report: ghz's fields (see :mod:`switchyard_harness.bench.ghz_schema`) + ``switchyard``."""
    results = load.results
    ok_sorted = sorted(r.latency_s for r in results if not r.error)
    data: Any = plan.calldata if len(plan.calldata) > 1 else plan.calldata[0]
    report: dict[str, Any] = {
        "name": name,
        "endReason": load.end_reason,
        "options": {
            "call": CALL,
            "host": plan.host,
            "proto": proto,
            "insecure": True,
            "rps": int(plan.rps),
            "load-schedule": "const",
            "concurrency": plan.concurrency,
            "concurrency-schedule": "const",
            "total": plan.total,
            "connections": load.procs,
            "duration": ns(plan.duration_s),
            "timeout": ns(plan.timeout_s),
            "data": data,
            "binary": False,
            "CPUs": os.cpu_count() or 1,
        },
        "date": _rfc3339(dt.datetime.now(dt.timezone.utc).timestamp(), nanos=False),
        "count": len(results),
        "total": ns(load.wall_s),
        "average": ns(sum(r.latency_s for r in results) / len(results)) if results else 0,
        "fastest": ns(ok_sorted[0]) if ok_sorted else 0,
        "slowest": ns(ok_sorted[-1]) if ok_sorted else 0,
        "rps": len(results) / load.wall_s if load.wall_s > 0 else 0.0,
        "errorDistribution": dict(Counter(r.error for r in results if r.error)),
        "statusCodeDistribution": dict(Counter(r.status for r in results)),
        "latencyDistribution": latency_distribution(ok_sorted),
        "histogram": histogram(ok_sorted),
        "details": [
            {
                "timestamp": _rfc3339(r.started_at, nanos=True),
                "latency": ns(r.latency_s),
                "error": r.error,
                "status": r.status,
            }
            for r in results
        ],
        "switchyard": streaming_figures(load),
    }
    if not name:
        del report["name"]
    return report


def _ms(nanos: int) -> str:
    return f"{nanos / 1e6:.2f} ms"


def summary_text(report: dict[str, Any]) -> str:
    """A human summary in ghz's layout, followed by the streaming figures."""
    lines = [
        "Summary:",
        *(["  Interrupted:\tthe run was stopped (Ctrl-C): these are the calls that completed; the calls in flight "
           "were cancelled and are not counted"] if report["endReason"] == "cancel" else []),
        f"  Count:\t\t{report['count']}",
        f"  Total:\t\t{_ms(report['total'])}",
        f"  Slowest:\t\t{_ms(report['slowest'])}",
        f"  Fastest:\t\t{_ms(report['fastest'])}",
        f"  Average:\t\t{_ms(report['average'])}",
        f"  Requests/sec:\t{report['rps']:.2f}",
        "",
        "Response time histogram:",
    ]
    buckets = report["histogram"] or []
    top = max((b["count"] for b in buckets), default=0) or 1
    for b in buckets:
        bar = "∎" * round(40 * b["count"] / top)
        lines.append(f"  {b['mark'] * 1000:.3f} [{b['count']}]\t|{bar}")
    lines += ["", "Latency distribution:"]
    lines += [f"  {d['percentage']}% in {_ms(d['latency'])}" for d in report["latencyDistribution"] or []]
    lines.append("Status code distribution:")
    lines += [f"  [{code}]\t{n} responses" for code, n in report["statusCodeDistribution"].items()]
    sy = report["switchyard"]
    groups = sy.get("errorGroups", [])
    if groups:
        lines.append("Error distribution:")
        for group in groups:
            lines.append(f"  [{group['count']}]\t{group['example'] if group['count'] == 1 else group['kind']}")
    lines += ["", "Streaming:"]
    ttft = {d["percentage"]: d["latency"] for d in sy["ttftDistribution"] or []}
    if ttft:
        lines.append(f"  TTFT:\t\tP50 {_ms(ttft[50])}  P95 {_ms(ttft[95])}  P99 {_ms(ttft[99])}")
    failed_tokens = sy.get("failedCallTokens", 0)
    lines.append(f"  Tokens:\t{sy['tokens']}  ({sy['tokensPerSecond']:.1f} tokens/s) of successful calls"
                 + (f"; {failed_tokens} more streamed by calls that then failed" if failed_tokens else ""))
    for prio, g in sy["byPriority"].items():
        dist = {d["percentage"]: d["latency"] for d in g["latencyDistribution"] or []}
        p95 = _ms(dist[95]) if dist else "-"
        lines.append(f"  {prio:<7}\t{g['count']} calls, {g['errors']} errors, P95 {p95}")
    for queue, w in sy["queueWait"].items():
        lines.append(f"  {queue} queue wait:\tavg {_ms(w['average'])}  P95 {_ms(w['p95'])}")
    c = sy["client"]
    lines.append(
        f"  Client CPU:\t{c['cpuSeconds']:.2f} s over {c['wallSeconds']:.2f} s in {c['processes']} process(es)"
        f" = {100 * c['saturation']:.0f} % saturation"
    )
    if c["saturation"] > 0.8:
        lines.append("  WARNING: the load generator is CPU-bound; numbers understate the server. Use --procs N.")
    return "\n".join(lines)
