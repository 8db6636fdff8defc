"""``switchyard bench pool`` (:mod:`switchyard_harness.bench.pool`): a small run end to end, over three
real ``sim-openai`` replicas. Its pick recorder wraps ``EndpointPool.pick`` and must take every argument
the gateway passes (the model among them): a narrower signature failed the first
call with a TypeError."""

from __future__ import annotations

import json

import pytest

from switchyard_harness.bench import pool

pytestmark = pytest.mark.no_gpu


def test_small_run_places_every_call_and_survives_the_kill(tmp_path, capsys):
    out = tmp_path / "pool.json"
    argv = ["--agents", "6", "--groups", "2", "--turns", "2", "--rounds", "1", "--json", str(out)]
    assert pool.main(argv) == 0
    data = json.loads(out.read_text())
    for phase in ("score", "round_robin", "killed"):
        result = data[phase]
        assert result["calls"] == 6 * 2, phase
        assert result["picks"] >= result["calls"], phase
        assert not result["errors"] or phase == "killed", (phase, result["errors"])
    assert data["killed"]["failed_before_token"] == 0
    assert "affinity hit" in capsys.readouterr().out

