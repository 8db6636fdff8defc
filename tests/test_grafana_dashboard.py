"""deploy/grafana: the committed dashboard is what the generator builds, with the rows, variables and
queries an operator needs; its recorded series exist in the rule file."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.no_gpu

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "deploy" / "grafana"
RULES = REPO / "deploy" / "prometheus" / "switchyard-rules.yaml"

spec = importlib.util.spec_from_file_location("deploy_grafana_dashboard", GRAFANA / "dashboard.py")
dashboard = importlib.util.module_from_spec(spec)
assert spec.loader is not None
spec.loader.exec_module(dashboard)

MODEL = json.loads((GRAFANA / "switchyard.json").read_text())


def test_committed_json_is_what_the_generator_builds() -> None:
    assert (GRAFANA / "switchyard.json").read_text() == dashboard.render(), (
        "deploy/grafana/switchyard.json is stale: run python deploy/grafana/dashboard.py")


def test_rows_are_the_operators_view_in_order() -> None:
    rows = [p["title"] for p in MODEL["panels"] if p["type"] == "row"]
    assert rows == ["Engine", "Queues", "Latency", "Work", "Tasks", "Services", "Memory"]


def test_namespace_and_instance_variables_select_every_per_instance_query() -> None:
    variables = {v["name"]: v for v in MODEL["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("namespace", "instance"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    for title, expr in dashboard.expressions(MODEL):
        assert 'namespace=~"$namespace"' in expr, f"{title}: {expr}"
        raw = re.findall(r"\b(switchyard_[a-z_]+)\{([^}]*)\}", expr)  # raw series, not recorded ones
        for metric, selector in raw:
            assert 'instance=~"$instance"' in selector, f"{title}: {metric} ignores $instance"


def test_panels_have_unique_ids_and_each_query_its_own_ref_id() -> None:
    ids = [p["id"] for p in MODEL["panels"]]
    assert len(ids) == len(set(ids))
    for panel in MODEL["panels"]:
        refs = [t["refId"] for t in panel.get("targets", [])]
        assert len(refs) == len(set(refs)) and all(refs), panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_recorded_series_the_dashboard_reads_are_in_the_rule_file() -> None:
    recorded = {r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r}
    used = {m for _, expr in dashboard.expressions(MODEL) for m in re.findall(r"\b[a-z_]+:[a-z_]+:[a-z0-9_]+\b", expr)}
    assert used and used <= recorded, sorted(used - recorded)


def test_per_call_figures_are_histograms_never_a_series_per_task() -> None:
    exprs = [e for t, e in dashboard.expressions(MODEL) if t.startswith("Per-call")]
    assert len(exprs) >= 4 and all("_bucket" in e for e in exprs)
    assert not any(re.search(r"task_id|agent_id", e) for _, e in dashboard.expressions(MODEL))


def test_no_field_anywhere_in_the_dashboard_is_null() -> None:
    assert dashboard.nulls(MODEL) == []  # the heatmaps' "options": null was Grafana's known failure


def test_every_heatmap_sets_its_options_and_the_generator_refuses_a_null() -> None:
    heatmaps = [p for p in MODEL["panels"] if p["type"] == "heatmap"]
    assert len(heatmaps) == 2
    for panel in heatmaps:
        assert panel["options"]["calculate"] is False and panel["options"]["yAxis"]["unit"] == panel["fieldConfig"]["defaults"]["unit"]
    assert dashboard.nulls({"panels": [{"options": None, "targets": [{"expr": "up"}, None]}]}) == [
        "$.panels[0].options", "$.panels[0].targets[1]"]
