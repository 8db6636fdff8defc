"""deploy/prometheus: the generated rule file is current, valid, and every alert has a unit test."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import yaml

from prom_tools import require
from switchyard.common.config import ConfigError, SwitchyardConfig, TtftSloConfig, load_config

pytestmark = pytest.mark.no_gpu

REPO = Path(__file__).resolve().parents[1]
PROM = REPO / "deploy" / "prometheus"
RULES = PROM / "switchyard-rules.yaml"
TESTS = sorted((PROM / "tests").glob("*.yaml"))


def _load_generator():
    spec = importlib.util.spec_from_file_location("deploy_prometheus_rules", PROM / "rules.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


rules = _load_generator()


def test_rule_file_is_generated_from_the_current_config() -> None:
    expected = rules.render(load_config(REPO / "config").slo.ttft)
    assert RULES.read_text() == expected, (
        "deploy/prometheus/switchyard-rules.yaml is stale: run python deploy/prometheus/rules.py")


def test_burn_thresholds_follow_the_configured_objective() -> None:
    # 99.9 %: the workbook's 14.4 x 0.001 for the 1h/5m page, 1 x 0.001 for the 3d/6h ticket.
    text = rules.render(TtftSloConfig(objective=0.999, threshold_s=0.5, priority_classes=["core"]))
    assert "ratio_rate1h > 0.0144" in text and "ratio_rate3d > 0.001\n" in text
    assert 'le="0.5", priority_class=~"core"' in text


def test_an_slo_threshold_that_is_no_bucket_bound_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"slo\.ttft\.threshold_s.*0\.3.*bucket bounds"):
        SwitchyardConfig().with_overrides(**{"slo.ttft.threshold_s": 0.3})


def test_promtool_check_rules_accepts_the_rule_file() -> None:
    out = subprocess.run([require("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_shipped_prometheus_config_scrapes_a_local_stack_on_the_configs_ports() -> None:
    """deploy/prometheus/prometheus.yml is what an operator points Prometheus at for `switchyard up`: promtool
    accepts it, it loads the rule file beside it, and each service is one job on its configured metrics port
    (the alerts match series on job and instance). There was none: every operator wrote one."""
    shipped = PROM / "prometheus.yml"
    out = subprocess.run([require("promtool"), "check", "config", str(shipped)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    config = yaml.safe_load(shipped.read_text())
    assert [(PROM / f).resolve() for f in config["rule_files"]] == [RULES.resolve()]
    cfg = load_config(REPO / "config")
    host = "127.0.0.1" if cfg.server.host in ("0.0.0.0", "::", "") else cfg.server.host
    jobs = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
            for job in config["scrape_configs"]}
    assert jobs == {"orchestrator": [f"{host}:{cfg.orchestrator.metrics_port}"],
                    "retrieval": [f"{host}:{cfg.retrieval.metrics_port}"],
                    "dispatcher": [f"{host}:{cfg.dispatcher.metrics_port}"]}


def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run([require("promtool"), "test", "rules", *map(str, TESTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_unit_test_that_expects_it_to_fire() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    fired = {
        case["alertname"]
        for path in TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts and alerts <= fired, f"alerts without a firing unit test: {sorted(alerts - fired)}"


# ---------------------------------------------------------------------------- staleness audit

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800, "y": 31_536_000}


def _seconds(duration: str) -> float:
    """A Prometheus duration ("90m", "1h30m", "15s") in seconds."""
    import re

    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), f"not a duration: {duration!r}"
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _samples(values: str) -> tuple[int, bool]:
    """(samples, ends stale) of a promtool ``values`` string: ``a+bxN`` and ``axN`` are N+1 samples,
    ``_xN`` N missing ones, ``_``, ``stale`` and a plain number one each (promtool's expanding notation)."""
    import re

    tokens = values.split()
    count = 0
    for token in tokens:
        missing = re.fullmatch(r"_x(\d+)", token)
        series = re.fullmatch(r"[^x]+x(\d+)", token)
        if missing:
            count += int(missing.group(1))
        elif series:
            count += int(series.group(1)) + 1
        else:
            count += 1
    return count, bool(tokens) and tokens[-1] == "stale"


def inputs_ending_early(document: dict) -> list[str]:
    """Input series of a promtool test file whose samples stop before the test's last evaluation
    without an explicit ``stale`` marker: such a series silently stays visible for the 5-minute
    lookback and then vanishes, so the test checks a scrape that stopped, not what it says."""
    default = _seconds(document.get("evaluation_interval", "1m"))
    problems = []
    for number, test in enumerate(document["tests"], 1):
        interval = _seconds(test["interval"]) if "interval" in test else default
        evals = [_seconds(c["eval_time"]) for key in ("alert_rule_test", "promql_expr_test")
                 for c in test.get(key, [])]
        last_eval = max(evals, default=0.0)
        for series in test.get("input_series", []):
            count, stale = _samples(str(series["values"]))
            ends = (count - 1) * interval
            if ends < last_eval and not stale:
                problems.append(f"test {number}: {series['series']} ends at {ends / 60:g}m, before its last "
                                f"evaluation at {last_eval / 60:g}m, with no stale marker")
    return problems


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_every_alert_tests_input_reaches_its_evaluation_time_or_ends_stale(path) -> None:
    assert inputs_ending_early(yaml.safe_load(path.read_text())) == []


def test_the_audit_finds_a_series_that_stops_early_and_accepts_an_explicit_stale_marker() -> None:
    def document(values: str, eval_time: str = "30m") -> dict:
        return {"tests": [{"interval": "1m", "input_series": [{"series": "up", "values": values}],
                           "alert_rule_test": [{"eval_time": eval_time, "alertname": "X"}]}]}

    assert len(inputs_ending_early(document("1x5"))) == 1  # 0..5m, evaluated at 30m
    assert len(inputs_ending_early(document("0+1x29"))) == 1  # ends at 29m
    assert inputs_ending_early(document("0+1x30")) == []
    assert inputs_ending_early(document("1x5 stale")) == []
    assert inputs_ending_early(document("1 2 _x28 3")) == []  # 31 samples: 0..30m
    assert len(inputs_ending_early(document("1x30", eval_time="1h"))) == 1
