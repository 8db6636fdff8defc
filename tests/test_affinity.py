"""Agent affinity: consistent hashing with bounded loads (the routing simulation that uses it: tests/harness/test_route_bench.py)."""

from __future__ import annotations

import math

import pytest

from switchyard.common.affinity import BoundedLoadRing

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



async def test_a_name_resolves_to_each_replica_once_v6_in_brackets():
    """The dispatcher replicas and the model server pool resolve their names with one helper
    (common/dns.py): an address the resolver answers for more than one socket type is one replica."""
    from switchyard.common.dns import resolve_addresses

    addresses = await resolve_addresses("localhost", 50999)
    assert addresses == sorted(set(addresses)) and addresses
    assert set(addresses) <= {"127.0.0.1:50999", "[::1]:50999"}
    assert await resolve_addresses("127.0.0.1", 80) == ["127.0.0.1:80"]

def test_a_hot_key_spills_its_overflow_to_the_next_replica_and_comes_home():
    replicas = REPLICAS[:3]
    ring = BoundedLoadRing(replicas, balance=1.25)
    for i in range(6):
        ring.assign(f"cold-{i}")
    home = ring.assign("hot")
    spill_order = [r for r in ring.walk("hot") if r != home]
    in_flight = {r: 0 for r in replicas}
    placed = []
    for _ in range(30):  # 30 calls of one agent at once
        replica, at_home = ring.route("hot", in_flight)
        assert at_home == (replica == home)
        in_flight[replica] += 1
        placed.append(replica)
    assert max(in_flight.values()) / (30 / 3) <= 1.25
    assert in_flight[home] == max(in_flight.values()), "home keeps as much as the bound allows"
    assert placed[0] == home
    first_spill = next(r for r in placed if r != home)
    assert first_spill == spill_order[0], "the overflow goes to the next replica on the ring"
    again = BoundedLoadRing(replicas, balance=1.25)  # deterministic: same ring, same calls, same placement
    for i in range(6):
        again.assign(f"cold-{i}")
    again.assign("hot")
    flights = {r: 0 for r in replicas}
    replay = []
    for _ in range(30):
        replica, _home = again.route("hot", flights)
        flights[replica] += 1
        replay.append(replica)
    assert replay == placed
    for replica in replicas:  # the load drops: the next call goes home again
        in_flight[replica] = 0
    assert ring.route("hot", in_flight) == (home, True)
    assert ring.placed["hot"] == home, "spilling never moved the agent's home"


def test_keys_with_one_call_each_never_spill():
    ring = BoundedLoadRing(REPLICAS[:3], balance=1.2)
    agents = [f"agent-{i}" for i in range(24)]
    homes = {agent: ring.assign(agent) for agent in agents}
    in_flight = {r: 0 for r in REPLICAS[:3]}
    for agent in reversed(agents):  # any order of arrival: one call per agent stays home
        replica, at_home = ring.route(agent, in_flight)
        assert at_home and replica == homes[agent]
        in_flight[replica] += 1


def test_the_load_bound_has_one_default_for_replicas_and_endpoints():
    from switchyard.common.affinity import DEFAULT_BALANCE
    from switchyard.common.config import AffinityConfig, UpstreamPoolConfig

    assert AffinityConfig().balance == UpstreamPoolConfig().balance == BoundedLoadRing().balance == DEFAULT_BALANCE


def test_a_key_is_one_record_its_replica_and_last_use_together():
    """A placed key's replica and its last use are one record: using it renews both, expiring or removing its
    replica drops both, and the loads count what is placed."""
    ring = BoundedLoadRing(["r1", "r2", "r3"])
    homes = {key: ring.assign(key, now=float(i)) for i, key in enumerate("abcdef")}
    assert ring.placed == homes and list(ring.placed) == list("abcdef")
    assert ring.assign("a", now=10.0) == homes["a"] and list(ring.placed)[-1] == "a"  # used last: expires last
    assert ring.expire(now=15.5, idle_s=10.0) == 5 and ring.placed == {"a": homes["a"]}
    ring.remove(homes["a"])
    assert ring.placed == {} and sum(ring.loads.values()) == 0
