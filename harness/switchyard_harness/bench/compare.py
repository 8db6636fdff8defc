"""``switchyard bench compare``: scheduler settings side by side on one request set.

Scenarios (the field's A/B practice, in one run):

- **A** baseline: one mixed queue and no batching, what a naive gateway does.
  ``orchestrator.inference_mode = "inline"`` (an orchestration worker holds a
  task for its whole workflow, inference included), ``max_batch_size`` 1, and the
  engine runs one sequence at a time (:class:`FixedSlots`).
- **B** split queues + double buffer: the shipped config (flush 20 ms).
- **C10 / C20 / C50**: B with ``flush_interval_ms`` 10, 20, 50 (C20 repeats B
  and so shows the run-to-run noise).
- **D** adaptive flush: B with ``flush_interval_ms = "auto"``.

Each scenario gets a freshly started orchestrator and dispatcher on ports 0,
configured through ``SwitchyardConfig.with_overrides``. With ``--stack
processes`` (the default) each service is a process of its own, as
``switchyard up`` and a deployment run them (:mod:`switchyard_harness.bench.stack_process`),
and the dispatcher's figures are read from its metrics; ``--stack in-process``
runs all three on this process's event loop (quicker to start, for smoke runs;
one interpreter lock then serialises the services' CPU work). Retrieval, which
no scenario changes, is started once and shared. The stacks get a task store of their own (a
temporary SQLite file) and the DRAM tier ``--dram`` names (off by default), never the configured
``[dram]`` Redis and ``data/tasks.sqlite3``, which a stack that ``switchyard up`` runs may own. The load runs in a separate
client process (see :mod:`switchyard_harness.bench.loadgen`) so it does not compete
with the stack. Per scenario: engine busy ratio (engine busy seconds / wall), NVML GPU
utilisation when a GPU is present, queue waits per queue (from the tasks' final
events), batch sizes (``switchyard_batch_size``), P50/P95/P99, TTFT, rps and
tokens/s. Output: a table on stdout, ``compare.json``, ``compare.md``,
``compare.png`` and each scenario's ghz-format report in the output folder.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

from prometheus_client import REGISTRY

from switchyard_harness import json_output
from switchyard.common import outputs
from switchyard_harness.bench import stack_process
from switchyard_harness.bench.gpu import GpuSampler
from switchyard_harness.bench.settings import parse_settings
from switchyard_harness.bench.loadgen import LoadPlan, LoadResult, run_load
from switchyard_harness.bench.sched_bench import _dram_arg, _dram_tier, own_tier_overrides
from switchyard_harness.bench.stack_process import FixedSlots
from switchyard_harness.bench.report import build_report, percentile
from switchyard.common.config import ConfigError, SwitchyardConfig, load_config
from switchyard.common.errors import SwitchyardError
from switchyard.common.server import RunningServer, start_server
from switchyard_harness.top import matching, total
from switchyard_harness.top import read as read_metrics

log = logging.getLogger(__name__)

RETRIEVING_WORKFLOWS = {"", "rag_answer", "react_loop"}


@dataclass(frozen=True)
class Scenario:
    """One column of the comparison: a key, a label and config overrides (dotted keys).

    ``batching``: False runs the engine one sequence at a time (the no-batching baseline).
    """

    key: str
    label: str
    overrides: dict[str, Any]
    batching: bool = True


_SPLIT = "orchestrator.inference_mode"

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "A",
        "baseline: one mixed queue, no batching",
        {"batching.max_batch_size": 1, "orchestrator.inference_mode": "inline"},
        batching=False,
    ),
    Scenario("B", "split queues + double buffer (20 ms)", {"orchestrator.inference_mode": "split"}),
    *(
        Scenario(f"C{ms}", f"B, flush {ms} ms", {_SPLIT: "split", "batching.flush_interval_ms": ms})
        for ms in (10, 20, 50)
    ),
    Scenario("D", "B, adaptive flush (auto)", {_SPLIT: "split", "batching.flush_interval_ms": "auto"}),
)


def pick_scenarios(keys: str) -> list[Scenario]:
    """Scenarios named in a comma list (``"A,B,D"``; ``"all"`` = every one), in table order.

    Raises:
        ValueError: an unknown key.
    """
    if keys.strip().lower() == "all":
        return list(SCENARIOS)
    wanted = [k.strip().upper() for k in keys.split(",") if k.strip()]
    known = {s.key: s for s in SCENARIOS}
    unknown = [k for k in wanted if k not in known]
    if unknown or not wanted:
        raise ValueError(
            f"--scenarios: unknown {unknown or keys!r}; expected a comma list of {', '.join(known)} or all"
        )
    return [s for s in SCENARIOS if s.key in wanted]


# --------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """A scenario's running stack: the orchestrator's address and where the dispatcher's figures come from.

    In-process: ``dispatcher`` is the DispatcherService object. Processes: ``dispatcher_metrics``
    is its Prometheus URL.
    """

    host: str
    dispatcher: Any = None
    dispatcher_metrics: str | None = None


def _make_service(name: str, config: SwitchyardConfig) -> Any:
    from switchyard.serve import make_service

    return make_service(name, config)


def _wired(config: SwitchyardConfig, dispatcher_addr: str, retrieval_addr: str) -> SwitchyardConfig:
    return config.with_overrides(
        **{"orchestrator.dispatcher_addr": dispatcher_addr, "orchestrator.retrieval_addr": retrieval_addr}
    )


@contextlib.asynccontextmanager
async def stack(config: SwitchyardConfig, retrieval_addr: str, batching: bool = True,
                processes: bool = True) -> AsyncIterator[Stack]:
    """A fresh dispatcher and orchestrator on ports 0, the orchestrator wired to both back ends.

    ``batching`` False: the dispatcher's engine runs one request at a time. ``processes``: each
    service in its own process (else both on this event loop).
    """
    if processes:
        children: list[stack_process.ServiceProcess] = []
        try:
            d = await stack_process.start("dispatcher", config, fixed_slots=0 if batching else 1)
            children.append(d)
            o = await stack_process.start("orchestrator", _wired(config, d.address, retrieval_addr))
            children.append(o)
            yield Stack(o.address, dispatcher_metrics=d.metrics_url)
        finally:
            for child in reversed(children):
                await child.stop()
        return
    server_cfg = config.server
    started: list[RunningServer] = []
    try:
        dispatcher = _make_service("dispatcher", config)
        if not batching:
            dispatcher.scheduler.capacity = FixedSlots(1)
        d = await start_server([dispatcher], "127.0.0.1", 0, server_cfg)
        started.append(d)
        o = await start_server(
            [_make_service("orchestrator", _wired(config, f"127.0.0.1:{d.port}", retrieval_addr))],
            "127.0.0.1", 0, server_cfg,
        )
        started.append(o)
        yield Stack(f"127.0.0.1:{o.port}", dispatcher=dispatcher)
    finally:
        for srv in reversed(started):
            await srv.stop(1.0)


@contextlib.asynccontextmanager
async def shared_retrieval(config: SwitchyardConfig, needed: bool, processes: bool = True) -> AsyncIterator[str]:
    """Start retrieval once when the call data needs it; yields its address (a dead one when not needed)."""
    if not needed:
        yield "127.0.0.1:1"
        return
    if processes:
        child = await stack_process.start("retrieval", config)
        try:
            yield child.address
        finally:
            await child.stop()
        return
    srv = await start_server([_make_service("retrieval", config)], "127.0.0.1", 0, config.server)
    try:
        yield f"127.0.0.1:{srv.port}"
    finally:
        await srv.stop(1.0)


# --------------------------------------------------------------------------- measurements


def engine_busy_seconds(dispatcher: Any) -> float | None:
    """The engine's cumulative busy seconds (prefill + decode), found on the dispatcher service."""
    for path in ("engine", "loop.engine", "engine_loop.engine", "_engine", "_loop.engine"):
        obj = dispatcher
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
            if obj is None:
                break
        busy = getattr(obj, "busy_seconds", None) if obj is not None else None
        if isinstance(busy, (int, float)):
            return float(busy)
    return None


def _metric_snapshot(st: Stack) -> dict[str, float | None]:
    """The dispatcher's cumulative figures now: batch sizes, flushes by reason, engine busy seconds, upstream limit."""
    if st.dispatcher_metrics is not None:
        samples = read_metrics(st.dispatcher_metrics)
        busy = matching(samples, "switchyard_engine_busy_seconds_total")
        return {
            "batch_sum": total(samples, "switchyard_batch_size_sum"),
            "batch_count": total(samples, "switchyard_batch_size_count"),
            "flush_size": total(samples, "switchyard_flushes_total", reason="size"),
            "flush_interval": total(samples, "switchyard_flushes_total", reason="interval"),
            "busy": sum(busy.values()) if busy else None,
            "upstream_limit": total(samples, "switchyard_upstream_concurrency_limit") or None,
        }
    names = {
        "batch_sum": ("switchyard_batch_size_sum", {}),
        "batch_count": ("switchyard_batch_size_count", {}),
        "flush_size": ("switchyard_flushes_total", {"reason": "size"}),
        "flush_interval": ("switchyard_flushes_total", {"reason": "interval"}),
    }
    snapshot: dict[str, float | None] = {
        key: REGISTRY.get_sample_value(name, labels) or 0.0 for key, (name, labels) in names.items()
    }
    limiter = getattr(st.dispatcher, "limit", None)
    snapshot["busy"] = engine_busy_seconds(st.dispatcher)
    snapshot["upstream_limit"] = None if limiter is None else limiter.limit
    return snapshot


def summarize(
    scenario: Scenario, load: LoadResult, busy_s: float | None, gpu_util: float | None, metrics: dict[str, float]
) -> dict[str, Any]:
    """One scenario's row: units are seconds, ratios 0-1, calls/s and tokens/s."""
    ok = [r for r in load.results if not r.error]
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    waits: dict[str, list[float]] = {}
    for r in ok:
        for queue, wait in r.queue_wait_s.items():
            waits.setdefault(queue, []).append(wait)
    batches = metrics["batch_count"]
    return {
        "scenario": scenario.key,
        "label": scenario.label,
        "overrides": scenario.overrides,
        "count": len(load.results),
        "errors": len(load.results) - len(ok),
        "wall_s": load.wall_s,
        "rps": len(load.results) / load.wall_s if load.wall_s else 0.0,
        "tokens_per_s": sum(r.tokens for r in ok) / load.wall_s if load.wall_s else 0.0,
        "engine_busy_ratio": None if busy_s is None else min(busy_s / load.wall_s, 1.0),
        "gpu_util": gpu_util,
        "batch_size_mean": metrics["batch_sum"] / batches if batches else None,
        "flushes": {"size": int(metrics["flush_size"]), "interval": int(metrics["flush_interval"])},
        "queue_wait_s": {q: {"mean": sum(w) / len(w), "p95": percentile(w, 95)} for q, w in sorted(waits.items())},
        "latency_s": {f"p{p}": percentile(lat, p) for p in (50, 95, 99)},
        "ttft_s": {f"p{p}": percentile(ttft, p) for p in (50, 95)},
        "by_priority": _by_priority(ok),
        "client_cpu_saturation": load.cpu_saturation,
    }


def _by_priority(ok: list[Any]) -> dict[str, dict[str, float | None]]:
    """P95 latency and TTFT (seconds) per priority class: what the scheduler trades between classes."""
    out: dict[str, dict[str, float | None]] = {}
    for cls in sorted({r.priority for r in ok}):
        rows = [r for r in ok if r.priority == cls]
        ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
        out[cls] = {"count": len(rows), "latency_p95": percentile([r.latency_s for r in rows], 95),
                    "ttft_p95": percentile(ttft, 95) if ttft else None}
    return out


async def run_scenario(scenario: Scenario, base: SwitchyardConfig, plan: LoadPlan, retrieval_addr: str,
                       warmup: int, client: str, processes: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start a stack with the scenario's overrides, warm it up, run the plan; returns (row, ghz report)."""
    config = base.with_overrides(**scenario.overrides)
    in_process = client == "thread"
    async with stack(config, retrieval_addr, scenario.batching, processes) as st:
        run_plan = replace(plan, host=st.host, procs=1 if in_process else plan.procs)
        if warmup:
            warm = replace(run_plan, total=warmup, concurrency=min(warmup, 4), rps=0, duration_s=0, procs=1)
            await asyncio.to_thread(run_load, warm, True)
        before = await asyncio.to_thread(_metric_snapshot, st)
        with GpuSampler() as gpu:
            load = await asyncio.to_thread(run_load, run_plan, in_process)
        after = await asyncio.to_thread(_metric_snapshot, st)
    delta = {k: after[k] - before[k] for k in ("batch_sum", "batch_count", "flush_size", "flush_interval")}
    busy = None if before["busy"] is None or after["busy"] is None else after["busy"] - before["busy"]
    row = summarize(scenario, load, busy, gpu.mean(), delta)
    row["stack"] = "processes" if processes else "in-process"
    row["decode_bound_tokens_per_s"] = decode_bound_tokens_per_s(config, plan.concurrency)
    limit = after["upstream_limit"]
    row["upstream_concurrency_limit"] = None if limit is None else round(limit, 1)
    row["roofline_efficiency"] = roofline_efficiency(row)
    return row, build_report(load, run_plan, name=f"switchyard bench compare {scenario.key}")


# --------------------------------------------------------------------------- output


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _per_busy_second(row: dict[str, Any]) -> float | None:
    busy = row["engine_busy_ratio"]
    return row["tokens_per_s"] / busy if busy else None


def decode_bound_tokens_per_s(config: SwitchyardConfig, largest_batch: int) -> float | None:
    """The sim model's decode bound at its largest batch, tokens per second: ``B / decode_seconds(B)``.

    ``largest_batch``: the most sequences the run can have running at once (its
    concurrency). None for other engines (no model of their bound).
    """
    if config.dispatcher.engine != "sim" or largest_batch < 1:
        return None
    from switchyard.dispatcher.engines.sim import decode_seconds

    return largest_batch / decode_seconds(config.sim, largest_batch)


def roofline_efficiency(row: dict[str, Any]) -> float | None:
    """Tokens per busy second / the engine model's decode bound (a model-bandwidth-utilisation figure, 0-1).

    The busy ratio says the engine was working (nvidia-smi's GPU-Util); this says how much of what the
    hardware could produce that work yielded.
    """
    per_busy, bound = _per_busy_second(row), row.get("decode_bound_tokens_per_s")
    return per_busy / bound if per_busy is not None and bound else None


TABLE_HEADER = (
    "| scenario | engine busy | GPU util | batch | orch wait P95 | infer wait P95 | P50 | P95 | P99 "
    "| TTFT P50 | TTFT P95 | core P95 | core TTFT P95 | batch P95 | rps | tokens/s | tokens per busy s "
    "| roofline eff. | errors |"
)


def _class(row: dict[str, Any], cls: str, key: str) -> float | None:
    return row.get("by_priority", {}).get(cls, {}).get(key)


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (times in ms, ratios in %)."""
    lines = [TABLE_HEADER, "|" + "---|" * (TABLE_HEADER.count("|") - 1)]
    for r in rows:
        qw = r["queue_wait_s"]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['scenario']} {r['label']}",
                    _fmt(r["engine_busy_ratio"], 100, 1, " %"),
                    _fmt(r["gpu_util"], 100, 1, " %"),
                    _fmt(r["batch_size_mean"], 1, 1),
                    _fmt(qw.get("orchestration", {}).get("p95"), 1000, 1),
                    _fmt(qw.get("inference", {}).get("p95"), 1000, 1),
                    _fmt(r["latency_s"]["p50"], 1000, 0),
                    _fmt(r["latency_s"]["p95"], 1000, 0),
                    _fmt(r["latency_s"]["p99"], 1000, 0),
                    _fmt(r["ttft_s"]["p50"], 1000, 0),
                    _fmt(r["ttft_s"]["p95"], 1000, 0),
                    _fmt(_class(r, "CORE", "latency_p95"), 1000, 0),
                    _fmt(_class(r, "CORE", "ttft_p95"), 1000, 0),
                    _fmt(_class(r, "BATCH", "latency_p95"), 1000, 0),
                    f"{r['rps']:.1f}",
                    f"{r['tokens_per_s']:.0f}",
                    _fmt(_per_busy_second(r), 1, 0),
                    _fmt(roofline_efficiency(r), 1, 2),
                    str(r["errors"]),
                ]
            )
            + " |"
        )
    lines.append("")
    lines.append(
        "Times in ms; waits and TTFT as the tasks' final events report them; batch = mean requests per flush; "
        "tokens per busy s = tokens/s / engine busy ratio (tokens per second of engine time); "
        "roofline eff. = tokens per busy s / the sim model's decode bound at the run's largest batch "
        "(its concurrency C: C / decode_seconds(C))."
    )
    return "\n".join(lines)


def write_outputs(out: Path, rows: list[dict[str, Any]], reports: dict[str, dict[str, Any]],
                  meta: dict[str, Any]) -> list[Path]:
    """compare.json, compare.md, compare.png and one ghz report per scenario; returns the paths."""
    from switchyard_harness.bench.plot import plot_comparison

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, report in reports.items():
        path = out / f"scenario-{key}.json"
        path.write_text(json_output.dumps(report, indent=2), encoding="utf-8")
        paths.append(path)
    summary = out / "compare.json"
    summary.write_text(json_output.dumps({"meta": meta, "scenarios": rows}, indent=2), encoding="utf-8")
    markdown = out / "compare.md"
    markdown.write_text(
        f"Command: `{meta['command']}`\n\nMachine: {meta['machine']}\n\n{table(rows)}\n", encoding="utf-8"
    )
    png = plot_comparison(rows, out / "compare.png", subtitle=f"{meta['command']}\n{meta['machine']}")
    return [summary, markdown, png, *paths]


def machine_description() -> str:
    import os

    from switchyard_harness.bench.gpu import GpuSampler

    with GpuSampler() as gpu:
        has_gpu = gpu.available
    return (
        f"{os.cpu_count()} CPU cores, {platform.machine()}, Python {platform.python_version()}, "
        f"{'NVIDIA GPU present' if has_gpu else 'no GPU'}"
    )


# --------------------------------------------------------------------------- command


async def compare(args: argparse.Namespace, plan: LoadPlan, base: SwitchyardConfig) -> list[dict[str, Any]]:
    scenarios = pick_scenarios(args.scenarios)
    retrieving = any(item.get("task_type", "") in RETRIEVING_WORKFLOWS for item in plan.calldata)
    needs_retrieval = {"on": True, "off": False, "auto": retrieving}[args.retrieval]
    rows: list[dict[str, Any]] = []
    reports: dict[str, dict[str, Any]] = {}
    processes = args.stack == "processes"
    with contextlib.ExitStack() as owned:
        # The scenarios' own DRAM tier (--dram) and task store, then --set again (it wins): never the default
        # 127.0.0.1:6379 and data/tasks.sqlite3, which a stack that switchyard up runs here owns.
        tier, dram = _dram_tier(args.dram, base.memory.dram, owned)
        store_dir = owned.enter_context(tempfile.TemporaryDirectory(prefix="bench-compare-tasks-"))
        base = base.with_overrides(**{**own_tier_overrides(tier, store_dir), **parse_settings(args.settings)})
        print(f"DRAM tier of the stacks: {dram}", flush=True)
        await _run_scenarios(scenarios, base, plan, needs_retrieval, processes, args, rows, reports)
    meta = {
        "command": "switchyard bench compare " + " ".join(args.argv),
        "machine": machine_description(),
        "engine": base.dispatcher.engine,
        "plan": {k: v for k, v in dataclasses.asdict(plan).items() if k != "calldata"}
        | {"calldata_items": len(plan.calldata)},
        "retrieval": needs_retrieval,
        "dram": dram,
        "stack": args.stack,
        "settings": parse_settings(args.settings),
    }
    print()
    print(table(rows))
    out = Path(args.out)
    paths = write_outputs(out, rows, reports, meta)
    print("\nwritten: " + ", ".join(str(p) for p in paths[:3]) + f" and {len(paths) - 3} scenario reports")
    return rows


async def _run_scenarios(scenarios: list[Scenario], base: SwitchyardConfig, plan: LoadPlan, needs_retrieval: bool,
                         processes: bool, args: argparse.Namespace, rows: list[dict[str, Any]],
                         reports: dict[str, dict[str, Any]]) -> None:
    """Each scenario on a fresh stack, one after another (retrieval shared); appends to ``rows`` and ``reports``."""
    async with shared_retrieval(base, needs_retrieval, processes) as retrieval_addr:
        for scenario in scenarios:
            t0 = time.monotonic()
            print(f"[{scenario.key}] {scenario.label} ...", flush=True)
            row, report = await run_scenario(scenario, base, plan, retrieval_addr, args.warmup, args.client, processes)
            rows.append(row)
            reports[scenario.key] = report
            print(f"[{scenario.key}] done in {time.monotonic() - t0:.1f} s: {row['count']} calls, "
                  f"{row['errors']} errors, P95 {_fmt(row['latency_s']['p95'], 1000, 0)} ms", flush=True)


def main(argv: list[str]) -> int:
    """``switchyard bench compare [OPTIONS]``; returns 0 when every scenario completed."""
    from switchyard_harness.bench.cli import add_load_options, parse_load_args, resolve_plan

    parser = argparse.ArgumentParser(
        prog="switchyard bench compare",
        description="Run scenarios A (baseline), B (split + double buffer), C10/C20/C50 (fixed flush) and "
        "D (adaptive flush) on the same request set, each against a fresh stack.",
    )
    add_load_options(parser)
    parser.add_argument("--scenarios", default="all", help="comma list of A,B,C10,C20,C50,D (default all)")
    parser.add_argument("--out", default="bench-results", help="output folder (default bench-results/)")
    parser.add_argument("--warmup", type=int, default=8, help="calls per scenario before measuring (default 8)")
    parser.add_argument("--config-dir", help="config folder (default $SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--engine", choices=["sim", "openai", "torch"], help="override dispatcher.engine")
    parser.add_argument("--retrieval", choices=["auto", "on", "off"], default="auto",
                        help="start retrieval (auto: when the call data has rag_answer or react_loop tasks)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every scenario, a key as docs/configuration.md names it, e.g. "
                        "--set policy=fifo or --set flush.max_batch_size=16 (JSON values; "
                        "switchyard_harness.bench.settings)")
    parser.add_argument("--stack", choices=["processes", "in-process"], default="processes",
                        help="each service in its own process, as deployed (default), or all three on this "
                        "process's event loop (quicker to start)")
    parser.add_argument("--dram", type=_dram_arg, default="off",
                        help="the stacks' DRAM tier: off (default: no agent memory, no KV swap, nothing asks a "
                        "Redis, as the earlier runs), embedded (a private redis-server) or HOST:PORT")
    parser.add_argument("--client", choices=["process", "thread"], default="process",
                        help="load generator in a child process (default) or a thread (quick smoke runs)")
    args = parse_load_args(parser, argv, "compare")
    args.argv = argv
    if args.warmup < 0:  # -1 started the first scenario's stack and ended in a ValueError traceback ("total must be
        parser.error(f"--warmup: expected a count of calls >= 0 (0: none), got {args.warmup}")  # >= 1 (got -1)")
    if problem := outputs.unwritable(Path(args.out) / "compare.json"):  # now, not after the run
        parser.error(f"--out: expected a folder that can be made or written ({problem})")
    if args.data is None and args.data_file is None and args.config is None:
        args.data_file = "ghz/data/mixed.json"
    defaults = {"total": 300, "concurrency": 32, "rps": 30.0}
    for key, value in defaults.items():
        if getattr(args, key) is None and args.config is None:
            setattr(args, key, value)
    try:
        pick_scenarios(args.scenarios)
        base = load_config(args.config_dir)
        if args.engine:
            base = base.with_overrides(**{"dispatcher.engine": args.engine})
        if args.settings:
            base = base.with_overrides(**parse_settings(args.settings))
    except (ConfigError, ValueError) as exc:
        print(f"switchyard bench compare: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"switchyard bench compare: --set: no config section {exc}", file=sys.stderr)
        return 2
    plan = resolve_plan(args, "127.0.0.1:50051")  # a stand-in: each scenario's run takes its own stack's address
    logging.basicConfig(level=logging.WARNING)
    import uvloop

    try:
        rows = uvloop.run(compare(args, plan, base))
    except (RuntimeError, OSError, ConfigError, SwitchyardError) as exc:  # e.g. no index: the message says the fix
        print(f"switchyard bench compare: {exc}", file=sys.stderr)
        return 1
    return 0 if rows and all(r["count"] for r in rows) else 1
