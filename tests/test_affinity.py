"""Agent affinity: consistent hashing with bounded loads, and the routing simulation that uses it."""

from __future__ import annotations

import json
import math

import pytest

from switchyard.bench import route
from switchyard.orchestrator.affinity import BoundedLoadRing

pytestmark = pytest.mark.no_gpu

REPLICAS = [f"10.0.0.{i}:50053" for i in range(20)]


def test_placement_is_sticky_and_bounded():
    ring = BoundedLoadRing(REPLICAS, balance=1.1)
    agents = [f"agent-{i}" for i in range(2000)]
    placed = {agent: ring.assign(agent) for agent in agents}
    assert all(ring.assign(agent) == placed[agent] for agent in agents), "an active agent stays where it is"
    mean = len(agents) / len(REPLICAS)
    assert max(ring.loads.values()) <= 1.1 * mean
    assert sum(ring.loads.values()) == len(agents)
    # without the bound, the same ring is as uneven as its arcs
    plain = BoundedLoadRing(REPLICAS, balance=1e9)
    for agent in agents:
        plain.assign(agent)
    assert max(plain.loads.values()) > 1.1 * mean
    spilled = sum(placed[agent] != ring.preferred(agent) for agent in agents)
    assert 0 < spilled < len(agents) / 4, "most agents sit on their preferred replica"


def test_a_leaving_replica_moves_only_its_agents():
    ring = BoundedLoadRing(REPLICAS)
    agents = [f"agent-{i}" for i in range(2000)]
    before = {agent: ring.assign(agent) for agent in agents}
    preferred = {agent: ring.preferred(agent) for agent in agents}
    leaving = REPLICAS[3]
    moved = set(ring.remove(leaving))
    assert moved == {agent for agent, where in before.items() if where == leaving}
    after = {agent: ring.assign(agent) for agent in agents}
    assert {agent for agent in agents if after[agent] != before[agent]} == moved
    assert leaving not in after.values()
    changed = sum(ring.preferred(agent) != preferred[agent] for agent in agents) / len(agents)
    assert changed <= 1.5 / len(REPLICAS)
    ring.add(leaving)  # joining again moves nobody: placement is sticky
    assert all(ring.assign(agent) == after[agent] for agent in agents)


def test_idle_agents_expire_and_exclusion_moves_an_agent():
    ring = BoundedLoadRing(REPLICAS[:3])
    first = ring.assign("a", now=0.0)
    ring.assign("b", now=5.0)
    assert ring.expire(now=8.0, idle_s=5.0) == 1 and "a" not in ring.placed and "b" in ring.placed
    where = ring.assign("b", now=9.0)
    other = ring.assign("b", now=9.0, exclude=frozenset({where}))
    assert other != where and ring.placed["b"] == other and sum(ring.loads.values()) == 1
    with pytest.raises(LookupError):
        ring.assign("c", exclude=frozenset(REPLICAS[:3]))
    assert first in REPLICAS[:3]
    with pytest.raises(ValueError, match="balance"):
        BoundedLoadRing(REPLICAS, balance=1.0)


def test_capacity_rounds_down_where_it_leaves_room():
    ring = BoundedLoadRing(REPLICAS[:4], balance=1.25)
    assert ring.capacity() == 1  # 1 agent over 4 replicas: ceil wins
    for i in range(99):
        ring.assign(f"agent-{i}")
    assert ring.capacity() == math.floor(1.25 * 100 / 4) == 31


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


def test_replica_targets_parse():
    from switchyard.orchestrator.replicas import _dns_host_port, static_addresses

    assert static_addresses("ipv4:127.0.0.1:5001,127.0.0.1:5002") == ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert static_addresses("dispatcher:50053") == ["dispatcher:50053"]
    assert static_addresses("dns:///dispatcher:50053") is None
    assert _dns_host_port("dns:///dispatcher.prod.svc.cluster.local:50053") == ("dispatcher.prod.svc.cluster.local", 50053)
    assert _dns_host_port("dns://10.96.0.10:53/dispatcher:50053") == ("dispatcher", 50053)
    with pytest.raises(ValueError, match="dns:///NAME:PORT"):
        _dns_host_port("dns:///dispatcher")


async def test_dns_target_resolves_to_replicas():
    from switchyard.common.config import ServerConfig
    from switchyard.orchestrator.replicas import ReplicaSet

    replicas = ReplicaSet("dns:///localhost:50999", ServerConfig(), idle_s=60, resolve_interval_s=10, balance=1.2)
    try:
        await replicas.refresh()
        assert "127.0.0.1:50999" in replicas.channels or "[::1]:50999" in replicas.channels
        address, _ = replicas.pick("agent-1")
        assert replicas.pick("agent-1")[0] == address
    finally:
        await replicas.close()
