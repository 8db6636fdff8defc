"""``switchyard bench agents`` end to end on a small load (simulated clock, embedded redis-server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard.bench import agents_bench

pytestmark = pytest.mark.no_gpu

# 30 agents on a 40 GB device: a 20 GB KV budget against a working set of about 30 GB, so eviction must act
SMALL = ["--agents", "30", "--seconds", "4", "--hbm-gb", "40", "--answer-tokens", "32-64", "--json"]


def test_agents_bench_evicts_to_dram_and_restores_without_failing_a_task(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "agents.json"
    assert agents_bench.main([*SMALL, "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == report and out.with_suffix(".png").stat().st_size > 0
    assert report["oom"] == 0 and sum(report["tasks_failed"].values()) == 0
    assert sum(report["tasks_completed"].values()) > 0
    assert report["tiers"]["hbm"]["evictions"] > 0, "the budget was meant to force eviction"
    assert report["tiers"]["hbm"]["demotions"] > 0 and report["tiers"]["dram"]["promotions"] > 0
    assert report["tool_resumes"]["restored_share"] >= 0.9
    assert report["restored_tokens"] > 0 and report["recomputed_tokens"] == 0
    assert 0 <= report["fragmentation_ratio"]["mean"] <= report["fragmentation_ratio"]["max"] <= 1


def test_without_a_dram_tier_evicted_prefixes_are_recomputed(capsys: pytest.CaptureFixture[str]) -> None:
    assert agents_bench.main([*SMALL, "--dram", "off"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["oom"] == 0 and sum(report["tasks_failed"].values()) == 0
    assert report["restored_tokens"] == 0 and report["recomputed_tokens"] > 0
    assert report["tool_resumes"]["restored"] == 0


def test_agents_bench_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit):
        agents_bench.main(["--think", "0.5-0.1"])
    with pytest.raises(SystemExit):
        agents_bench.main(["--dram", "nowhere"])
    assert agents_bench.main(["--agents", "0"]) == 2
