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
