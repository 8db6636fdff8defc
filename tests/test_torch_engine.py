"""The torch engine on the CPU with a tiny model: KV cache, batching, preemption, limits, and over gRPC."""

from __future__ import annotations

import asyncio

import grpc
import pytest

torch = pytest.importorskip("torch")

from switchyard.api import agent_pb2, agent_pb2_grpc  # noqa: E402
from switchyard.common.config import SwitchyardConfig  # noqa: E402
from switchyard.common.errors import InvalidArgument  # noqa: E402
from switchyard.common.server import running  # noqa: E402
from switchyard.dispatcher.engines import make_engine  # noqa: E402
from switchyard.dispatcher.engines.sim import plan_reply  # noqa: E402
from switchyard.dispatcher.engines.torch import TorchEngine, render_prompt  # noqa: E402
from switchyard.dispatcher.engines.torch_model import Tokenizer, save_checkpoint  # noqa: E402
from switchyard.dispatcher.output import StreamError, StreamToken  # noqa: E402
from switchyard.dispatcher.request import Message, Request, RequestStatus, Tool  # noqa: E402
from switchyard.dispatcher.service import DispatcherService  # noqa: E402
from switchyard.common.channels import open_channel
from switchyard.dispatcher.engines.driver import EngineDriver
from switchyard_harness.testing.scheduling import accept, step
from token_events import positions_follow_on, token_count
from redis_fixtures import RedisDb, redis_db, redis_server  # noqa: E402,F401

pytestmark = pytest.mark.no_gpu

TINY = {
    "n_layers": 2,
    "d_model": 64,
    "n_heads": 4,
    "d_ff": 128,
    "vocab_size": 1024,
    "max_seq_len": 256,
    "device": "cpu",
    "dtype": "float32",
    "ignore_eos": True,
    "kv_block_tokens": 4,
}

PROMPTS = [
    "How does the with statement work?",
    "Summarize this doc: queues split by resource type keep the GPU batch full while CPU stages run elsewhere.",
    "hi",
    "Explain preemption and recompute in an iteration-level batching scheduler, in one paragraph, with care.",
]


def tiny_config(**fields: object) -> SwitchyardConfig:
    return SwitchyardConfig().with_overrides(**{f"torch.{k}": v for k, v in {**TINY, **fields}.items()})


def make(**fields: object) -> TorchEngine:
    return TorchEngine(tiny_config(**fields))


def reqs_for(prompts: list[str], max_tokens: int = 8, tag: str = "r") -> list[Request]:
    return [Request(request_id=f"{tag}{i}", prompt=p, max_tokens=max_tokens) for i, p in enumerate(prompts)]


async def run_to_end(engine: TorchEngine, reqs: list[Request]) -> None:
    await EngineDriver(engine).prefill(reqs)
    while live := [s for s in reqs if not s.is_finished]:
        await EngineDriver(engine).decode(live)


def counted(engine: TorchEngine, req: Request) -> Request:
    """``req`` with its prompt counted as the dispatcher counts it before the engine sees it (here with the
    engine's own tokenizer, so the count agrees with what the engine reports after its first step)."""
    req.prompt_tokens = len(engine.tokenizer.encode(render_prompt(req.prompt, req.messages, req.tools)))
    return req


async def run_through(sched: object, engine: TorchEngine, req: Request) -> None:
    """Step ``req`` (admitted) through the scheduler until its stop check ends it."""
    await step(sched, engine, prefill=[req], now=0.1)
    while not req.is_finished:
        await step(sched, engine, decode=[req], now=0.1)


async def alone(prompt: str, max_tokens: int, request_id: str = "r0", **fields: object) -> list[str]:
    engine = make(**fields)
    req = Request(request_id=request_id, prompt=prompt, max_tokens=max_tokens)
    await run_to_end(engine, [req])
    return req.output_tokens


# --------------------------------------------------------------------------- tokenizer


def test_truncated_cl100k_is_lossless_and_in_vocab():
    tok = Tokenizer(1024)
    text = "Größe: 42 × π ≈ 131.9 — naïve café ✓ 漢字"
    ids = tok.encode(text)
    assert all(0 <= i < 1023 for i in ids)
    assert tok.decode(ids) == text
    assert len(ids) > len(Tokenizer(100_000).encode(text))  # fewer merges, more tokens


# --------------------------------------------------------------------------- KV cache and batching


async def test_batched_decode_gives_the_same_tokens_as_one_by_one():
    engine = make()
    reqs = reqs_for(PROMPTS, max_tokens=10)
    await run_to_end(engine, reqs)
    for i, (prompt, req) in enumerate(zip(PROMPTS, reqs)):
        assert req.finish_reason == "length"
        assert req.output_tokens == await alone(prompt, 10)


async def test_a_sequence_joining_at_a_step_boundary_does_not_disturb_the_running_ones():
    engine = make()
    first, late = reqs_for(PROMPTS[:2], max_tokens=9)
    await EngineDriver(engine).prefill([first])
    for _ in range(3):
        await EngineDriver(engine).decode([first])
    await EngineDriver(engine).prefill([late])  # iteration-level batching: joins the running set here
    while live := [s for s in (first, late) if not s.is_finished]:
        await EngineDriver(engine).decode(live)
    assert first.output_tokens == await alone(PROMPTS[0], 9)
    assert late.output_tokens == await alone(PROMPTS[1], 9)


async def test_chunked_prefill_gives_the_same_tokens_as_one_forward():
    assert await alone(PROMPTS[3], 6, prefill_chunk_tokens=5) == await alone(PROMPTS[3], 6)
    engine = make(prefill_chunk_tokens=5)
    reqs = reqs_for(PROMPTS, max_tokens=6)
    await run_to_end(engine, reqs)
    for prompt, req in zip(PROMPTS, reqs):
        assert req.output_tokens == await alone(prompt, 6)


async def test_num_computed_tokens_follows_the_contract():
    engine = make()
    (req,) = reqs_for(PROMPTS[:1], max_tokens=5)
    await EngineDriver(engine).prefill([req])
    assert req.prompt_tokens == len(engine.tokenizer.encode(PROMPTS[0]))
    assert req.num_computed_tokens == req.num_tokens - 1
    await EngineDriver(engine).decode([req])
    assert req.num_computed_tokens == req.num_tokens - 1


async def test_same_seed_same_tokens_and_another_seed_other_tokens():
    assert await alone(PROMPTS[1], 12, seed=7) == await alone(PROMPTS[1], 12, seed=7)
    assert await alone(PROMPTS[1], 12, seed=7) != await alone(PROMPTS[1], 12, seed=8)


async def test_seeded_sampling_is_deterministic_and_independent_of_the_batch():
    sampled = {"temperature": 1.0, "seed": 3}
    engine = make(**sampled)
    reqs = reqs_for(PROMPTS, max_tokens=8)
    await run_to_end(engine, reqs)
    for i, (prompt, req) in enumerate(zip(PROMPTS, reqs)):
        assert req.output_tokens == await alone(prompt, 8, request_id=f"r{i}", **sampled)


async def test_kv_bytes_grow_with_tokens_and_release_frees_them():
    engine = make()
    (req,) = reqs_for(PROMPTS[:1], max_tokens=40)
    assert engine.kv.kv_bytes(req) == 0
    await EngineDriver(engine).prefill([req])
    after_prefill = engine.kv.kv_bytes(req)
    # 2 layers x (K, V) x 64 hidden x 4 bytes per token, whole 4-token blocks.
    per_token = 2 * 2 * 64 * 4
    assert after_prefill == -(-req.num_computed_tokens // 4) * 4 * per_token
    seen = [after_prefill]
    for _ in range(20):
        await EngineDriver(engine).decode([req])
        seen.append(engine.kv.kv_bytes(req))
    assert seen == sorted(seen) and seen[-1] > after_prefill
    assert req.memory_peak_bytes == seen[-1]
    EngineDriver(engine).preempt(req)  # what the scheduler does at a preemption
    assert engine.kv.kv_bytes(req) == 0 and req.num_computed_tokens == 0


# --------------------------------------------------------------------------- preemption


async def test_preempted_sequence_recomputes_and_continues_without_loss_or_repeat():
    engine = make()
    req, other = reqs_for(PROMPTS[1:3], max_tokens=14)
    await EngineDriver(engine).prefill([req, other])
    for _ in range(4):
        await EngineDriver(engine).decode([req, other])
    streamed = list(req.output_tokens)
    EngineDriver(engine).preempt(req)
    assert engine.kv.kv_bytes(req) == 0
    for _ in range(2):  # the other one keeps running while it waits
        await EngineDriver(engine).decode([other])
    await EngineDriver(engine).prefill([req])  # resumed: recompute prompt + streamed tokens
    assert req.recomputed_tokens == req.prompt_tokens + len(streamed) - 1
    while live := [s for s in (req, other) if not s.is_finished]:
        await EngineDriver(engine).decode(live)
    assert req.output_tokens[: len(streamed)] == streamed
    assert len(req.output_tokens) == 14 and req.finish_reason == "length"
    assert req.output_tokens == await alone(PROMPTS[1], 14)
    indexes = [item.index for item in req.output.drain() if isinstance(item, StreamToken)]
    assert indexes == list(range(14))


async def test_swapped_out_kv_tensors_come_back_and_the_sequence_continues_as_if_never_preempted():
    engine = make()
    req, other = reqs_for(PROMPTS[1:3], max_tokens=14, tag="swap")
    await EngineDriver(engine).prefill([req, other])
    for _ in range(4):
        await EngineDriver(engine).decode([req, other])
    held = req.num_computed_tokens
    kv_before = req.engine_state.cache.data[:, :, :, :held].clone()
    payload = engine.kv.export(req)  # what the DRAM tier stores: real tensor bytes and the token ids
    assert payload is not None and len(payload) > kv_before.numel() * kv_before.element_size()
    EngineDriver(engine).preempt(req)
    await EngineDriver(engine).decode([other])
    assert engine.kv.load(req, payload, held) == held
    req.num_computed_tokens = held  # what the memory tiers write after a load
    assert torch.equal(req.engine_state.cache.data[:, :, :, :held], kv_before)
    assert not req.needs_prefill  # straight back to decoding
    while live := [s for s in (req, other) if not s.is_finished]:
        await EngineDriver(engine).decode(live)
    assert req.recomputed_tokens == 0
    assert req.output_tokens == await alone(PROMPTS[1], 14)


async def test_an_agents_next_step_takes_back_only_the_prefix_it_shares_with_the_copy():
    engine = make()
    (first,) = reqs_for(PROMPTS[3:4], max_tokens=4, tag="agent")
    await run_to_end(engine, [first])
    payload = engine.kv.export(first)
    assert payload is not None
    (follow,) = reqs_for([PROMPTS[3] + " And then?"], max_tokens=4, tag="agent-next")
    counted(engine, follow)
    (unrelated,) = reqs_for(["Something else entirely."], max_tokens=4, tag="agent-other")
    restored = engine.kv.load(follow, payload, 10_000)
    follow.num_computed_tokens = restored  # what the memory tiers write after a load
    assert 0 < restored < follow.prompt_tokens and follow.needs_prefill  # the shared prompt prefix only
    assert engine.kv.load(unrelated, payload, 10_000) == 0
    assert engine.kv.load(unrelated, b"not a tensor file", 10_000) == 0
    await run_to_end(engine, [follow])
    assert follow.output_tokens == await alone(PROMPTS[3] + " And then?", 4)


async def test_an_agent_back_from_its_tool_takes_over_its_warm_prefix_through_the_scheduler():
    from switchyard.dispatcher.scheduler import make_scheduler

    engine = make()
    sched = make_scheduler(tiny_config(), engine)
    question = Message("user", "<question>what does the with statement do?</question>")
    tools = [Tool("search_docs", "", '{"type": "object"}')]
    think = counted(engine, Request(request_id="t-think", messages=[question], tools=tools, agent_id="t-agent",
                                    task_type="react_loop", max_tokens=64))
    accept(sched, [think], now=0.0)
    sched.schedule(now=0.0)
    await run_through(sched, engine, think)
    assert think.finish_reason == "tool_calls"
    assert sched.parked == [think] and engine.kv.kv_bytes(think) > 0  # parked by the scheduler's stop check
    call = think.tool_calls[0]
    follow = [question, Message("assistant", "", tool_calls=(call,)),
              Message("tool", "[1] Compound statements\nThe with statement wraps a block.", call.call_id, call.name)]
    back = counted(engine, Request(request_id="t-back", messages=follow, tools=tools, agent_id="t-agent",
                                   task_type="react_loop", max_tokens=64, arrival=0.2))
    sched.resume(back, now=0.2)
    out = sched.schedule(now=0.2)
    assert out.admitted == [back]
    shared = back.num_computed_tokens
    assert 0 < shared < back.prompt_tokens  # the rendered conversation so far, taken from the parked step
    assert engine.kv.kv_bytes(think) == 0  # the parked step's cache was released once the new step took over
    await run_through(sched, engine, back)
    assert back.recomputed_tokens == 0 and back.finish_reason == "stop"
    fresh = make()
    again = Request(request_id="t-fresh", messages=follow, tools=tools, max_tokens=64)
    await run_to_end(fresh, [again])
    assert back.output_tokens == again.output_tokens  # the shared prefix changes nothing in the answer


def test_compaction_shrinks_cache_tensors_to_their_valid_blocks():
    engine = make()
    (req,) = reqs_for(PROMPTS[:1], tag="compact")
    state, _ = engine._state(req)
    cache = engine.model_net.new_cache(engine.params.kv_block_tokens)
    cache.reserve(64)
    cache.length = 5
    state.cache = cache
    assert req.engine_state is state and cache.data.shape[3] == 64
    per_token = cache.nbytes // 64
    assert engine.kv.compact([]) == 0  # only the holders named are compacted
    assert engine.kv.compact([req]) == (64 - 8) * per_token  # 5 tokens keep two 4-token blocks
    assert cache.data.shape[3] == 8 and engine.kv.compact([req]) == 0


async def parked_think(prefix: str):
    """(engine, scheduler, question, tools, think): a react_loop agent's first step on the torch engine, run to
    its tool call and parked (``<prefix>-think`` of agent ``<prefix>-agent``)."""
    from switchyard.dispatcher.scheduler import make_scheduler

    engine = make()
    sched = make_scheduler(tiny_config(), engine)
    question = Message("user", "<question>what does the with statement do?</question>")
    tools = [Tool("search_docs", "", '{"type": "object"}')]
    think = counted(engine, Request(request_id=f"{prefix}-think", messages=[question], tools=tools,
                                    agent_id=f"{prefix}-agent", task_type="react_loop", max_tokens=64))
    accept(sched, [think], now=0.0)
    sched.schedule(now=0.0)
    await run_through(sched, engine, think)
    assert sched.parked == [think]
    return engine, sched, question, tools, think


async def test_a_parked_steps_compacted_kv_leaves_the_kv_budget():
    """The parking kept each parked step's bytes as read when it parked, beside the engine's own count of them.
    Compaction cuts a parked step's cache tensor to its valid blocks, and the engine frees those bytes; the
    parking went on counting them in the KV budget until the agent came back or expired, refusing admissions
    for memory the device had back. The parking now reads the engine's count (``kv.kv_bytes``), the one owner."""
    from switchyard.dispatcher.scheduler.base import SchedulerOutput

    engine, sched, _, _, think = await parked_think("t")
    budget = sched.kv_budget
    assert budget is not None
    cache = think.engine_state.cache
    cache.reserve(cache.data.shape[3] + 64)  # parked with an allocation past its valid blocks
    sched.parking.park(think, 0.5)
    held, before = budget.held_bytes, engine.kv.kv_bytes(think)
    assert sched.parking.kv_bytes == before
    sched.score = 0.0  # an idle GPU: the HBM scan compacts
    sched.hbm_scan(1.0, SchedulerOutput())
    freed = before - engine.kv.kv_bytes(think)
    assert freed > 0 and sched.counters.defrag_freed_bytes == freed
    assert sched.parking.kv_bytes == engine.kv.kv_bytes(think)
    assert budget.held_bytes == held - freed


# --------------------------------------------------------------------------- limits


async def test_reaching_max_seq_len_finishes_with_length():
    engine = make(max_seq_len=48)
    (req,) = reqs_for(PROMPTS[3:4], max_tokens=500)
    await run_to_end(engine, [req])
    assert req.finish_reason == "length"
    assert req.prompt_tokens + len(req.output_tokens) == 48


async def test_prompt_longer_than_max_seq_len_fails_naming_prompt_tokens_and_the_limit():
    engine = make(max_seq_len=32)
    long, short = reqs_for([PROMPTS[3] * 3, PROMPTS[2]], max_tokens=4)
    await EngineDriver(engine).prefill([long, short])
    assert long.status is RequestStatus.FINISHED_ERROR and long.finish_reason is None
    assert len(short.output_tokens) == 1
    item = long.output.drain()[0]
    assert isinstance(item, StreamError) and isinstance(item.error, InvalidArgument)
    assert item.error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_tokens" in str(item.error) and "31" in str(item.error)
    assert engine.kv.kv_bytes(long) == 0  # freed when it ended


# --------------------------------------------------------------------------- tools, weights, factory


async def test_tools_follow_the_sim_policy_through_the_model():
    tools = [Tool("search_docs"), Tool("calculator")]
    engine = make()
    req = Request(request_id="t", prompt="What is 17 * 3?", tools=tools, max_tokens=200)
    await run_to_end(engine, [req])
    plan = plan_reply(req.prompt, [], tools)
    assert req.finish_reason == "tool_calls"
    assert req.tool_calls == plan.tool_calls
    assert "".join(req.output_tokens) == "".join(plan.tokens)


async def test_after_a_tool_result_the_answer_streams_as_text():
    tools = [Tool("search_docs")]
    result = "[1] The with statement\nThe with statement wraps a block in a context manager."
    messages = [
        Message("user", "<question>How does the with statement work?</question>"),
        Message("tool", result, tool_call_id="c1", name="search_docs"),
    ]
    engine = make()
    req = Request(request_id="a", messages=messages, tools=tools, max_tokens=200)
    await run_to_end(engine, [req])
    plan = plan_reply("", messages, tools)
    assert req.finish_reason == "stop" and not req.tool_calls
    streamed = [item.text for item in req.output.drain() if isinstance(item, StreamToken)]
    assert "".join(streamed) == plan.text


async def test_a_warm_prefix_the_engine_no_longer_holds_is_recomputed_and_counted():
    engine, sched, question, tools, think = await parked_think("w")
    think.engine_state.cache = None  # the parked step's cache is gone from the engine (the parking says it is warm)
    call = think.tool_calls[0]
    follow = [question, Message("assistant", "", tool_calls=(call,)),
              Message("tool", "[1] Compound statements\nThe with statement wraps a block.", call.call_id, call.name)]
    back = counted(engine, Request(request_id="w-back", messages=follow, tools=tools, agent_id="w-agent",
                                   task_type="react_loop", max_tokens=64, arrival=0.2))
    sched.resume(back, now=0.2)
    warm = back.num_computed_tokens  # the parking's warm prefix
    assert sched.schedule(now=0.2).admitted == [back]
    assert warm > 0 and back.num_computed_tokens == 0 and back.recomputed_tokens == warm  # nothing shared
    await step(sched, engine, prefill=[back], now=0.1)
    assert back.num_computed_tokens == back.prompt_tokens  # the whole prompt computed again
    while not back.is_finished:
        await step(sched, engine, decode=[back], now=0.1)
    assert back.finish_reason == "stop"


async def test_checkpoint_round_trip_and_shape_mismatch(tmp_path):
    engine = make(seed=5)
    path = tmp_path / "tiny.pt"
    save_checkpoint(engine.model_net, path)
    assert await alone(PROMPTS[0], 8, checkpoint=str(path)) == await alone(PROMPTS[0], 8, seed=5)
    with pytest.raises(ValueError, match="d_model 64 \\(config 128\\)"):
        make(checkpoint=str(path), d_model=128)


# --------------------------------------------------------------------------- prefill between layers


async def _with_core_between_layers(engine: TorchEngine, batch: list[Request], core: list[Request]) -> object:
    """One decode step of ``batch`` held after its first layer until ``core`` waits in the slot, then run."""
    import threading

    entered, go = threading.Event(), threading.Event()

    def gate(module, args, output):  # noqa: ANN001, ANN202 - a torch forward hook
        if not go.is_set():
            entered.set()
            go.wait(30)

    handle = engine.model_net.blocks[0].register_forward_hook(gate)
    try:
        step = asyncio.create_task(EngineDriver(engine).decode(batch))
        assert await asyncio.to_thread(entered.wait, 30)  # the worker is between layers 0 and 1
        nested = asyncio.create_task(EngineDriver(engine).between_layers(core))
        await asyncio.sleep(0)  # it reached the slot (nothing awaited before)
        go.set()
        await step
        return await nested
    finally:
        go.set()
        handle.remove()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_a_core_prefill_between_layers_leaves_every_token_as_without_it(temperature):
    engine = make(n_layers=3, temperature=temperature, prefill_chunk_tokens=8)
    batch = reqs_for(PROMPTS[:3], max_tokens=7, tag="b")
    core = [Request(request_id="core", prompt=PROMPTS[3], max_tokens=7)]
    await EngineDriver(engine).prefill(batch)
    busy = engine.busy_seconds
    assert await _with_core_between_layers(engine, batch, core) is not None
    assert engine.busy_seconds > busy
    assert len(core[0].output_tokens) == 1 and all(len(s.output_tokens) == 2 for s in batch)
    assert core[0].first_token_at <= min(s.last_token_at for s in batch)  # out before the step's tokens
    everyone = [*batch, *core]
    while live := [s for s in everyone if not s.is_finished]:
        await EngineDriver(engine).decode(live)  # the core request decodes with the batch from the next step
    for req, prompt in zip(everyone, [*PROMPTS[:3], PROMPTS[3]]):
        assert req.output_tokens == await alone(prompt, 7, request_id=req.request_id, n_layers=3,
                                                temperature=temperature, prefill_chunk_tokens=8)
        assert req.num_computed_tokens == req.engine_state.cache.length


async def test_no_prefill_between_layers_without_a_forward_in_flight():
    engine = make()
    core = Request(request_id="core", prompt=PROMPTS[0], max_tokens=4)
    assert await EngineDriver(engine).between_layers([core]) is None
    assert core.output_tokens == [] and engine.kv.kv_bytes(core) == 0


def test_a_device_it_cannot_run_on_is_named_with_its_key():
    """'gpu' and 'cuda:x' loaded and failed the dispatcher's start in torch's words ("Expected one of cpu, cuda,
    ... device type at start of device string: gpu"), and cuda on a host without it as "Torch not compiled with
    CUDA enabled": none named torch.device."""
    from pydantic import ValidationError

    from switchyard.common.config import TorchEngineConfig
    from switchyard.dispatcher.engines.torch_model import resolve_device

    for name in ("gpu", "cuda:x"):
        with pytest.raises(ValidationError, match="auto, cpu, cuda or cuda:N"):
            TorchEngineConfig(device=name)
    with pytest.raises(ValueError, match=r"torch.device 'cuda:999': this host has \d+ CUDA device\(s\)"):
        resolve_device("cuda:999")


def test_make_engine_builds_the_torch_engine():
    config = tiny_config().with_overrides(**{"dispatcher.engine": "torch"})
    engine = make_engine(config)
    assert isinstance(engine, TorchEngine) and engine.model == "torch-tiny"


# --------------------------------------------------------------------------- over gRPC


async def test_dispatcher_with_the_torch_engine_streams_tokens_then_done():
    config = tiny_config().with_overrides(
        **{"dispatcher.engine": "torch", "batching.flush_interval_ms": 2}
    )
    service = DispatcherService(config)
    assert isinstance(service.engine, TorchEngine)
    async with running([service], config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)

            async def generate(request_id: str, prompt: str) -> list[agent_pb2.GenerateChunk]:
                request = agent_pb2.GenerateRequest(request_id=request_id, prompt=prompt, max_tokens=6)
                return [c async for c in stub.Generate(request, timeout=30)]

            chunks, *others = await asyncio.gather(*(generate(f"g{i + 1}", p) for i, p in enumerate(PROMPTS[:3])))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                too_long = agent_pb2.GenerateRequest(request_id="long", prompt="word " * 400, max_tokens=4)
                _ = [c async for c in stub.Generate(too_long, timeout=30)]
        finally:
            await channel.close()
    tokens = [c.token for c in chunks if c.HasField("token")]
    done = chunks[-1].done
    assert positions_follow_on(tokens) and token_count(tokens) == 6
    assert "".join(t.text for t in tokens) == "".join(await alone(PROMPTS[0], 6, request_id="g1"))
    assert done.finish_reason == "length" and done.model == "torch-tiny"
    assert done.usage.completion_tokens == 6
    assert done.usage.prompt_tokens == len(Tokenizer(1024).encode(PROMPTS[0]))
    assert done.memory_peak_bytes > 0
    for i, other in enumerate(others, start=1):  # batched with g1 through the engine loop
        text = "".join(c.token.text for c in other if c.HasField("token"))
        assert text == "".join(await alone(PROMPTS[i], 6, request_id=f"g{i + 1}"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_tokens" in err.value.details() and "255" in err.value.details()


@pytest.mark.parametrize("mode", ["layer", "step"])
async def test_core_requests_arriving_mid_step_over_grpc_get_the_same_tokens_either_way(mode):
    config = tiny_config(n_layers=3).with_overrides(
        **{"dispatcher.engine": "torch", "batching.flush_interval_ms": 2, "scheduler.core_preemption": mode}
    )
    service = DispatcherService(config)
    async with running([service], config.server) as srv:
        channel = open_channel(f"127.0.0.1:{srv.port}")
        try:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)
            first = asyncio.Event()

            async def generate(request_id: str, prompt: str, priority: int, max_tokens: int) -> str:
                request = agent_pb2.GenerateRequest(request_id=request_id, prompt=prompt, priority=priority,
                                                    max_tokens=max_tokens)
                text = ""
                async for chunk in stub.Generate(request, timeout=60):
                    if chunk.HasField("token"):
                        text += chunk.token.text
                        first.set()
                return text

            batch = [asyncio.create_task(generate(f"b{i}", p, agent_pb2.BATCH, 16)) for i, p in enumerate(PROMPTS[:3])]
            await first.wait()  # the batch decodes: the core requests arrive while its steps run
            core = await asyncio.gather(*(generate(f"c{i}", PROMPTS[3 - i], agent_pb2.CORE, 4) for i in range(2)))
            texts = await asyncio.gather(*batch)
        finally:
            await channel.close()
    for i, prompt in enumerate(PROMPTS[:3]):
        assert texts[i] == "".join(await alone(prompt, 16, request_id=f"b{i}", n_layers=3))
    for i in range(2):
        assert core[i] == "".join(await alone(PROMPTS[3 - i], 4, request_id=f"c{i}", n_layers=3))


async def test_a_swapped_agents_kv_restored_ahead_of_its_turn_is_taken_over_warm(redis_db):
    """The torch engine's real KV tensors through a tool-wait swap (a real Redis as the DRAM tier), the
    planned restore into the agent's released step, and the next step's warm take-over: the answer is the
    one a fresh engine gives."""
    from switchyard.common.dram import DramClient
    from switchyard.dispatcher.scheduler import make_scheduler
    from switchyard.dispatcher.scheduler.tool_wait import Decision
    from switchyard.dispatcher.tiers import KvStore, MemoryTiers

    engine = make()
    config = tiny_config().with_overrides(**redis_db.overrides)
    tiers = MemoryTiers(config.memory, config.scheduler.priority_boost, engine.kv,
                        KvStore(DramClient(redis_db.dram_config), config.memory.dram.kv_ttl_s))
    sched = make_scheduler(config, engine, tiers=tiers)
    question = Message("user", "<question>what does the with statement do?</question>")
    tools = [Tool("search_docs", "", '{"type": "object"}')]
    think = counted(engine, Request(request_id="p-think", messages=[question], tools=tools, agent_id="p-agent",
                                    task_type="react_loop", max_tokens=64))
    accept(sched, [think], now=0.0)
    sched.schedule(now=0.0)
    await run_through(sched, engine, think)
    assert sched.parked == [think]
    decided = sched.tool_wait("p-agent", 86_400.0, now=0.2, tool="search_docs")
    assert decided is not None and decided.decision is Decision.SWAP
    assert sched.parked == [] and engine.kv.kv_bytes(think) == 0  # out of HBM
    due = sched.on_idle(0.2 + decided.restore_at_s)
    assert due == [think]
    restored = await tiers.prefetch(think)
    assert restored > 0 and sched.prefetched(think, restored, 0.2 + decided.warm_at_s)
    assert sched.parked == [think] and engine.kv.kv_bytes(think) > 0  # the tensors are back
    call = think.tool_calls[0]
    follow = [question, Message("assistant", "", tool_calls=(call,)),
              Message("tool", "[1] Compound statements\nThe with statement wraps a block.", call.call_id, call.name)]
    back = counted(engine, Request(request_id="p-back", messages=follow, tools=tools, agent_id="p-agent",
                                   task_type="react_loop", max_tokens=64, arrival=86_400.2))
    sched.resume(back, now=86_400.2)
    out = sched.schedule(now=86_400.2)
    assert out.admitted == [back] and out.restore == []
    assert 0 < back.num_computed_tokens < back.prompt_tokens  # taken over from the restored step
    assert sched.counters.tool_resumes[("search_docs", "warm")] == 1
    await run_through(sched, engine, back)
    assert back.recomputed_tokens == 0
    fresh = make()
    again = Request(request_id="p-fresh", messages=follow, tools=tools, max_tokens=64)
    await run_to_end(fresh, [again])
    assert back.output_tokens == again.output_tokens
    await tiers.aclose()
