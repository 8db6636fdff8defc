"""A pool of upstream replicas: filter -> score -> pick, bounded-load affinity, failover before the first token.

Real sim-openai servers on 127.0.0.1 port 0: in threads where nothing is killed,
in child processes where one is SIGKILLed as a crashed replica is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

import grpc
import pytest

from switchyard.common.config import UpstreamConfig, load_config
from switchyard.gateway.client import GatewayClient
from switchyard.common.priority import PriorityClass
from switchyard.gateway.errors import GatewayError, UpstreamServerError
from switchyard.gateway.events import ChatRequest, Finished, Token
from switchyard_harness.faults import Fault
from switchyard.gateway.picker import EndpointPicker
from switchyard.dispatcher.scheduler.capacity import StreamSlots
from switchyard.gateway.pool import PoolLimit, endpoint_name, prompt_key
from switchyard.gateway.server_load import ServerLoad, parse_server_load
from switchyard_harness.sim_openai import RunningSimOpenAI, SimOpenAIOptions, SpawnedSimOpenAI, run_in_thread, spawn

from gateway_fixtures import clean_proxy_env  # noqa: F401

pytestmark = pytest.mark.no_gpu


def pool_config(urls: list[str], **pool: Any) -> UpstreamConfig:
    return UpstreamConfig.model_validate({
        "base_url": urls[0], "api_key_env": "SWITCHYARD_TEST_API_KEY", "api_key_required": False,
        "default_model": "sim-7b", "fallback_model": "", "retry_backoff_initial_s": 0.01,
        "retry_backoff_max_s": 0.02, "read_timeout_s": 10.0, "total_timeout_s": 30.0,
        "pool": {"endpoints": urls, "scrape_interval_s": 0.05, **pool},
    })


@contextlib.contextmanager
def replicas(n: int = 3, **options: Any) -> Iterator[list[RunningSimOpenAI]]:
    options.setdefault("latency", False)
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(run_in_thread(SimOpenAIOptions(**options))) for _ in range(n)]


def spawn_replicas(n: int, args: list[str]) -> list[SpawnedSimOpenAI]:
    """``n`` sim-openai processes (``switchyard serve sim-openai ARGS``), started side by side: each start is an
    interpreter's, and one after another they cost ``n`` of them."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n) as starting:
        futures = [starting.submit(spawn, args) for _ in range(n)]
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < n:  # one did not start: the others are not left running
        for proc in started:
            proc.kill()
        next(f for f in futures if f.exception() is not None).result()
    return started


def ask(agent: str, turn: int = 0, system: str = "You are terse.", **extra: Any) -> ChatRequest:
    return ChatRequest(messages=[{"role": "system", "content": system},
                                 {"role": "user", "content": f"{agent} asks question {turn}"}],
                       model="sim-7b", max_tokens=4, request_id=f"{agent}:{turn}", affinity_key=agent, **extra)


async def complete(client: GatewayClient, request: ChatRequest) -> list:
    return [event async for event in client.stream_chat(request)]


def agents_by_server(servers: list[RunningSimOpenAI]) -> dict[str, set[int]]:
    seen: dict[str, set[int]] = {}
    for index, server in enumerate(servers):
        for body in server.state.requests:
            agent = body["messages"][-1]["content"].split()[0]
            seen.setdefault(agent, set()).add(index)
    return seen


# --------------------------------------------------------------------------- what servers say of their load


def test_server_load_reads_each_servers_names():
    vllm = ('# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m",engine="0"} 3\n'
            'vllm:num_requests_waiting{model_name="m",engine="1"} 2\n'
            'vllm:num_requests_running{model_name="m"} 7\n'
            'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.5\n'
            'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.7\n')
    assert parse_server_load(vllm) == ServerLoad(waiting=5.0, running=7.0, kv_cache_usage=pytest.approx(0.6))
    older_vllm = "vllm:gpu_cache_usage_perc 0.25\nvllm:num_requests_waiting 0\n"
    assert parse_server_load(older_vllm) == ServerLoad(waiting=0.0, kv_cache_usage=0.25)
    sglang = 'sglang:num_queue_reqs{model_name="m"} 4\nsglang:num_running_reqs 2\nsglang:token_usage 0.9\n'
    assert parse_server_load(sglang) == ServerLoad(waiting=4.0, running=2.0, kv_cache_usage=0.9)
    tgi = "# TYPE tgi_queue_size gauge\ntgi_queue_size 6\ntgi_batch_current_size 12\n"
    assert parse_server_load(tgi) == ServerLoad(waiting=6.0, running=12.0)
    llamacpp = "llamacpp:requests_deferred 1\nllamacpp:requests_processing 1\nllamacpp:kv_cache_usage_ratio 1.2\n"
    assert parse_server_load(llamacpp) == ServerLoad(waiting=1.0, running=1.0, kv_cache_usage=1.0)
    assert not parse_server_load("process_cpu_seconds_total 1.5\n").known
    with pytest.raises(ValueError):
        parse_server_load("vllm:num_requests_waiting { not prometheus text\n")


def test_server_load_reads_its_figures_past_lines_it_does_not_read_and_numbers_that_are_none():
    """A line of another metric the parser cannot read costs no figure; NaN (a gauge before the server's first
    step) and infinities are no figure; a negative count is none waiting."""
    beside = ('vllm:num_requests_waiting{model_name="m"} 2\n'
              '{"vllm.some_utf8_name", model_name="m"} 1\n'  # Prometheus 3's quoted names, not read by this parser
              'this is { not prometheus text\n'
              'vllm:num_requests_running{model_name="m"} 3\n')
    assert parse_server_load(beside) == ServerLoad(waiting=2.0, running=3.0)
    assert parse_server_load("vllm:kv_cache_usage_perc NaN\nvllm:num_requests_running +Inf\n") == ServerLoad()
    mixed = 'vllm:kv_cache_usage_perc{engine="0"} NaN\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n'
    assert parse_server_load(mixed) == ServerLoad(kv_cache_usage=pytest.approx(0.4))
    assert parse_server_load("tgi_queue_size -1\n") == ServerLoad(waiting=0.0)
    # the format separates a line's tokens by spaces or tabs: a tab after an unlabelled name is read as a space is
    assert parse_server_load("vllm:num_requests_running\t3\n\t\nvllm:num_requests_waiting\t 1\n") == \
        ServerLoad(waiting=1.0, running=3.0)


async def test_sim_openai_metrics_count_waiting_streams_kv_and_prefix_hits(clean_proxy_env):
    import httpx

    options = SimOpenAIOptions(latency=True, max_running=1, kv_tokens=1000)
    with run_in_thread(options) as server:
        root = server.base_url.removesuffix("/v1")
        cfg = pool_config([server.base_url])
        long_system = " ".join(["context"] * 200)
        async with GatewayClient(cfg) as client, httpx.AsyncClient() as http:
            await complete(client, ask("a", system=long_system))
            assert server.state.prefix_hit_tokens == 0
            await complete(client, ask("a", 1, system=long_system))
            assert server.state.prefix_hit_tokens >= 180, "the shared opening blocks were cached"
            # one running (12 tokens x 40 ms: ~0.5 s, long past the other two's arrival), two waiting behind it
            slow = ChatRequest(messages=[{"role": "user", "content": "slow " * 50}], model="sim-7b#slow_ms=40",
                               max_tokens=12)
            streams = [asyncio.create_task(complete(client, slow)) for _ in range(3)]
            for _ in range(500):
                if server.state.waiting == 2:
                    break
                await asyncio.sleep(0.01)
            load = parse_server_load((await http.get(root + "/metrics")).text)
            assert load.waiting == 2 and load.running == 1 and 0 < load.kv_cache_usage <= 1
            await asyncio.gather(*streams)
            text = (await http.get(root + "/metrics")).text
    assert "vllm:prefix_cache_hits_total" in text and "vllm:prefix_cache_queries_total" in text
    assert parse_server_load(text) == ServerLoad(waiting=0.0, running=0.0, kv_cache_usage=0.0)


# --------------------------------------------------------------------------- the picker alone


@dataclass
class Replica:
    """A candidate as the picker reads one (the fields of gateway.pool.Endpoint it scores)."""

    name: str
    up: bool = True
    in_flight: int = 0
    load: ServerLoad = field(default_factory=ServerLoad)
    limit_value: int = 32
    ttft_s: float | None = None


def picker(**config: Any) -> EndpointPicker:
    cfg = UpstreamConfig.model_validate({"pool": {"endpoints": ["http://a/v1", "http://b/v1"], **config}})
    return EndpointPicker(cfg.pool)


def test_picker_filters_down_tried_and_full_endpoints():
    pick = picker(weights={"prefix_affinity": 0, "queue_depth": 0, "kv_cache_usage": 0, "in_flight": 1, "ttft": 0})
    a, b, c = Replica("a"), Replica("b", up=False), Replica("c", in_flight=5, limit_value=5)
    pick.sync(["a", "b", "c"])
    assert pick.pick([a, b, c], "", 0.0).name == "a"
    assert pick.pick([a, b, c], "", 0.0, tried=frozenset({"a"})).name == "c", "a full endpoint beats none"
    with pytest.raises(LookupError, match="no endpoint up and untried"):
        pick.pick([a, b, c], "", 0.0, tried=frozenset({"a", "c"}))


def test_each_scorer_prefers_what_it_measures():
    endpoints = [Replica("a"), Replica("b")]

    def only(scorer: str) -> EndpointPicker:
        weights = {"prefix_affinity": 0, "queue_depth": 0, "kv_cache_usage": 0, "in_flight": 0, "ttft": 0}
        p = picker(weights={**weights, scorer: 1})
        p.sync(["a", "b"])
        return p

    endpoints[0].load = ServerLoad(waiting=4)
    endpoints[1].load = ServerLoad(waiting=0)
    assert only("queue_depth").pick(endpoints, "", 0.0).name == "b"
    endpoints[0].load, endpoints[1].load = ServerLoad(kv_cache_usage=0.2), ServerLoad(kv_cache_usage=0.9)
    assert only("kv_cache_usage").pick(endpoints, "", 0.0).name == "a"
    endpoints[0].in_flight, endpoints[1].in_flight = 10, 2
    assert only("in_flight").pick(endpoints, "", 0.0).name == "b"
    endpoints[0].ttft_s, endpoints[1].ttft_s = 0.05, 0.4
    assert only("ttft").pick(endpoints, "", 0.0).name == "a"
    result = only("ttft").pick(endpoints, "", 0.0)
    assert result.scores == {"a": 1.0, "b": pytest.approx(0.125)} and result.reason == "load"


def test_affinity_keeps_a_key_home_spills_past_the_bound_and_comes_back():
    pick = picker(balance=1.25)
    endpoints = [Replica(n) for n in ("a", "b", "c")]
    pick.sync(["a", "b", "c"])
    first = pick.pick(endpoints, "agent-1", 0.0)
    assert first.reason == "affinity"
    home = next(e for e in endpoints if e.name == first.name)
    for _ in range(10):  # more calls of the same agent while they all run
        chosen = pick.pick(endpoints, "agent-1", 0.0)
        next(e for e in endpoints if e.name == chosen.name).in_flight += 1
    assert max(e.in_flight for e in endpoints) / (10 / 3) <= 1.25 * 1.2  # within the bound's rounding
    assert home.in_flight == max(e.in_flight for e in endpoints)
    assert pick.pick(endpoints, "agent-1", 0.0).reason == "spill"
    for e in endpoints:
        e.in_flight = 0
    assert pick.pick(endpoints, "agent-1", 0.0).name == home.name
    rr = picker(policy="round_robin")
    rr.sync(["a", "b", "c"])
    assert [rr.pick(endpoints, "agent-1", 0.0).name for _ in range(3)] == ["a", "b", "c"]


def test_prompt_key_is_the_opening_text():
    system = [{"role": "system", "content": "x" * 2000}]
    assert prompt_key(system + [{"role": "user", "content": "one"}], 1024) == \
        prompt_key(system + [{"role": "user", "content": "two"}], 1024)
    assert prompt_key([{"role": "user", "content": "one"}], 1024) != prompt_key([{"role": "user", "content": "two"}],
                                                                                   1024)
    assert endpoint_name("http://10.0.0.1:8000/v1") == "10.0.0.1:8000" and endpoint_name("https://h/v1") == "h:443"


def test_pool_config_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="endpoints"):
        UpstreamConfig.model_validate({"pool": {"endpoints": ["10.0.0.1:8000"]}})
    with pytest.raises(ValueError, match="distinct"):
        UpstreamConfig.model_validate({"pool": {"endpoints": ["http://a/v1", "http://a/v1/"]}})
    with pytest.raises(ValueError, match="set one, not both"):
        UpstreamConfig.model_validate({"pool": {"endpoints": ["http://a/v1"], "dns_url": "http://b/v1"}})
    single = load_config("config").upstream
    assert not single.pool.pooled and single.endpoint_urls == [single.base_url]


# --------------------------------------------------------------------------- real replicas


async def test_agents_spread_over_the_pool_and_each_stays_on_its_replica(clean_proxy_env):
    with replicas() as servers:
        async with GatewayClient(pool_config([s.base_url for s in servers])) as client:
            agents = [f"agent{i}" for i in range(12)]
            for turn in range(3):
                results = await asyncio.gather(*(complete(client, ask(a, turn)) for a in agents))
                assert all(isinstance(r[-1], Finished) for r in results)
            assert isinstance(client.concurrency_limit, PoolLimit)
            # three endpoints at the start-up limit of 4 (each: 3 for NORMAL and BATCH, 1 held for CORE): NORMAL and
            # BATCH fill their three ceilings, and the pool holds one headroom of its 12 slots (2), not three
            assert client.concurrency_limit.limit == 3 * 3 + 2
            assert client.concurrency_limit.reserve == 2
    seen = agents_by_server(servers)
    assert set(seen) == set(agents)
    assert all(len(where) == 1 for where in seen.values()), seen
    per_server = [sum(1 for where in seen.values() if where == {i}) for i in range(3)]
    assert max(per_server) / (12 / 3) <= 1.25, per_server


async def test_calls_without_an_agent_follow_their_prompt_prefix(clean_proxy_env):
    with replicas() as servers:
        async with GatewayClient(pool_config([s.base_url for s in servers])) as client:
            for i in range(6):  # one at a time: the same opening text goes to the same replica
                request = ask(f"q{i}", system="A long shared system prompt. " * 60)
                await complete(client, dataclasses.replace(request, affinity_key=""))
    assert sorted(len(s.state.requests) for s in servers) == [0, 0, 6]


async def test_a_failing_replica_is_left_for_another_before_the_first_token(clean_proxy_env):
    with replicas(2) as healthy, run_in_thread(SimOpenAIOptions(latency=False, faults={"*": Fault(status=503)})) as bad:
        servers = [bad, *healthy]
        async with GatewayClient(pool_config([s.base_url for s in servers])) as client:
            results = await asyncio.gather(*(complete(client, ask(f"agent{i}")) for i in range(12)))
            assert all(isinstance(r[-1], Finished) for r in results)
            bad_endpoint = client.pool.endpoints[endpoint_name(bad.base_url)]
            assert bad_endpoint.limit.limit < client.config.concurrency.initial_limit, "503s backed its limit off"
    assert bad.state.requests, "some agents were homed on the failing replica"
    assert sum(len(s.state.requests) for s in healthy) == 12
    # the request sent again on another replica is a request of its own: its X-Request-Id too
    refused = {h["x-request-id"] for h in bad.state.headers}
    served = {h["x-request-id"] for s in healthy for h in s.state.headers}
    assert refused and not refused & served and {f"{r}-2" for r in refused} <= served


async def test_a_killed_replica_fails_no_call_that_had_not_streamed_a_token(clean_proxy_env):
    procs = spawn_replicas(3, ["--max-running", "64"])
    try:
        cfg = pool_config([p.base_url for p in procs], scrape_interval_s=5.0)
        async with GatewayClient(cfg) as client:
            agents = [f"agent{i}" for i in range(12)]
            await asyncio.gather(*(complete(client, ask(a)) for a in agents))
            homes = {a: client.pool.picker.ring.placed[a] for a in agents}
            victim = procs[0]
            victim_name = endpoint_name(victim.base_url)
            on_victim = [a for a in agents if homes[a] == victim_name]
            assert on_victim
            # one long stream on the victim, killed once it has streamed a token
            long = dataclasses.replace(ask(on_victim[0], 1), max_tokens=400, model="sim-7b#slow_ms=20")
            stream = client.stream_chat(long)
            first = await anext(stream)
            while not isinstance(first, Token):
                first = await anext(stream)
            victim.kill()
            with pytest.raises(GatewayError) as cut:
                async for _ in stream:
                    pass
            assert cut.value.code == grpc.StatusCode.UNAVAILABLE and cut.value.tokens_sent >= 1
            assert "not retried" in str(cut.value)
            # every other call, the victim's agents included, is served: none had streamed a token
            results = await asyncio.gather(*(complete(client, ask(a, 2)) for a in agents))
            assert all(isinstance(r[-1], Finished) for r in results)
            assert not client.pool.endpoints[victim_name].up
            assert all(client.pool.picker.ring.placed[a] != victim_name for a in on_victim)
    finally:
        for p in procs:
            p.kill()


async def test_calls_waiting_on_a_replica_marked_down_go_to_another_at_once(clean_proxy_env):
    """A replica that stops answering (SIGSTOP: a hung host) holds the calls already sent to it. Once its
    /metrics read fails the pool marks it down; the calls on it that had streamed nothing waited on regardless
    for read_timeout_s (60 s by default) and, here, ran out of their callers' 10 s. They go to the other
    replica now."""
    import signal

    procs = spawn_replicas(2, ["--max-running", "64"])
    try:
        cfg = pool_config([p.base_url for p in procs], scrape_interval_s=60.0, scrape_timeout_s=0.5)
        async with GatewayClient(cfg) as client:
            agents = [f"agent{i}" for i in range(8)]
            await asyncio.gather(*(complete(client, ask(a)) for a in agents))
            victim = procs[0]
            victim_endpoint = client.pool.endpoints[endpoint_name(victim.base_url)]
            on_victim = [a for a in agents if client.pool.picker.ring.placed[a] == victim_endpoint.name]
            assert on_victim
            victim.process.send_signal(signal.SIGSTOP)
            calls = [asyncio.ensure_future(complete(client, dataclasses.replace(ask(a, 1), timeout_s=10.0)))
                     for a in on_victim]
            while victim_endpoint.in_flight < len(on_victim):  # each is sent to the stopped replica
                await asyncio.sleep(0.01)
            assert not await client.pool.scrape(victim_endpoint) and victim_endpoint.up  # one slow read: up
            assert not await client.pool.scrape(victim_endpoint) and not victim_endpoint.up  # two in a row: down
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(r, list) and isinstance(r[-1], Finished) for r in results), results
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.process.send_signal(signal.SIGCONT)
            p.kill()


async def test_an_endpoint_that_left_the_pool_gets_no_series_back_from_a_read_or_a_call_still_on_it(
        clean_proxy_env):
    """A re-resolve that drops an address removes its endpoint's series (switchyard_gateway_endpoint_up, ...).
    A /metrics read begun before (the scrape loop reads the endpoints it listed) or a call still on it that
    cannot connect wrote them again: switchyard_gateway_endpoint_up{endpoint=<a gone pod>} 0 for good, one more
    label set for each address a rollout retired, and a dashboard showing a replica down that no longer is
    one."""
    from prometheus_client import REGISTRY

    procs = spawn_replicas(2, ["--max-running", "8"])
    try:
        urls = [p.base_url for p in procs]
        async with GatewayClient(pool_config(urls, scrape_interval_s=60.0)) as client:
            await complete(client, ask("a"))
            pool = client.pool
            gone = pool.endpoints[endpoint_name(urls[0])]
            pool._update(urls[1:])  # the resolve loop's step: the name no longer gives the first address
            series = ("switchyard_gateway_endpoint_up", "switchyard_gateway_endpoint_server_waiting",
                      "switchyard_gateway_endpoint_server_kv_cache_usage_ratio")
            assert all(REGISTRY.get_sample_value(name, {"endpoint": gone.name}) is None for name in series)
            assert await pool.scrape(gone)  # a read of the list taken before the endpoint left
            procs[0].kill()
            assert not await pool.scrape(gone)
            pool.mark_down(gone, "ConnectError: a call still on it")  # what _send does for a call that was on it
            left = {name: REGISTRY.get_sample_value(name, {"endpoint": gone.name}) for name in series}
            assert set(left.values()) == {None}, left
            kept = pool.endpoints[endpoint_name(urls[1])]
            assert REGISTRY.get_sample_value("switchyard_gateway_endpoint_up", {"endpoint": kept.name}) == 1
            assert isinstance((await complete(client, ask("b")))[-1], Finished)
    finally:
        for p in procs:
            p.kill()


async def test_one_slow_metrics_read_leaves_a_replica_up_and_its_calls_where_they_are(clean_proxy_env):
    """A busy server may answer one /metrics read late. One timed-out read marked the replica down: no call
    picked it until the next good read, and every call on it that had streamed nothing was cancelled and sent
    again elsewhere, its prefill lost and its load moved onto the others. It takes
    pool.down_after_failed_reads (2) in a row now; a refused connection still marks it down at once."""
    import signal

    procs = spawn_replicas(2, ["--max-running", "64"])
    try:
        cfg = pool_config([p.base_url for p in procs], scrape_interval_s=60.0, scrape_timeout_s=0.5)
        async with GatewayClient(cfg) as client:
            slow = procs[0]
            endpoint = client.pool.endpoints[endpoint_name(slow.base_url)]
            agents = [f"agent{i}" for i in range(8)]
            await asyncio.gather(*(complete(client, ask(a)) for a in agents))
            on_slow = [a for a in agents if client.pool.picker.ring.placed[a] == endpoint.name]
            assert on_slow
            slow.process.send_signal(signal.SIGSTOP)
            calls = [asyncio.ensure_future(complete(client, dataclasses.replace(ask(a, 1), timeout_s=30.0)))
                     for a in on_slow]
            while endpoint.in_flight < len(on_slow):
                await asyncio.sleep(0.01)
            assert not await client.pool.scrape(endpoint)  # timed out: the server is stopped for this read
            slow.process.send_signal(signal.SIGCONT)
            assert endpoint.up and endpoint.failed_reads == 1
            results = await asyncio.gather(*calls)
            assert all(isinstance(r[-1], Finished) for r in results), results
            assert endpoint.in_flight == 0 and endpoint.up
            assert await client.pool.scrape(endpoint) and endpoint.failed_reads == 0
            slow.kill()  # nothing listens: the next read marks it down at once
            assert not await client.pool.scrape(endpoint) and not endpoint.up
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.process.send_signal(signal.SIGCONT)
            p.kill()


async def test_a_server_trickling_its_answer_is_read_as_one_that_did_not_answer_in_time(clean_proxy_env):
    """httpx's timeout bounds each read, not the answer: a server sending its /metrics or model list a byte at a
    time held the read for as long as it went on (here 20 s, against scrape_timeout_s 0.5), so a hung endpoint
    behind something that keeps its answer alive was never marked down, and its circuit's health check (one at a
    time) stopped."""
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                writer.write(b"1\r\n#\r\n")
                await writer.drain()
                await asyncio.sleep(0.2)
        writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    try:
        with replicas(1) as [other]:
            hung_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
            cfg = pool_config([hung_url, other.base_url], scrape_interval_s=60.0, scrape_timeout_s=0.5)
            async with GatewayClient(cfg) as client:
                await client.pool.start()
                hung = client.pool.endpoints[endpoint_name(hung_url)]
                reads = [await asyncio.wait_for(client.pool.scrape(hung), 15) for _ in range(2)]
                assert reads == [False, False] and not hung.up
                assert not await asyncio.wait_for(client.pool.answers(hung), 15)
    finally:
        server.close()


async def test_a_dns_name_is_an_endpoint_per_address_and_down_ones_are_skipped(clean_proxy_env):
    with replicas(1) as (server,):
        url = server.base_url.replace("127.0.0.1", "localhost")
        cfg = UpstreamConfig.model_validate({**pool_config([server.base_url]).model_dump(),
                                             "pool": {"dns_url": url, "scrape_interval_s": 0.05}})
        async with GatewayClient(cfg) as client:
            results = await asyncio.gather(*(complete(client, ask(f"agent{i}")) for i in range(6)))
            assert all(isinstance(r[-1], Finished) for r in results)
            names = set(client.pool.endpoints)
            assert f"127.0.0.1:{server.port}" in names  # localhost may also give ::1, where nothing listens
            for name, endpoint in client.pool.endpoints.items():
                if name.startswith("["):
                    assert not endpoint.up
    assert len(server.state.requests) == 6


async def test_the_dispatcher_admits_up_to_the_sum_of_the_endpoint_limits(clean_proxy_env):
    from switchyard.api import agent_pb2, agent_pb2_grpc
    from switchyard.common.channels import open_channel
    from switchyard.common.server import running
    from switchyard.dispatcher.engines import make_engine
    from switchyard.dispatcher.service import DispatcherService

    with replicas() as servers:
        urls = [s.base_url for s in servers]
        cfg = load_config("config").with_overrides(**{
            "dispatcher.engine": "openai", "upstream.api_key_required": False, "upstream.default_model": "sim-7b",
            "upstream.fallback_model": "", "upstream.pool.endpoints": urls})
        service = DispatcherService(cfg, engine=make_engine(cfg))
        assert service.stream_slots is not None and isinstance(service.stream_slots.source, PoolLimit)
        assert service.stream_slots.limit == 3 * 3 + 2  # three ceilings of 3 at the start-up limit of 4, one headroom of 2
        async with running([service], cfg.server) as server:
            async with open_channel(f"127.0.0.1:{server.port}") as channel:
                stub = agent_pb2_grpc.InferenceServiceStub(channel)
                for agent in ("a1", "a2", "a3", "a1"):
                    chunks = [c async for c in stub.Generate(agent_pb2.GenerateRequest(
                        request_id=f"{agent}-{id(agent)}", prompt=f"{agent} says hi", agent_id=agent, max_tokens=4))]
                    assert chunks[-1].done.finish_reason in ("stop", "length")
    assert sum(len(s.state.requests) for s in servers) == 4


def test_upstream_variables_override_model_gateway_and_name_themselves_when_bad(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_ENGINE", "openai")
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", "http://127.0.0.1:8000/v1")
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_MODEL", "qwen2.5-7b-instruct")
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_FALLBACK_MODEL", "none")
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_API_KEY_REQUIRED", "false")
    upstream = load_config("config", service="dispatcher").upstream
    assert (upstream.base_url, upstream.default_model, upstream.fallback_model, upstream.api_key_required) == (
        "http://127.0.0.1:8000/v1", "qwen2.5-7b-instruct", "", False)
    monkeypatch.setenv("SWITCHYARD_UPSTREAM_BASE_URL", "127.0.0.1:8000")
    with pytest.raises(ValueError, match="SWITCHYARD_UPSTREAM_BASE_URL='127.0.0.1:8000'.*http://"):
        load_config("config", service="dispatcher")


def gauge(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


async def test_the_dispatchers_upstream_gauges_show_the_pools_totals_and_each_endpoint_its_own(clean_proxy_env):
    """Each endpoint's limit writes its own series; the dispatcher's gauges are the pool's sums (one endpoint's
    limit used to overwrite them)."""
    with replicas(2) as servers:
        urls = [s.base_url for s in servers]
        config = pool_config(urls)
        config = config.model_copy(update={"concurrency": config.concurrency.model_copy(update={"initial_limit": 5})})
        async with GatewayClient(config) as client:
            pool = client.pool
            first, second = pool.endpoints.values()
            first.limit.limit = 9.0  # as a window's decision leaves it
            first.limit._limit_gauge.set(9.0)
            pool.publish_totals()
            assert gauge("switchyard_gateway_endpoint_concurrency_limit", endpoint=first.name) == 9
            assert gauge("switchyard_gateway_endpoint_concurrency_limit", endpoint=second.name) == 5
            # NORMAL and BATCH fill 7 of the first's 9 and 4 of the second's 5; one CORE headroom (2) on top
            assert gauge("switchyard_upstream_concurrency_limit") == client.concurrency_limit.limit == 7 + 4 + 2
            slots = StreamSlots(client.concurrency_limit)
            picked, _ = pool.pick("agent-a")
            slots.acquire(PriorityClass.NORMAL)
            assert gauge("switchyard_gateway_endpoint_in_flight", endpoint=picked.name) == 1
            assert gauge("switchyard_upstream_in_flight") == 1
            pool.finished(picked)
            slots.release(PriorityClass.NORMAL)
            assert gauge("switchyard_upstream_in_flight") == 0


async def test_each_endpoints_limit_gauge_shows_the_streams_it_admits(clean_proxy_env):
    """A 429 halves an endpoint's limit of 5 to 2.5: it admits 2 streams, and its gauge read 2.5. The pool admits
    what NORMAL and BATCH may fill on each (2 and 4) and one CORE headroom (1): 7."""
    with replicas(1) as healthy, run_in_thread(SimOpenAIOptions(latency=False, faults={"*": Fault(status=429)})) as bad:
        config = pool_config([bad.base_url, *(s.base_url for s in healthy)])
        config = config.model_copy(update={"concurrency": config.concurrency.model_copy(update={"initial_limit": 5})})
        async with GatewayClient(config) as client:
            for agent in range(20):  # until a call is homed on the one answering 429, then moved to the other
                assert isinstance((await complete(client, ask(f"agent-{agent}")))[-1], Finished)
                if bad.state.requests:
                    break
            endpoints = list(client.pool.endpoints.values())
            assert sorted(e.limit.limit for e in endpoints) == [2.5, 5], "one 429 answered"
            shown = [gauge("switchyard_gateway_endpoint_concurrency_limit", endpoint=e.name) for e in endpoints]
            assert sorted(shown) == [2, 5]
            assert gauge("switchyard_upstream_concurrency_limit") == client.concurrency_limit.limit == 2 + 4 + 1


async def test_an_endpoint_no_call_may_be_placed_on_leaves_the_admission_limit(clean_proxy_env):
    """An endpoint that asked for 30 s without calls (429, Retry-After) stays up, and the picker places nothing
    on it: its share of the admission limit had stayed counted, and every stream it admitted went to the other
    endpoint, past that one's limit (14 NORMAL streams on an endpoint whose limit was 8)."""
    with replicas(1) as healthy, run_in_thread(SimOpenAIOptions(
            latency=False, faults={"*": Fault(status=429, retry_after=30)})) as bad:
        config = pool_config([bad.base_url, *(s.base_url for s in healthy)])
        async with GatewayClient(config) as client:
            both = client.concurrency_limit.limit
            for agent in range(20):  # until a call is homed on the one answering 429, then moved to the other
                assert isinstance((await complete(client, ask(f"agent-{agent}")))[-1], Finished)
                if bad.state.requests:
                    break
            waiting, serving = client.pool.endpoints.values()
            assert waiting.up and not client.pool.accepts(waiting, "sim-7b")
            assert client.concurrency_limit.counted() == [serving]
            assert client.concurrency_limit.limit == serving.limit.limit < both
            slots = StreamSlots(client.concurrency_limit)
            for _ in range(int(serving.limit.limit) - serving.limit.reserve):
                assert slots.refusal(PriorityClass.NORMAL) is None
                slots.acquire(PriorityClass.NORMAL)
            assert slots.refusal(PriorityClass.NORMAL) is not None
            assert slots.refusal(PriorityClass.CORE) is None


async def test_the_circuit_gauge_counts_the_endpoints_in_each_state_and_a_joining_one_changes_no_other(
        clean_proxy_env):
    with replicas(2) as servers:
        config = pool_config([s.base_url for s in servers])
        async with GatewayClient(config) as client:
            pool = client.pool
            first = next(iter(pool.endpoints.values()))

            async def fail() -> None:
                raise UpstreamServerError("503 from the test")

            for _ in range(config.cooldown.failures):
                with pytest.raises(UpstreamServerError):
                    await first.cooldowns.call("sim-7b", fail)
            assert first.cooldowns.state("sim-7b") == "open"
            assert gauge("switchyard_gateway_circuit_state", model="sim-7b", state="open") == 1
            assert gauge("switchyard_gateway_circuit_state", model="sim-7b", state="closed") == 1
            pool._update([*pool.config.endpoint_urls, "http://127.0.0.1:9/v1"])  # a third joins (DNS, say)
            assert gauge("switchyard_gateway_circuit_state", model="sim-7b", state="open") == 1
            assert gauge("switchyard_gateway_circuit_state", model="sim-7b", state="closed") == 2
            pool._update(pool.config.endpoint_urls[1:])  # the open one leaves
            assert gauge("switchyard_gateway_circuit_state", model="sim-7b", state="open") == 0
            assert gauge("switchyard_gateway_circuit_state", model="sim-7b", state="closed") == 1


async def test_an_endpoint_whose_circuit_is_open_is_not_picked_while_another_is_left(clean_proxy_env):
    """Affinity sent nearly every call to a replica whose circuit was open first (977 failovers in 991 calls):
    such an endpoint is left out of the pick; the dispatcher's knee total counts the endpoints up only."""
    with replicas(2) as servers:
        async with GatewayClient(pool_config([s.base_url for s in servers])) as client:
            pool = client.pool
            first, second = pool.endpoints.values()

            async def fail() -> None:
                raise UpstreamServerError("503 from the test")

            for _ in range(client.config.cooldown.failures):
                with pytest.raises(UpstreamServerError):
                    await first.cooldowns.call("sim-7b", fail)
            assert first.cooldowns.refusing("sim-7b") and not second.cooldowns.refusing("sim-7b")
            picks = []
            for i in range(8):
                endpoint, _ = pool.pick(f"agent-{i}", frozenset(), "sim-7b")
                picks.append(endpoint.name)
                pool.finished(endpoint)
            assert set(picks) == {second.name}
            both_refusing, _ = pool.pick("agent-0", frozenset({second.name}), "sim-7b")  # none else left
            assert both_refusing is first
            pool.finished(first)
            first.limit.knee, second.limit.knee = 5.0, 4.0
            pool.mark_down(first, "killed")
            assert gauge("switchyard_upstream_concurrency_knee") == 4.0  # the endpoints up only, as the limit


async def test_the_last_endpoint_down_says_no_endpoint_is_left(clean_proxy_env, caplog):
    """The log line of an endpoint going down said its calls went to the other endpoints also when it was the
    last one up, where every call then fails UNAVAILABLE."""
    import logging

    with replicas(2) as servers:
        async with GatewayClient(pool_config([s.base_url for s in servers], scrape_interval_s=60.0)) as client:
            first, second = client.pool.endpoints.values()
            with caplog.at_level(logging.WARNING, logger="switchyard.gateway.pool"):
                client.pool.mark_down(first, "killed")
                client.pool.mark_down(second, "killed")
    lines = [r.getMessage() for r in caplog.records if r.name == "switchyard.gateway.pool"]
    assert len(lines) == 2, lines
    assert first.url in lines[0] and "its calls go to the other endpoints" in lines[0]
    assert second.url in lines[1] and "other endpoints" not in lines[1]
    assert "no endpoint of model_gateway.pool is up: calls fail UNAVAILABLE" in lines[1]


async def test_the_openai_engines_busy_seconds_are_the_share_of_the_limit_its_streams_held(monkeypatch) -> None:
    """The openai engine's busy seconds were always 0: its compute score and busy ratio read 0 with 60 streams
    in flight, and the model-server overlay's autoscaler read a signal that could never rise."""
    from switchyard.common.priority import PriorityClass
    from switchyard.gateway import pool as pool_module

    clock = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: clock[0])
    config = pool_config(["http://127.0.0.1:9/v1"]).model_copy(update={
        "concurrency": UpstreamConfig().concurrency.model_copy(update={"min_limit": 4, "initial_limit": 4,
                                                                         "max_limit": 4})})
    async with GatewayClient(config) as client:
        limit = StreamSlots(client.concurrency_limit)
        assert limit.limit == 4 and limit.busy_seconds == 0.0
        limit.acquire(PriorityClass.NORMAL)
        limit.acquire(PriorityClass.NORMAL)
        clock[0] += 10.0  # half the limit for 10 s
        assert limit.busy_seconds == pytest.approx(5.0)
        for _ in range(4):
            limit.acquire(PriorityClass.BATCH)
        clock[0] += 10.0  # over the limit: the whole of it, no more
        assert limit.busy_seconds == pytest.approx(15.0)
        for endpoint in client.pool.endpoints.values():  # the limit moves between two streams' starts and ends
            endpoint.limit.limit = 40.0
        clock[0] += 1.0
        assert limit.busy_seconds == pytest.approx(16.0)  # the share taken at the last start: never backwards
        for _ in range(6):
            limit.release(PriorityClass.NORMAL)
        clock[0] += 10.0  # idle
        assert limit.busy_seconds == pytest.approx(16.0)


async def test_a_call_cancelled_as_its_first_item_arrives_closes_the_stream_it_opened(clean_proxy_env):
    """A pooled call waits for its attempt's first item beside the endpoint's down event. Cancelled (its caller's
    deadline, a cancelled task) in the turn its attempt opened, after the stream's first item came and before the
    wait returned, the opened stream was dropped unclosed: nobody read it, and the server went on generating
    the whole answer for it. The stream is closed now, and the server stops (its client left)."""
    from switchyard.common.config.engines import SimEngineConfig

    with replicas(2, latency=True, sim=SimEngineConfig(decode_base_ms=300.0)) as servers:
        cfg = pool_config([s.base_url for s in servers], scrape_interval_s=60.0)
        async with GatewayClient(cfg) as client:
            call = asyncio.ensure_future(complete(client, ask("agent-cancelled")))
            opening = None
            while opening is None:  # the attempt the call waits on, beside its endpoint's down event
                await asyncio.sleep(0)
                opening = next((t for t in asyncio.all_tasks()
                                if t.get_coro().__qualname__ == "GatewayClient._open_first"), None)
            opening.add_done_callback(lambda _: call.cancel())  # the caller leaves as the first item comes
            with pytest.raises(asyncio.CancelledError):
                await call
            assert not opening.cancelled() and opening.exception() is None  # it had opened the stream
            while any(s.state.active_streams for s in servers):
                await asyncio.sleep(0.01)
    assert sum(s.state.streams_left_by_client for s in servers) == 1  # closed, not generated to its end


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _until(predicate, what: str) -> None:
    for _ in range(400):
        if predicate():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"never happened: {what}")


@dataclass
class ReplicaToRestart:
    """The second replica of :func:`pool_with_a_replica_to_restart`: on a port of its own, stopped by
    :meth:`stop` and started again there by the test (``run_in_thread(..., port=replica.port)``)."""

    port: int
    name: str
    """Its endpoint name in the pool (``host:port``)."""
    server: contextlib.AbstractContextManager[RunningSimOpenAI]

    def stop(self) -> None:
        self.server.__exit__(None, None, None)


@contextlib.asynccontextmanager
async def pool_with_a_replica_to_restart(options: SimOpenAIOptions, **pool: Any):
    """A GatewayClient over a pool of two sim-openai replicas serving ``options`` (``pool``: more
    ``model_gateway.pool`` settings), each endpoint's model list read; yields the client and the second replica,
    which the test stops and starts again. The client and the first replica close on exit."""
    port = _free_port()
    with run_in_thread(options) as steady:
        server = run_in_thread(options, port=port)
        restarted = server.__enter__()
        replica = ReplicaToRestart(port, endpoint_name(restarted.base_url), server)
        client = GatewayClient(pool_config([steady.base_url, restarted.base_url], **pool))
        try:
            await client.list_models_everywhere()
            yield client, replica
        finally:
            await client.aclose()


async def test_an_endpoint_back_after_being_down_has_its_model_list_read_again(clean_proxy_env):
    """Each endpoint's GET /v1/models was read once, at the start: a replica restarted with another
    --max-model-len (32768, then 4096) kept its old list, and the pool's window stayed 32768, so a prompt the
    restarted replica refuses was accepted. An endpoint that comes back after being down (its /metrics read
    failed, then answers) has its list read again."""
    long = SimOpenAIOptions(latency=False, models=["sim-7b"], owned_by="vllm", max_model_len=32768)
    async with pool_with_a_replica_to_restart(long) as (client, replica):
        await client.pool.start()
        assert client.reported_context_window("sim-7b") == 32768
        replica.stop()
        await _until(lambda: not client.pool.endpoints[replica.name].up, "the stopped replica marked down")
        with run_in_thread(dataclasses.replace(long, max_model_len=4096), port=replica.port):
            await _until(lambda: client.pool.endpoints[replica.name].up, "the restarted replica up again")
            await _until(lambda: client.reported_context_window("sim-7b") == 4096,
                         "the restarted replica's window read")


async def test_a_replica_that_leaves_the_pool_and_joins_again_has_its_model_list_read_again(clean_proxy_env):
    """A DNS pool's replica leaves (the name no longer gives its address) and joins again under the same
    host:port, restarted with another --max-model-len. What the gateway knew of it (its context windows, its
    flavour, the fields it refused) was kept by endpoint name beside the pool, so it came back with its old
    window, 32768, and ``list_models_everywhere`` skipped it as read. It belongs to the endpoint now: a
    replica that joins again is read again, and the pool's window is the restarted one's."""
    long = SimOpenAIOptions(latency=False, models=["sim-7b"], owned_by="vllm", max_model_len=32768)
    async with pool_with_a_replica_to_restart(long, scrape_interval_s=60.0) as (client, replica):
        urls = [endpoint.url for endpoint in client.pool.endpoints.values()]
        assert client.reported_context_window("sim-7b") == 32768
        others = [url for url in urls if endpoint_name(url) != replica.name]
        client.pool._update(others)  # the resolve loop's step: the name no longer gives its address
        replica.stop()
        with run_in_thread(dataclasses.replace(long, max_model_len=4096), port=replica.port):
            client.pool._update(urls)  # and gives it again
            await client.list_models_everywhere()
            assert client.reported_context_window("sim-7b") == 4096


async def test_a_not_found_from_an_endpoint_that_listed_the_model_reads_its_list_and_goes_to_another(
        clean_proxy_env):
    """A replica restarted serving another model, unnoticed (its /metrics never failed): the calls its
    affinity sent there failed NOT_FOUND although the other replica serves the model. The NOT_FOUND of a model
    the endpoint's list named reads its list again; the call goes to an endpoint whose list names the model,
    and later calls of the model are not sent to the one that dropped it."""
    options = SimOpenAIOptions(latency=False, models=["sim-7b"])
    async with pool_with_a_replica_to_restart(options, scrape_interval_s=60.0) as (client, replica):
        assert client.pool.endpoints[replica.name].models == frozenset({"sim-7b"})
        replica.stop()
        with run_in_thread(dataclasses.replace(options, models=["other-7b"]), port=replica.port) as other:
            for agent in range(12):  # some of them have the restarted replica as their home
                events = await complete(client, ask(f"agent{agent}"))
                assert isinstance(events[-1], Finished)
            assert client.pool.endpoints[replica.name].models == frozenset({"other-7b"})
            assert len(other.state.requests) == 1  # the first one, answered 404; none after it


async def test_a_lone_endpoint_back_after_a_failed_call_has_its_model_list_read_again(clean_proxy_env):
    """``base_url`` alone (a pool of one, never marked down): the server restarted with another window; a call
    cut by the stop (its keep-alive connection closed), then one the restarted server answers, reads its list
    again. It kept the window of the server before the restart."""
    from gateway_fixtures import gateway_config

    long = SimOpenAIOptions(latency=False, models=["sim-7b"], owned_by="vllm", max_model_len=32768)
    port = _free_port()
    with run_in_thread(long, port=port) as server:
        client = GatewayClient(gateway_config(server.base_url, default_model="sim-7b", fallback_model="",
                                              max_retries=0))
        await client.list_models_everywhere()
        assert client.reported_context_window("sim-7b") == 32768
    try:
        with pytest.raises(GatewayError):
            await complete(client, ask("lone"))
        with run_in_thread(dataclasses.replace(long, max_model_len=4096), port=port):
            assert isinstance((await complete(client, ask("lone", 1)))[-1], Finished)
            await _until(lambda: client.reported_context_window("sim-7b") == 4096, "the restarted server's window")
    finally:
        await client.aclose()


async def test_an_endpoint_answering_once_the_client_closes_starts_no_read_of_its_model_list(clean_proxy_env):
    """The gateway's close cancels the reads of model lists under way, then closes the pool; an endpoint that
    answered in between (a /metrics read ending, a call's first item) started one more read, left to run on
    the closed connection pool (an httpx RuntimeError in a task nobody awaited)."""
    options = SimOpenAIOptions(latency=False, models=["sim-7b"])
    with run_in_thread(options) as server:
        client = GatewayClient(pool_config([server.base_url], scrape_interval_s=60.0))
        await client.list_models_everywhere()
        [endpoint] = client.pool.endpoints.values()
        await client.aclose()
        endpoint.relist = True  # it could not be reached since its list was read
        client.pool.on_first_item(endpoint, 0.01)  # and answers now
        assert endpoint.relist and not client._relists


async def test_endpoints_under_four_streams_hold_the_pools_core_headroom_together():
    """Four endpoints at 3 streams each hold none back each (a server taking 3 is not sent 4); summing their
    ceilings with the largest headroom of one (0) let NORMAL fill all 12 slots and refused CORE, as the pool's
    limits came down after 429s, when CORE needs them most. Together they hold 2, as one endpoint of 12 would."""
    urls = [f"http://127.0.0.1:{9 + i}/v1" for i in range(4)]
    async with GatewayClient(pool_config(urls)) as client:
        for endpoint in client.pool.endpoints.values():
            endpoint.limit.limit = 3.0
        limit = client.concurrency_limit
        assert (limit.limit, limit.reserve) == (12, 2)
        slots = StreamSlots(limit)
        for _ in range(10):
            assert slots.refusal(PriorityClass.NORMAL) is None
            slots.acquire(PriorityClass.NORMAL)
        assert slots.refusal(PriorityClass.NORMAL) is not None and slots.refusal(PriorityClass.CORE) is None


async def test_streams_still_on_an_endpoint_left_out_keep_their_slots_not_the_others():
    """An endpoint left out of the sum (here its model list no longer names the model) still had 7 streams running,
    counted against the other endpoint's 8: NORMAL was refused while that one had none in flight."""
    urls = [f"http://127.0.0.1:{9 + i}/v1" for i in range(2)]
    async with GatewayClient(pool_config(urls)) as client:
        left, other = client.pool.endpoints.values()
        for endpoint in (left, other):
            endpoint.limit.limit = 8.0
        limit = client.concurrency_limit
        slots = StreamSlots(limit)
        for _ in range(7):
            left.limit.started()
            slots.acquire(PriorityClass.NORMAL)
        left.models = {"another-model"}
        assert limit.counted() == [other]
        assert limit.limit == 8 + 7 and slots.refusal(PriorityClass.NORMAL) is None


async def test_a_dns_pool_that_resolves_no_endpoint_fails_its_calls_naming_that(clean_proxy_env):
    """A headless Service with no ready model-server pod yet resolves to no address. The pool's admission limit
    took the largest of no endpoints' reserves (ValueError, max() of an empty sequence) at the dispatcher's first
    admission: the request was not answered with what is wrong. The pool admits under min_limit, and the call
    fails at the gateway naming the pool's endpoints, none resolved (PoolLimit.counted's own intent)."""
    import grpc

    from switchyard.api import agent_pb2, agent_pb2_grpc
    from switchyard.common.channels import open_channel
    from switchyard.common.server import running
    from switchyard.dispatcher.engines import make_engine
    from switchyard.dispatcher.service import DispatcherService

    cfg = load_config("config").with_overrides(**{
        "dispatcher.engine": "openai", "upstream.api_key_required": False, "upstream.default_model": "sim-7b",
        "upstream.fallback_model": "", "upstream.pool.dns_url": "http://model-server.invalid:8000/v1"})
    service = DispatcherService(cfg, engine=make_engine(cfg))
    assert service.stream_slots is not None and service.stream_slots.limit >= 1
    async with running([service], cfg.server) as server:
        async with open_channel(f"127.0.0.1:{server.port}") as channel:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in stub.Generate(agent_pb2.GenerateRequest(request_id="no-endpoint", prompt="hi",
                                                                       max_tokens=4), timeout=60):
                    pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
    assert "none resolved" in failed.value.details(), failed.value.details()


async def test_one_503_beside_a_stream_in_flight_costs_the_endpoints_limit_one_step(clean_proxy_env):
    """A model server answers one call 503 while another call of the same endpoint streams: the endpoint's limit
    (shared by every call placed on it) dropped to the one other stream and was capped there for memory_s (30 s
    of one stream at a time). One refusal costs one step of backoff_ratio, and caps nothing the server was not
    seen to hold."""
    faults = {"sim-7b": Fault(slow_ms=100), "flaky": Fault(status=503)}
    with run_in_thread(SimOpenAIOptions(latency=False, models=["sim-7b", "flaky"], faults=faults)) as server:
        config = pool_config([server.base_url])
        config = config.model_copy(update={
            "max_retries": 0, "concurrency": config.concurrency.model_copy(update={"initial_limit": 8}),
            "cooldown": config.cooldown.model_copy(update={"enabled": False})})
        async with GatewayClient(config) as client:
            endpoint = client.pool.endpoints[endpoint_name(server.base_url)]
            events = client.stream_chat(ask("slow"))
            first = await anext(events)  # the slow call streams: in flight beside the refused one
            assert isinstance(first, Token) and endpoint.limit.in_flight == 1
            with pytest.raises(GatewayError):
                await complete(client, dataclasses.replace(ask("refused"), model="flaky"))
            assert endpoint.limit.limit == 4 and endpoint.limit.refused_at is None  # 8 x 0.5, not 1
            rest = [event async for event in events]
            assert isinstance(rest[-1], Finished)
