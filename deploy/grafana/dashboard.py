"""Generate Switchyard's Grafana dashboard with Grafana's foundation SDK.

    python deploy/grafana/dashboard.py            # rewrite deploy/grafana/switchyard.json
    python deploy/grafana/dashboard.py --check    # exit 1 when the file is out of date

Import ``switchyard.json`` into Grafana (Dashboards > New > Import) and pick a
Prometheus data source that scrapes the three services. Rows: engine, queues,
latency, work, tasks, services, memory. Template variables: ``datasource``,
``namespace`` and ``instance`` (both multi-select, "All" = every value).

The memory row holds the memory tiers (bytes and traffic per tier), the device
memory kept outside running work and the DRAM tier (Redis) the orchestrators use.

Panels over per-instance series (gauges, counters) honour both ``namespace``
and ``instance``. The quantile panels read the recording rules of
``deploy/prometheus/switchyard-rules.yaml`` (bucket rates summed per namespace,
so a quantile is the fleet's, not an average of replicas'), and honour
``namespace`` only. Per-call figures (compute score used, memory peak of each model call a task made) are
histograms: quantiles and a heatmap, never one series per call.

Units are Grafana's: ``s`` (seconds), ``bytes`` (IEC), ``percentunit`` (0-1
shown as %), ``ops`` (per second), ``short``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from switchyard.common.generated import write_or_check

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "switchyard.json"
UID = "switchyard-operator"

DATASOURCE = models.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace=~"$namespace", instance=~"$instance"'
"""Selector of the per-instance panels."""
NS = 'namespace=~"$namespace"'
"""Selector of the panels over recorded per-namespace aggregates."""
RATE = "$__rate_interval"
QUANTILES = ((0.5, "P50"), (0.95, "P95"), (0.99, "P99"))


def _target(expr: str, legend: str, fmt: PromQueryFormat | None = None) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)
    return query.format(fmt) if fmt is not None else query


def _series(title: str, description: str, unit: str, targets: list[tuple[str, str]], width: int = 12,
            max_value: float | None = None) -> timeseries.Panel:
    panel = (
        timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
        .span(width).height(8).min(0).fill_opacity(10).line_width(1)
        .legend(common_builder.VizLegendOptions().display_mode(common.LegendDisplayMode.TABLE)
                .placement(common.LegendPlacement.BOTTOM).show_legend(True).calcs(["lastNotNull", "max"]))
        .tooltip(common_builder.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                 .sort(common.SortOrder.DESCENDING))
    )
    if max_value is not None:
        panel = panel.max(max_value)
    for expr, legend in targets:
        panel = panel.with_target(_target(expr, legend))
    return panel


def _quantiles(recorded: str, by: str, legend: str) -> list[tuple[str, str]]:
    """P50/P95/P99 over a recorded bucket-rate series, grouped by ``by``."""
    group = f"{by}, le" if by else "le"
    return [(f"histogram_quantile({q}, sum by ({group}) ({recorded}{{{NS}}}))", f"{legend}{name}")
            for q, name in QUANTILES]


def _per_service(expr_of: str) -> str:
    """``expr_of`` (per target) joined with switchyard_service_info to carry a ``service`` label."""
    return f"{expr_of} * on (job, instance) group_left (service) switchyard_service_info{{{SEL}}}"


def _heatmap(title: str, description: str, unit: str, bucket: str) -> heatmap.Panel:
    """A heatmap of Prometheus buckets, its options set explicitly.

    The SDK's heatmap builder leaves ``options`` None unless an option is set
    (``unit`` goes to fieldConfig), and serialises it as ``"options": null``,
    which Grafana's heatmap cannot open (grafana-foundation-sdk's known failure).
    """
    expr = f"sum by (le) (rate({bucket}{{{SEL}}}[{RATE}]))"
    return (
        heatmap.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
        .span(12).height(8).with_target(_target(expr, "{{le}}", PromQueryFormat.HEATMAP))
        .calculate(False)  # Prometheus already bucketed the data
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        .color(heatmap.HeatmapColorOptions().mode(hm.HeatmapColorMode.SCHEME).scheme("Oranges").fill("dark-orange")
               .scale(hm.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64).reverse(False))
        .y_axis(heatmap.YAxisConfig().unit(unit).axis_placement(common.AxisPlacement.LEFT))
        .cell_gap(1).show_value(common.VisibilityMode.AUTO).show_legend().show_tooltip()
    )


def rows() -> list[tuple[str, list]]:
    """The dashboard's rows: (title, panels), in order."""
    engine = [
        _series("GPU utilisation and compute score",
                "NVML GPU and memory-bandwidth utilisation (0-1) and the compute score the scheduler admits by "
                "(0-100 scale, drawn / 100: the HPA's gpu_compute_score, target 60).", "percentunit",
                [(f"switchyard_gpu_utilization_ratio{{{SEL}}}", "GPU util {{instance}}"),
                 (f"switchyard_gpu_memory_utilization_ratio{{{SEL}}}", "memory util {{instance}}")], width=12)
        .with_target(_target(f"switchyard_compute_score{{{SEL}}} / 100", "compute score / 100 {{instance}}")),
        _series("Engine busy ratio and roofline efficiency",
                "Busy: share of wall time the engine ran prefill or decode (what nvidia-smi's GPU-Util shows). "
                "Roofline efficiency: tokens per busy second / the engine model's decode bound at "
                "flush.max_batch_size (how much of what the hardware could produce the work yielded; "
                "sim engine only).", "percentunit",
                [(f"switchyard_engine_busy_ratio{{{SEL}}}", "busy {{instance}}"),
                 (f"instance:switchyard_engine_roofline_efficiency:ratio_rate1m{{{SEL}}}",
                  "roofline efficiency {{instance}}")]),
    ]
    queues = [
        _series("Queue depth", "Items waiting in each queue (orchestration, retrieval, inference; submitted: the "
                "SubmitTask tasks an orchestrator holds, queued and running).", "short",
                [(f"sum by (queue) (switchyard_queue_depth{{{SEL}}})", "{{queue}}")], width=8),
        _series("Queue saturation", "Depth / capacity per queue and instance; SwitchyardQueueSaturated fires "
                "above 0.8 for 5 minutes.", "percentunit",
                [(f"max by (queue) (instance_queue:switchyard_queue_saturation:ratio{{{SEL}}})", "{{queue}}")],
                width=8),
        _series("Queue wait", "Time an item waited in each queue, every wait: taken by a worker (or the scheduler), "
                "expired in the queue (timeout_ms or its deadline) or left by its caller (the outcome label, "
                "summed); submitted: a SubmitTask task's wait in the backlog until it starts.", "s",
                _quantiles("namespace_queue_le:switchyard_queue_wait_seconds_bucket:rate1m", "queue",
                           "{{queue}} "), width=8),
        _series("Batch size", "Requests per batch flushed from the double buffer: mean and P95.", "short",
                [(f"sum(rate(switchyard_batch_size_sum{{{SEL}}}[{RATE}])) / "
                  f"sum(rate(switchyard_batch_size_count{{{SEL}}}[{RATE}]))", "mean"),
                 (f"histogram_quantile(0.95, sum by (le) (rate(switchyard_batch_size_bucket{{{SEL}}}[{RATE}])))",
                  "P95")]),
        _series("Flushes by reason", "Double-buffer flushes per second: size (buffer full), interval "
                "(flush_interval_ms ran out), idle (an idle engine took work at once), drain.", "ops",
                [(f"sum by (reason) (rate(switchyard_flushes_total{{{SEL}}}[{RATE}]))", "{{reason}}")]),
    ]
    latency = [
        _series("TTFT by priority class", "Generate received -> first token, per priority class.", "s",
                _quantiles("namespace_priority_class_le:switchyard_ttft_seconds_bucket:rate1m", "priority_class",
                           "{{priority_class}} "), width=8),
        _series("Inter-token latency by priority class", "Time between consecutive tokens of one sequence.", "s",
                _quantiles("namespace_priority_class_le:switchyard_inter_token_latency_seconds_bucket:rate1m",
                           "priority_class", "{{priority_class}} "), width=8),
        _series("TTFT SLO error ratio", "Share of first tokens slower than the SLO threshold (switchyard.json "
                "slo.ttft), over 5 minutes and 1 hour: the burn-rate alerts' inputs.", "percentunit",
                [(f"namespace_priority_class:switchyard_ttft_slo_errors:ratio_rate5m{{{NS}}}",
                  "{{priority_class}} 5m"),
                 (f"namespace_priority_class:switchyard_ttft_slo_errors:ratio_rate1h{{{NS}}}",
                  "{{priority_class}} 1h")], width=8),
    ]
    work = [
        _series("Running and waiting by priority class", "Sequences holding a running slot on the engine, and "
                "sequences waiting for admission.", "short",
                [(f"sum by (priority_class) (switchyard_running_agents{{{SEL}}})", "running {{priority_class}}"),
                 (f"sum by (priority_class) (switchyard_waiting_agents{{{SEL}}})", "waiting {{priority_class}}")],
                width=8),
        _series("Preemptions by victim class", "Running sequences sent back to the queue per second: preempted for "
                "waiting core work, or refused by their upstream for load (429) before their first token.",
                "ops", [(f"sum by (priority_class) (rate(switchyard_preemptions_total{{{SEL}}}[{RATE}]))",
                         "{{priority_class}}")], width=8),
        _series("Tasks in flight", "Tasks accepted and not finished (the HPA's agent_concurrent_count, target "
                "20 per replica).", "short",
                [(f"switchyard_agents_concurrent{{{SEL}}}", "{{instance}}")], width=8),
    ]
    tasks = [
        _series("Per-call compute score used", "Compute score x seconds each model call (a dispatcher request) "
                "consumed while running (score-seconds), as quantiles over calls finished in the last 5 minutes; a "
                "task's is the sum of its calls'.", "short",
                _quantiles("namespace_le:switchyard_task_compute_score_used_bucket:rate5m", "", "")),
        _series("Per-call memory peak", "Peak KV / prefix-state bytes of each model call (a dispatcher request), "
                "as quantiles over calls finished in the last 5 minutes; a task's is the largest of its calls'.",
                "bytes",
                _quantiles("namespace_le:switchyard_task_memory_peak_bytes_bucket:rate5m", "", "")),
        _heatmap("Per-call compute score used (distribution)", "Model calls per second in each score-seconds bucket.",
                 "short", "switchyard_task_compute_score_used_bucket"),
        _heatmap("Per-call memory peak (distribution)", "Model calls per second in each memory-peak bucket.", "bytes",
                 "switchyard_task_memory_peak_bytes_bucket"),
    ]
    services = [
        _series("CPU throttling", "Seconds per second the container's threads were held back because it used "
                "its whole CPU quota (cgroup cpu.stat throttled_usec / throttled_time), per service; 0 without a "
                "quota.", "s",
                [(_per_service(f"rate(switchyard_cpu_throttled_seconds_total{{{SEL}}}[{RATE}])"),
                  "{{service}} {{instance}}")], width=8),
        _series("Event-loop lag P99", "How much later than asked each service's event loop woke: time it was "
                "blocked by CPU work.", "s",
                [("histogram_quantile(0.99, sum by (service, le) ("
                  + _per_service(f"rate(switchyard_event_loop_lag_seconds_bucket{{{SEL}}}[{RATE}])") + "))",
                  "{{service}}")], width=8),
        _series("Ready replicas", "Replicas whose gRPC health check answers SERVING, per service "
                "(orchestrator-http: whose /readyz answers 200); "
                "SwitchyardDispatcherNoReadyReplica fires at 0 dispatchers.", "short",
                [(f"sum by (service) (switchyard_serving{{{SEL}}})", "{{service}}")], width=8),
    ]
    memory = [
        _series("Bytes per memory tier", "KV state held in each tier (hbm, dram, cold), per dispatcher.", "bytes",
                [(f"sum by (tier) (switchyard_tier_bytes{{{SEL}}})", "{{tier}}")]),
        _series("Memory-tier traffic", "Per second, per tier: lookups that found KV state (hits) or not (misses), "
                "evictions, promotions and demotions; KV allocations a tier move saved (OOMs avoided) and OOMs.",
                "ops",
                [(f"sum by (tier) (rate(switchyard_tier_{kind}_total{{{SEL}}}[{RATE}]))", f"{{{{tier}}}} {kind}")
                 for kind in ("hits", "misses", "evictions", "promotions", "demotions")]
                + [(f"sum(rate(switchyard_kv_oom_avoided_total{{{SEL}}}[{RATE}]))", "OOMs avoided"),
                   (f"sum(rate(switchyard_kv_oom_total{{{SEL}}}[{RATE}]))", "OOMs")]),
        _series("Device memory held outside running work", "Prefix-cache blocks and the prefix state of agents "
                "parked on a tool call (both evicted first when running work needs room).", "bytes",
                [(f"sum by (instance) (switchyard_prefix_cache_bytes{{{SEL}}})", "prefix cache {{instance}}"),
                 (f"sum by (instance) (switchyard_parked_kv_bytes{{{SEL}}})", "parked agents {{instance}}")]),
        _series("Parked agents", "react_loop agents waiting on a tool with their prefix state kept warm.", "short",
                [(f"sum by (instance) (switchyard_parked_agents{{{SEL}}})", "{{instance}}")]),
        _series("DRAM tier (Redis)", "1 while the DRAM tier's Redis answers each orchestrator (agent memory), and "
                "while its task store answers (the redis task store, or the SQLite file: SubmitTask, GetTaskStatus "
                "and CancelTask need it); outages and operations that went on without the tier, per second.", "short",
                [(f"switchyard_dram_up{{{SEL}}}", "up {{instance}}"),
                 (f"switchyard_task_store_up{{{SEL}}}", "task store up {{instance}}"),
                 (f"sum by (instance) (rate(switchyard_dram_outages_total{{{SEL}}}[{RATE}]))", "outages/s {{instance}}"),
                 (f"sum by (instance) (rate(switchyard_dram_degraded_operations_total{{{SEL}}}[{RATE}]))",
                  "degraded ops/s {{instance}}")]),
        _series("Agent memory recalls by outcome", "Tasks with an agent_id by what their memory gave: hit, miss "
                "(none, or the DRAM tier was down), dropped (left out to fit the context window), per second.", "ops",
                [(f"sum by (outcome) (rate(switchyard_agent_memory_recalls_total{{{SEL}}}[{RATE}]))", "{{outcome}}")]),
    ]
    return [("Engine", engine), ("Queues", queues), ("Latency", latency), ("Work", work),
            ("Tasks", tasks), ("Services", services), ("Memory", memory)]


def _multi_variable(name: str, query: str) -> dash.QueryVariable:
    """A multi-select query variable over label values, "All" selected by default."""
    return (
        dash.QueryVariable(name).label(name).datasource(DATASOURCE).query(query)
        .refresh(models.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(models.VariableSort.ALPHABETICAL_ASC)
        .multi(True).include_all(True).all_value(".*")
        .current(models.VariableOption(selected=True, text="All", value="$__all"))
    )


def _variables() -> list:
    ns = _multi_variable("namespace", "label_values(switchyard_service_info, namespace)")
    inst = _multi_variable("instance", 'label_values(switchyard_service_info{namespace=~"$namespace"}, instance)')
    source = dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
    return [source, ns, inst]


def build() -> dict:
    """The dashboard as Grafana's JSON model (a dict)."""
    builder = (
        dash.Dashboard("Switchyard").uid(UID).tags(["switchyard"]).refresh("30s").time("now-1h", "now")
        .timezone("browser").editable().tooltip(models.DashboardCursorSync.CROSSHAIR)
        .description("Switchyard's three services: engine, queues, latency, work, per-task use, services and "
                     "memory. Generated by deploy/grafana/dashboard.py; do not edit by hand.")
        .variables(_variables())
    )
    next_id = 1
    for title, panels in rows():
        builder = builder.with_row(dash.Row(title).id(next_id))
        next_id += 1
        for panel in panels:
            builder = builder.with_panel(panel.id(next_id))
            next_id += 1
    model = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    for panel in model["panels"]:  # Grafana tells a panel's queries apart by refId: A, B, C...
        for index, target in enumerate(panel.get("targets", [])):
            target["refId"] = chr(ord("A") + index)
    if found := nulls(model):
        raise ValueError(f"the dashboard would hold null at {', '.join(found)}: set those fields explicitly "
                         "(Grafana fails on a null where it expects an object)")
    return model


def nulls(node: object, path: str = "$") -> list[str]:
    """JSON paths (``$.panels[20].options``) of every null in ``node``, a decoded JSON value."""
    if node is None:
        return [path]
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in nulls(value, f"{path}.{key}")]
    if isinstance(node, list):
        return [p for index, value in enumerate(node) for p in nulls(value, f"{path}[{index}]")]
    return []


def render() -> str:
    """The JSON text written to ``deploy/grafana/switchyard.json``."""
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def expressions(model: dict) -> list[tuple[str, str]]:
    """Every ``(panel title, PromQL expression)`` of a dashboard model, rows included."""
    found = []
    for panel in model.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                if target.get("expr"):
                    found.append((inner.get("title", ""), target["expr"]))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is out of date")
    args = parser.parse_args(argv)
    return write_or_check(OUT, render(), check=args.check, root=ROOT, command="python deploy/grafana/dashboard.py")


if __name__ == "__main__":
    sys.exit(main())
