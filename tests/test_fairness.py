"""Attained service with decay, tenant weights and the order key (switchyard.dispatcher.scheduler.fairness)."""

from __future__ import annotations

import math

import pytest

from switchyard.dispatcher.scheduler.fairness import AttainedService, FairnessLedger


def test_service_halves_after_one_half_life():
    service = AttainedService(half_life_s=10.0)
    service.charge("s1", 1000, now=0.0)
    assert service.service("s1", 0.0) == 1000
    assert service.service("s1", 10.0) == pytest.approx(500)
    assert service.service("s1", 20.0) == pytest.approx(250)
    service.charge("s1", 100, now=10.0)
    assert service.service("s1", 10.0) == pytest.approx(600)
    assert service.service("never", 5.0) == 0.0


def test_no_decay_is_cumulative_service():
    service = AttainedService(half_life_s=math.inf)
    service.charge("s", 10, 0.0)
    service.charge("s", 5, 1e6)
    assert service.service("s", 1e9) == 15


def test_bounded_memory_drops_least_recently_charged():
    service = AttainedService(half_life_s=60.0, max_tracked=2)
    service.charge("a", 1, 0.0)
    service.charge("b", 1, 0.0)
    service.charge("a", 1, 1.0)
    service.charge("c", 1, 2.0)
    assert len(service) == 2
    assert service.service("b", 2.0) == 0.0
    assert service.service("a", 2.0) > 0


@pytest.mark.parametrize("kwargs, field", [({"half_life_s": 0}, "half_life_s"),
                                           ({"half_life_s": 1, "max_tracked": 0}, "max_tracked")])
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AttainedService(**kwargs)


def test_negative_charge_is_refused():
    with pytest.raises(ValueError, match="tokens"):
        AttainedService(1.0).charge("a", -1, 0.0)


def test_tenant_service_orders_before_session_and_arrival():
    ledger = FairnessLedger(half_life_s=60.0)
    ledger.charge("noisy-agent-1", "noisy", 5000, 0.0)
    ledger.charge("quiet-agent", "quiet", 100, 0.0)
    ledger.charge("quiet-agent-2", "quiet", 3000, 0.0)
    keys = {
        "noisy new session": ledger.order_key("noisy-agent-2", "noisy", arrival=0.0, now=1.0),
        "quiet busy session": ledger.order_key("quiet-agent-2", "quiet", arrival=5.0, now=1.0),
        "quiet light session": ledger.order_key("quiet-agent", "quiet", arrival=9.0, now=1.0),
    }
    order = sorted(keys, key=keys.__getitem__)
    # the quiet tenant (3100 tokens) goes before the noisy one (5000) whatever the arrivals; inside the
    # quiet tenant, the session that received less goes first (PLAS)
    assert order == ["quiet light session", "quiet busy session", "noisy new session"]


def test_equal_service_falls_back_to_arrival():
    ledger = FairnessLedger(half_life_s=60.0)
    assert ledger.order_key("a", "t", 1.0, 0.0) < ledger.order_key("b", "t", 2.0, 0.0)


def test_tenant_weight_divides_its_service():
    ledger = FairnessLedger(half_life_s=60.0, tenant_weights={"gold": 2.0})
    ledger.charge("g", "gold", 1500, 0.0)
    ledger.charge("s", "silver", 1000, 0.0)
    # gold received more tokens but has twice the weight: 750 per unit against 1000
    assert ledger.order_key("g", "gold", 5.0, 0.0) < ledger.order_key("s", "silver", 0.0, 0.0)
    assert ledger.weight("silver") == 1.0


def test_decay_lets_a_past_heavy_tenant_back_in():
    ledger = FairnessLedger(half_life_s=1.0)
    ledger.charge("x", "past", 10_000, 0.0)
    ledger.charge("y", "now", 100, 20.0)
    assert ledger.tenant_share("past", 20.0) < ledger.tenant_share("now", 20.0)


def test_bad_weight_is_refused():
    with pytest.raises(ValueError, match="'bad'"):
        FairnessLedger(1.0, tenant_weights={"bad": 0})
