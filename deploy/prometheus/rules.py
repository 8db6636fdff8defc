"""Generate Switchyard's Prometheus rules: recording rules for the dashboard's heavy
queries and the SLO, and the alerts an operator is paged or ticketed for.

    python deploy/prometheus/rules.py            # rewrite deploy/prometheus/switchyard-rules.yaml
    python deploy/prometheus/rules.py --check    # exit 1 when the file is out of date

The TTFT objective comes from config (``switchyard.json`` ``slo.ttft``:
threshold_s, objective, period_days, priority_classes), so changing the SLO is
a config change followed by this script. ``promtool check rules`` and
``promtool test rules deploy/prometheus/tests/*.yaml`` check the output; the
unit tests assume the repository's default SLO (1 s, 99 %, 30 days).

Rule names follow Prometheus' recording-rule convention ``level:metric:operations``
(prometheus.io/docs/practices/rules). Every aggregation keeps ``namespace`` so
one Prometheus can watch several deployments; a local stack has no
``namespace`` label and its series aggregate under the empty value.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "switchyard-rules.yaml"

# Multi-window, multi-burn-rate alerts: Google SRE workbook, "Alerting on SLOs",
# section 6 (table 5-8): (share of the period's error budget spent, long window,
# short window, severity). The burn rate is share x period / long window: 14.4,
# 6, 3 and 1 for a 30-day period.
BURN_WINDOWS: tuple[tuple[float, str, str, str], ...] = (
    (0.02, "1h", "5m", "page"),
    (0.05, "6h", "30m", "page"),
    (0.10, "1d", "2h", "ticket"),
    (0.10, "3d", "6h", "ticket"),
)
_HOURS = {"m": 1 / 60, "h": 1, "d": 24}


def _hours(window: str) -> float:
    return float(window[:-1]) * _HOURS[window[-1]]


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client writes the ``le`` label (1 -> "1.0", 0.5 -> "0.5")."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


def sli_rule(window: str) -> str:
    """Name of the recorded TTFT error ratio (bad first tokens / all) over ``window``."""
    return f"namespace_priority_class:switchyard_ttft_slo_errors:ratio_rate{window}"


def recording_rules(slo: Any) -> list[dict[str, str]]:
    """Recording rules: the SLI at every burn window, then the dashboard's heavy queries.

    ``slo`` is a :class:`switchyard.common.config.TtftSloConfig`.
    """
    classes = "|".join(slo.priority_classes)
    le = _le(slo.threshold_s)
    windows = sorted({w for _, long_w, short_w, _ in BURN_WINDOWS for w in (long_w, short_w)}, key=_hours)
    rules = []
    for window in windows:
        rules.append({
            "record": sli_rule(window),
            "expr": (
                "1 - (\n"
                f"  sum by (namespace, priority_class) (rate(switchyard_ttft_seconds_bucket"
                f'{{le="{le}", priority_class=~"{classes}"}}[{window}]))\n'
                "  /\n"
                f"  sum by (namespace, priority_class) (rate(switchyard_ttft_seconds_count"
                f'{{priority_class=~"{classes}"}}[{window}]))\n'
                ")"
            ),
        })
    by_class = "namespace, priority_class, le"
    rules += [
        {"record": "namespace_priority_class_le:switchyard_ttft_seconds_bucket:rate1m",
         "expr": f"sum by ({by_class}) (rate(switchyard_ttft_seconds_bucket[1m]))"},
        {"record": "namespace_priority_class_le:switchyard_inter_token_latency_seconds_bucket:rate1m",
         "expr": f"sum by ({by_class}) (rate(switchyard_inter_token_latency_seconds_bucket[1m]))"},
        {"record": "namespace_queue_le:switchyard_queue_wait_seconds_bucket:rate1m",
         "expr": "sum by (namespace, queue, le) (rate(switchyard_queue_wait_seconds_bucket[1m]))"},
        {"record": "namespace_le:switchyard_task_compute_score_used_bucket:rate5m",
         "expr": "sum by (namespace, le) (rate(switchyard_task_compute_score_used_bucket[5m]))"},
        {"record": "namespace_le:switchyard_task_memory_peak_bytes_bucket:rate5m",
         "expr": "sum by (namespace, le) (rate(switchyard_task_memory_peak_bytes_bucket[5m]))"},
        # Roofline efficiency: tokens per busy second / the engine model's decode bound
        # (engines without a model of their bound export 0 and are left out).
        {"record": "instance:switchyard_engine_roofline_efficiency:ratio_rate1m",
         "expr": (
             "rate(switchyard_generated_tokens_total[1m])\n"
             "  / rate(switchyard_engine_busy_seconds_total[1m])\n"
             "  / (switchyard_engine_decode_bound_tokens_per_second > 0)"
         )},
        {"record": "instance_queue:switchyard_queue_saturation:ratio",
         "expr": "switchyard_queue_depth / switchyard_queue_capacity"},
    ]
    return rules


def slo_alerts(slo: Any) -> list[dict[str, Any]]:
    """The TTFT burn-rate alerts: one page (fast burn) and one ticket (slow burn)."""
    budget = 1 - slo.objective
    period_h = slo.period_days * 24
    alerts = []
    for severity, name, what in (("page", "SwitchyardTTFTBudgetBurnFast", "fast"),
                                 ("ticket", "SwitchyardTTFTBudgetBurnSlow", "slow")):
        clauses = []
        for share, long_w, short_w, sev in BURN_WINDOWS:
            if sev != severity:
                continue
            threshold = round(share * period_h / _hours(long_w) * budget, 10)
            clauses.append(
                f"(\n  {sli_rule(long_w)} > {threshold:g}\n  and\n  {sli_rule(short_w)} > {threshold:g}\n)"
            )
        alerts.append({
            "alert": name,
            "expr": "\nor\n".join(clauses),
            "labels": {"severity": severity},
            "annotations": {
                "summary": (f"TTFT error budget burning {what} for {{{{ $labels.priority_class }}}} work "
                            "in {{ $labels.namespace }}"),
                "description": (
                    f"Objective: {slo.objective:.2%} of first tokens within {slo.threshold_s:g} s over "
                    f"{slo.period_days} days (switchyard.json slo.ttft). "
                    "{{ $value | humanizePercentage }} of first tokens are slower now, which spends the error "
                    f"budget too {what}. Multi-window, multi-burn-rate alert (Google SRE workbook, Alerting on SLOs)."
                ),
            },
        })
    return alerts


def other_alerts() -> list[dict[str, Any]]:
    """Saturation, a stuck autoscaling signal, an upstream circuit left open or failing, no ready dispatcher."""
    return [
        {
            "alert": "SwitchyardQueueSaturated",
            "expr": "instance_queue:switchyard_queue_saturation:ratio > 0.8",
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Queue {{ $labels.queue }} of {{ $labels.instance }} is over 80 % full",
                "description": (
                    "Queue depth / capacity (queue.json queues.<name>.capacity) has stayed above 0.8 for "
                    "5 minutes ({{ $value | humanizePercentage }}); a full queue refuses with "
                    "RESOURCE_EXHAUSTED. Add replicas or workers for the resource this queue waits on."
                ),
            },
        },
        {
            "alert": "SwitchyardQueueRejecting",
            "expr": 'sum by (namespace, instance, queue) (rate(switchyard_queue_rejected_total{reason="full"}[5m])) > 0',
            "for": "5m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "Queue {{ $labels.queue }} of {{ $labels.instance }} refuses work: it is full",
                "description": (
                    "{{ $value | humanize }} items per second have been rejected with RESOURCE_EXHAUSTED "
                    "for 5 minutes because the queue was at capacity."
                ),
            },
        },
        {
            "alert": "SwitchyardAutoscalingSignalStuck",
            "expr": (
                "(\n"
                "  changes(switchyard_compute_score[15m]) == 0\n"
                "  and on (job, instance) switchyard_compute_score offset 15m\n"
                "  and on (job, instance) rate(switchyard_generated_tokens_total[15m]) > 0\n"
                ")\nor\n(\n"
                "  changes(switchyard_agents_concurrent[15m]) == 0\n"
                "  and on (job, instance) switchyard_agents_concurrent offset 15m\n"
                "  and on (job, instance) switchyard_agents_concurrent > 0\n"
                "  and on (job, instance) sum by (job, instance) (rate(switchyard_tasks_total[15m])) > 0\n"
                ")"
            ),
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "An autoscaling signal of {{ $labels.instance }} has not changed for 20 minutes",
                "description": (
                    "The HPA scales on gpu_compute_score (switchyard_compute_score) and "
                    "agent_concurrent_count (switchyard_agents_concurrent). This one has held one value for "
                    "20 minutes while the instance generated tokens or finished tasks: the reading is stuck "
                    "(NVML, the score sampler, or a leaked in-flight count), and the HPA is scaling on a "
                    "frozen number."
                ),
            },
        },
        {
            "alert": "SwitchyardAutoscalingSignalAbsent",
            "expr": (
                "label_replace(absent_over_time(switchyard_compute_score[10m]), "
                '"signal", "gpu_compute_score", "", "")\n'
                "or\n"
                "label_replace(absent_over_time(switchyard_agents_concurrent[10m]), "
                '"signal", "agent_concurrent_count", "", "")\n'
                "or\n"
                "label_replace(\n"
                '  count by (namespace) (switchyard_service_info{service="dispatcher"})\n'
                "  unless on (namespace) count by (namespace) (count_over_time(switchyard_compute_score[10m])),\n"
                '  "signal", "gpu_compute_score", "", "")\n'
                "or\n"
                "label_replace(\n"
                '  count by (namespace) (switchyard_service_info{service="orchestrator"})\n'
                "  unless on (namespace) count by (namespace) (count_over_time(switchyard_agents_concurrent[10m])),\n"
                '  "signal", "agent_concurrent_count", "", "")'
            ),
            "for": "5m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "The autoscaling signal {{ $labels.signal }} is absent{{ with $labels.namespace }} in {{ . }}{{ end }}",
                "description": (
                    "No sample of the series behind the HPA's {{ $labels.signal }} (gpu_compute_score: "
                    "switchyard_compute_score of the dispatchers; agent_concurrent_count: "
                    "switchyard_agents_concurrent of the orchestrators) for 15 minutes, while the service that "
                    "exports it is scraped or nothing is: the HPA cannot read its metric and holds the replica "
                    "count where it is. Check the scrape (ServiceMonitor/PodMonitor) and prometheus-adapter's rules."
                ),
            },
        },
        {
            "alert": "SwitchyardUpstreamCircuitOpen",
            "expr": (
                "max by (namespace, instance, model) "
                '(avg_over_time(switchyard_gateway_circuit_state{state="open"}[10m])) >= 0.9'
            ),
            "for": "1m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "The circuit of upstream model {{ $labels.model }} has been left open on {{ $labels.instance }}",
                "description": (
                    "The gateway's circuit breaker (model_gateway.cooldown) has kept {{ $labels.model }} open "
                    "{{ $value | humanizePercentage }} of the last 10 minutes: each trial after cooldown_s failed "
                    "again, so its requests go to the fallback model or fail. `switchyard doctor` checks the "
                    "base URL, key, model id and proxies."
                ),
            },
        },
        {
            "alert": "SwitchyardUpstreamFailing",
            "expr": (
                # CANCELLED: the caller went away (its deadline, a cancelled task); INVALID_ARGUMENT: the upstream
                # refused the request's own body (a prompt past the context window, a bad field: BadUpstreamRequest,
                # which no other model is asked); NOT_FOUND of model "other" (no model the configuration names:
                # gateway/models.model_label): the client named a model no server serves. None says anything of
                # the model: such calls count neither way, as the circuit breaker does not count them
                # (gateway/cooldown.py). NOT_FOUND of a configured model (one the upstream does not serve) counts.
                "sum by (namespace, instance, model) (\n"
                '  rate(switchyard_gateway_requests_total{outcome!~"ok|CANCELLED|INVALID_ARGUMENT|NOT_FOUND"}[5m])\n'
                '  or rate(switchyard_gateway_requests_total{outcome="NOT_FOUND", model!="other"}[5m])\n'
                ")\n"
                "  /\n"
                "sum by (namespace, instance, model) (\n"
                '  rate(switchyard_gateway_requests_total{outcome!~"CANCELLED|INVALID_ARGUMENT|NOT_FOUND"}[5m])\n'
                '  or rate(switchyard_gateway_requests_total{outcome="NOT_FOUND", model!="other"}[5m])\n'
                ")\n"
                "> 0.5"
            ),
            "for": "10m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "Upstream model {{ $labels.model }} fails most calls from {{ $labels.instance }}",
                "description": (
                    "{{ $value | humanizePercentage }} of chat completions sent to {{ $labels.model }} have "
                    "failed for 10 minutes without its circuit staying open (failures interleaved with "
                    "successes, or model_gateway.cooldown disabled); switchyard_gateway_requests_total by outcome, "
                    "calls their caller cancelled, requests the upstream refused as malformed (INVALID_ARGUMENT) "
                    "and requests naming a model no server serves (NOT_FOUND of model other) left out."
                ),
            },
        },
        {
            "alert": "SwitchyardTaskStoreDown",
            "expr": "max by (namespace, instance) (switchyard_task_store_up) == 0",
            "for": "1m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "The task store of orchestrator {{ $labels.instance }} has not answered for a minute",
                "description": (
                    "switchyard_task_store_up has read 0 for a minute: SubmitTask, GetTaskStatus and CancelTask "
                    "answer UNAVAILABLE (HTTP 503) naming the store, while RunTask runs on and readiness stays "
                    "SERVING (a shared Redis's outage is every replica's, so no replica is taken out for it). "
                    "Tasks already accepted run on and are recorded once it answers. Check the Redis of "
                    "memory_policy.toml [dram] (orchestrator.task_store.backend redis), or the disk of the "
                    "SQLite file."
                ),
            },
        },
        {
            "alert": "SwitchyardDispatcherNoReadyReplica",
            "expr": (
                'count by (namespace) (switchyard_service_info{service=~"orchestrator|retrieval"})\n'
                'unless on (namespace)\n'
                'sum by (namespace) (switchyard_serving{service="dispatcher"}) > 0'
            ),
            "for": "2m",
            "labels": {"severity": "page"},
            "annotations": {
                "summary": "No dispatcher replica is ready in {{ $labels.namespace }}",
                "description": (
                    "Orchestrator or retrieval replicas are scraped but no dispatcher reports SERVING "
                    "(switchyard_serving{service=\"dispatcher\"}): every replica is down, unscraped or "
                    "draining. Every task that needs the model fails UNAVAILABLE naming the dispatcher."
                ),
            },
        },
    ]


def build(slo: Any) -> dict[str, Any]:
    """The whole rule file as a dict: groups ``switchyard-recording`` and ``switchyard-alerts``."""
    return {
        "groups": [
            {"name": "switchyard-recording", "rules": recording_rules(slo)},
            {"name": "switchyard-alerts", "rules": slo_alerts(slo) + other_alerts()},
        ]
    }


class _Block(str):
    """A multi-line string written in YAML's literal block style."""


def _represent(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(str, _represent)


def render(slo: Any) -> str:
    """The rule file's text: a header naming its source, then the YAML."""
    header = (
        "# Generated by deploy/prometheus/rules.py from config/switchyard.json (slo.ttft); do not edit.\n"
        "# Check: promtool check rules deploy/prometheus/switchyard-rules.yaml\n"
        "# Test:  promtool test rules deploy/prometheus/tests/*.yaml\n"
    )
    return header + yaml.dump(build(slo), Dumper=_Dumper, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is out of date")
    parser.add_argument("--config-dir", default=str(ROOT / "config"), help="config folder (default: config/)")
    args = parser.parse_args(argv)
    from switchyard.common.config import load_config

    from switchyard.common.generated import write_or_check

    text = render(load_config(args.config_dir).slo.ttft)
    return write_or_check(OUT, text, check=args.check, root=ROOT, command="python deploy/prometheus/rules.py")


if __name__ == "__main__":
    sys.exit(main())
