"""``switchyard bench route``: the discrete-event simulation of agent routing over many replicas
(:mod:`switchyard_harness.bench.route`), which drives the product's ring
(:class:`switchyard.common.affinity.BoundedLoadRing`, tested in tests/test_affinity.py)."""

from __future__ import annotations

import json

import pytest

from switchyard_harness.bench import route

pytestmark = pytest.mark.no_gpu


def test_simulation_affinity_beats_per_call_routing(tmp_path):
    params = ["--replicas", "20", "--agents", "1000", "--duration", "90", "--warmup", "20"]
    out, png = tmp_path / "route.json", tmp_path / "route.png"
    assert route.main([*params, "--json", str(out), "--plot", str(png)]) == 0
    data = json.loads(out.read_text())
    results = data["results"]
    assert set(results) == set(route.POLICIES)
    affinity = results["affinity"]
    assert affinity["hit_rate"] >= 0.9
    assert affinity["moved_times_n"] <= 1.5
    for other in ("random", "round_robin"):
        assert results[other]["hit_rate"] < 0.2  # about 1/N: each call may land anywhere
        assert results[other]["recomputed_tokens"] > 5 * affinity["recomputed_tokens"]
    assert affinity["load_ratio_mean"] < results["consistent"]["load_ratio_mean"], "the bound evens the load"
    assert png.stat().st_size > 10_000


def test_simulation_is_deterministic_and_checks_its_parameters():
    params = route.RouteParams(replicas=5, agents=100, duration_s=40, warmup_s=5)
    a, b = route.simulate("affinity", params), route.simulate("affinity", params)
    assert a.summary(5) == b.summary(5)
    with pytest.raises(ValueError, match="replicas"):
        route.simulate("affinity", route.RouteParams(replicas=1))


def test_skewed_simulation_bounds_calls_in_flight():
    params = route.SkewParams(duration_s=60, warmup_s=10)
    bounded = route.simulate_skew("in_flight_bound", params)
    placed = route.simulate_skew("placed_bound", params)
    assert bounded.in_flight_ratio_mean <= 1.25
    assert placed.in_flight_ratio_mean > 2.0, "bounding agents placed leaves one agent's calls on one replica"
    assert bounded.placed_ratio_mean == placed.placed_ratio_mean
    assert bounded.hit_rate > 0.4 and placed.hit_rate == 1.0
    with pytest.raises(ValueError, match="hot_share"):
        route.simulate_skew("in_flight_bound", route.SkewParams(hot_share=1.5))


def test_values_out_of_range_are_refused_naming_the_flag_never_a_traceback(capsys, tmp_path) -> None:
    """--balance nan/inf were ValueError and OverflowError tracebacks, --vnodes 0 the ring's ValueError past the
    parser, --zipf nan random's; --duration inf simulated forever."""
    outputs = ["--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    for argv, words in (
        (["--balance", "nan"], "balance: expected a finite number > 1, got nan"),
        (["--balance", "inf"], "balance: expected a finite number > 1, got inf"),
        (["--vnodes", "0"], "vnodes: expected at least 1, got 0"),
        (["--duration", "inf"], "duration: expected a finite number of seconds > 0, got inf"),
        (["--zipf", "nan"], "zipf_s: expected a finite exponent >= 0, got nan"),
        (["--skew-rate", "inf"], "rate: expected a finite number of calls/s > 0, got inf"),
    ):
        with pytest.raises(SystemExit) as caught:
            route.main(["--replicas", "4", "--agents", "10", *argv, *outputs])
        assert caught.value.code == 2 and words in capsys.readouterr().err, argv
    assert not (tmp_path / "r.json").exists()
