"""The sim engine: latency-model arithmetic, extractive text, tool-call policy, preemption resume."""

from __future__ import annotations

import json

import pytest

from switchyard.common.config import SwitchyardConfig
from switchyard.dispatcher.engines import make_engine
from switchyard.dispatcher.engines.base import StepEngine
from switchyard.dispatcher.engines.driver import EngineDriver
from switchyard.dispatcher.engines.sim import (
    SimEngine,
    decode_seconds,
    extractive_answer,
    find_arithmetic,
    parse_passages,
    plan_reply,
    prefill_seconds,
)
from switchyard.dispatcher.output import StreamDone, StreamToken, StreamToolCall
from switchyard.dispatcher.request import Message, Request, Tool

pytestmark = pytest.mark.no_gpu

CONTEXT_PROMPT = """Answer from the passages and cite them as [n].

<context>
[1] The with statement
The with statement is used to wrap the execution of a block with methods defined by a context manager. This allows common try/except/finally usage patterns to be encapsulated for convenient reuse.
[2] The if statement
The if statement is used for conditional execution. It selects exactly one of the suites.
</context>
<question>How does the with statement wrap a block?</question>"""

TOOLS = [Tool("search_docs"), Tool("calculator")]


def fast_config(**overrides: object) -> SwitchyardConfig:
    """Small latencies so engine tests take milliseconds."""
    base = {
        "sim.prefill_overhead_ms": 0.2,
        "sim.prefill_per_token_ms": 0.001,
        "sim.decode_base_ms": 0.1,
        "sim.decode_per_seq_ms": 0.01,
    }
    return SwitchyardConfig().with_overrides(**{**base, **overrides})


def drain(req: Request) -> list[object]:
    return req.output.drain()


async def run_to_end(engine: SimEngine, reqs: list[Request]) -> None:
    await EngineDriver(engine).prefill(reqs)
    while live := [s for s in reqs if not s.is_finished]:
        await EngineDriver(engine).decode(live)


# --------------------------------------------------------------------------- latency model


def test_latency_model_defaults_match_the_documented_7b_h100_numbers() -> None:
    params = SwitchyardConfig().sim
    # TTFT alone = 5 ms + 1000 tokens x 0.025 ms
    assert prefill_seconds(params, 1000) == pytest.approx(0.030)
    # one step of 32 sequences = 4.2 ms + 32 x 0.15 ms: batching decode is nearly free
    assert decode_seconds(params, 32) == pytest.approx(0.009)
    assert decode_seconds(params, 1) == pytest.approx(0.00435)
    assert 32 * decode_seconds(params, 1) > 10 * decode_seconds(params, 32)
    # 7B fp16 KV: 2 x 32 layers x 4096 x 2 bytes per token
    assert params.kv_bytes_per_token == 2 * 32 * 4096 * 2


async def test_busy_time_is_the_modelled_cost_of_each_step() -> None:
    config = fast_config()
    engine = SimEngine(config)
    reqs = [Request(f"r{i}", prompt=CONTEXT_PROMPT, prompt_tokens=100 + i, max_tokens=3) for i in range(4)]
    await EngineDriver(engine).prefill(reqs)
    expected = prefill_seconds(config.sim, sum(s.prompt_tokens for s in reqs))
    assert engine.busy_seconds == pytest.approx(expected)
    await EngineDriver(engine).decode(reqs)
    expected += decode_seconds(config.sim, 4)
    assert engine.busy_seconds == pytest.approx(expected)
    assert all(s.num_computed_tokens == s.num_tokens - 1 for s in reqs)
    assert engine.kv.kv_bytes(reqs[0]) == reqs[0].num_computed_tokens * config.sim.kv_bytes_per_token


def test_a_zero_cost_engine_has_no_decode_bound() -> None:
    zero = SwitchyardConfig().with_overrides(**{"sim.decode_base_ms": 0.0, "sim.decode_per_seq_ms": 0.0})
    assert SimEngine(zero).decode_bound_tokens_per_s(32) == 0.0
    assert SimEngine(SwitchyardConfig()).decode_bound_tokens_per_s(32) == pytest.approx(32 / 0.009)


def test_factory_names_an_engine_that_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from switchyard.dispatcher import engines

    def missing() -> type:
        import switchyard.dispatcher.engines.not_there  # noqa: F401 - a module that is not installed

        raise AssertionError("unreachable")

    monkeypatch.setitem(engines._ENGINES, "torch", missing)
    with pytest.raises(engines.EngineUnavailable, match="torch engine not installed") as err:
        make_engine(SwitchyardConfig().with_overrides(**{"dispatcher.engine": "torch"}))
    assert "SWITCHYARD_ENGINE" in str(err.value)


def test_factory_builds_the_sim_engine_by_default() -> None:
    engine = make_engine(SwitchyardConfig())
    assert isinstance(engine, SimEngine)
    assert isinstance(engine, StepEngine)
    assert engine.model == "sim-7b"


# --------------------------------------------------------------------------- text


def test_passages_are_split_at_numbered_titles() -> None:
    context = CONTEXT_PROMPT.split("<context>")[1].split("</context>")[0]
    passages = parse_passages(context)
    assert [(p.number, p.title) for p in passages] == [(1, "The with statement"), (2, "The if statement")]
    assert passages[1].text.startswith("The if statement is used")


def test_answer_is_extracted_from_the_best_matching_sentences_with_citations() -> None:
    reply = plan_reply(CONTEXT_PROMPT, [], [])
    assert reply.finish_reason == "stop" and not reply.tool_calls
    assert reply.text.startswith(
        "The with statement is used to wrap the execution of a block with methods defined by a context manager. [1]"
    )
    assert "[2]" in reply.text  # "statement" also occurs there, ranked after
    assert "".join(reply.tokens) == reply.text
    assert plan_reply(CONTEXT_PROMPT, [], []) == reply  # deterministic


def test_ties_break_by_passage_then_sentence_order() -> None:
    passages = parse_passages("[1] A\nApples are red. Apples are sweet.\n[2] B\nApples are green.")
    assert extractive_answer("apples", passages) == "Apples are red. [1] Apples are sweet. [1] Apples are green. [2]"


def test_without_context_the_answer_is_derived_from_the_question() -> None:
    reply = plan_reply("What is the airspeed of a swallow?", [], [])
    assert "airspeed swallow" in reply.text
    assert reply.text == plan_reply("What is the airspeed of a swallow?", [], []).text


def test_chat_messages_carry_context_and_question() -> None:
    system, question = CONTEXT_PROMPT.split("<question>")
    messages = [Message("system", system), Message("user", "<question>" + question)]
    assert plan_reply("", messages, []).text == plan_reply(CONTEXT_PROMPT, [], []).text


# --------------------------------------------------------------------------- tool calls


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("What is 12 * (3 + 4)?", "12 * (3 + 4)"),
        ("compute 2**10 % 7 please", "2**10 % 7"),
        ("1.5 / 3 and 4 - 1", "1.5 / 3"),
        ("Python 3.12 was released in 2023", None),
    ],
)
def test_arithmetic_expressions_are_found(text: str, expected: str | None) -> None:
    assert find_arithmetic(text) == expected


def test_tool_policy_searches_then_calculates_then_answers() -> None:
    question = "How does the with statement work, and what is 6 * 7?"
    messages = [Message("user", f"<question>{question}</question>")]

    first = plan_reply("", messages, TOOLS)
    assert first.finish_reason == "tool_calls"
    [search] = first.tool_calls
    assert search.name == "search_docs"
    assert json.loads(search.arguments_json) == {"query": question}
    assert search.call_id.startswith("call_")

    messages += [
        Message("assistant", ""),
        Message("tool", "[1] The with statement (compound_stmts)\nThe with statement wraps a block.",
                tool_call_id=search.call_id, name="search_docs"),
    ]
    second = plan_reply("", messages, TOOLS)
    [calc] = second.tool_calls
    assert calc.name == "calculator"
    assert json.loads(calc.arguments_json) == {"expression": "6 * 7"}

    messages += [Message("assistant", ""), Message("tool", "42", tool_call_id=calc.call_id, name="calculator")]
    final = plan_reply("", messages, TOOLS)
    assert final.finish_reason == "stop" and not final.tool_calls
    assert final.text.startswith("6 * 7 = 42.")
    assert "The with statement wraps a block. [1]" in final.text


def test_calculator_is_called_first_when_search_is_not_offered() -> None:
    reply = plan_reply("", [Message("user", "what is (2 + 3) * 4")], [Tool("calculator")])
    assert [c.name for c in reply.tool_calls] == ["calculator"]
    assert plan_reply("", [Message("user", "hello there")], [Tool("calculator")]).finish_reason == "stop"


async def test_a_tool_call_turn_streams_the_call_not_its_argument_text() -> None:
    engine = SimEngine(fast_config())
    req = Request("t", messages=[Message("user", "what is with?")], tools=TOOLS, prompt_tokens=5, max_tokens=64)
    await run_to_end(engine, [req])
    items = drain(req)
    assert not [i for i in items if isinstance(i, StreamToken)]
    assert isinstance(items[-2], StreamToolCall) and items[-2].call.name == "search_docs"
    assert items[-1] == StreamDone("tool_calls")
    assert req.completion_tokens() == len(items[-2].call.arguments_json.split(" ")) > 0


# --------------------------------------------------------------------------- engine behaviour


async def test_generation_stops_at_max_tokens() -> None:
    engine = SimEngine(fast_config())
    req = Request("m", prompt=CONTEXT_PROMPT, prompt_tokens=60, max_tokens=4)
    await run_to_end(engine, [req])
    assert req.finish_reason == "length"
    assert len(req.output_tokens) == 4
    tokens = [i for i in drain(req) if isinstance(i, StreamToken)]
    assert [t.index for t in tokens] == [0, 1, 2, 3]


async def test_preempted_sequence_resumes_without_losing_or_repeating_tokens() -> None:
    engine = SimEngine(fast_config())
    straight = Request("a", prompt=CONTEXT_PROMPT, prompt_tokens=60, max_tokens=12)
    await run_to_end(engine, [straight])

    req = Request("b", prompt=CONTEXT_PROMPT, prompt_tokens=60, max_tokens=12)
    await EngineDriver(engine).prefill([req])
    await EngineDriver(engine).decode([req])
    await EngineDriver(engine).decode([req])  # 3 tokens streamed
    EngineDriver(engine).preempt(req)
    assert engine.kv.kv_bytes(req) == 0 and req.needs_prefill
    await EngineDriver(engine).prefill([req])  # prompt + the 3 tokens computed, then the 4th token
    assert req.recomputed_tokens == 60 + 2  # the 3rd token's KV had not been computed before
    while not req.is_finished:
        await EngineDriver(engine).decode([req])
    assert req.output_tokens == straight.output_tokens
    tokens = [i for i in drain(req) if isinstance(i, StreamToken)]
    assert [t.index for t in tokens] == list(range(len(straight.output_tokens)))
    assert req.preemptions == 1
    assert req.memory_peak_bytes == (60 + 11) * engine.params.kv_bytes_per_token


# --------------------------------------------------------------------------- prefill between layers


async def test_a_prefill_between_layers_gets_its_first_token_before_the_step_in_flight_ends() -> None:
    import asyncio

    config = fast_config(**{"sim.decode_base_ms": 200.0, "sim.layers": 32, "sim.prefix_caching": False})
    engine = SimEngine(config)
    assert engine.supports_layer_preemption
    batch = [Request(f"b{i}", prompt=CONTEXT_PROMPT, prompt_tokens=60, max_tokens=8) for i in range(3)]
    await EngineDriver(engine).prefill(batch)
    busy = engine.busy_seconds
    step = asyncio.create_task(EngineDriver(engine).decode(batch))
    await asyncio.sleep(0)  # the step is in flight
    core = Request("core", prompt=CONTEXT_PROMPT, prompt_tokens=40, max_tokens=8)
    assert await EngineDriver(engine).between_layers([core]) is not None
    assert len(core.output_tokens) == 1 and not core.needs_prefill
    assert not step.done() and all(len(s.output_tokens) == 1 for s in batch)  # the batch's tokens wait
    await step
    assert all(len(s.output_tokens) == 2 for s in batch)
    assert core.first_token_at is not None and core.first_token_at < min(s.last_token_at for s in batch)
    # busy time: the step and the prefill, each as modelled
    assert engine.busy_seconds == pytest.approx(busy + decode_seconds(config.sim, 3) + prefill_seconds(config.sim, 40))
    # the core request then decodes with the batch
    await EngineDriver(engine).decode([*batch, core])
    assert core.output_tokens == plan_reply(CONTEXT_PROMPT, [], []).tokens[:2]


async def test_no_prefill_between_layers_without_a_step_in_flight_or_a_layer_boundary() -> None:
    import asyncio

    engine = SimEngine(fast_config())
    core = Request("core", prompt=CONTEXT_PROMPT, prompt_tokens=40, max_tokens=4)
    assert await EngineDriver(engine).between_layers([core]) is None  # nothing runs
    one_layer = SimEngine(fast_config(**{"sim.decode_base_ms": 50.0, "sim.layers": 1}))
    [batch] = [Request("b", prompt=CONTEXT_PROMPT, prompt_tokens=60, max_tokens=4)]
    await EngineDriver(one_layer).prefill([batch])
    step = asyncio.create_task(EngineDriver(one_layer).decode([batch]))
    await asyncio.sleep(0)
    assert await EngineDriver(one_layer).between_layers([core]) is None  # one layer: no boundary inside a step
    await step
    assert core.output_tokens == [] and core.needs_prefill  # no token: a newcomer of the next step


def test_a_missing_engine_names_this_tree_extra_not_an_index_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """The project is not on PyPI (a package of its name there is another project)."""
    from switchyard.dispatcher import engines

    def missing() -> type:
        import switchyard.dispatcher.engines.not_there  # noqa: F401 - a module that is not installed

        raise AssertionError("unreachable")

    monkeypatch.setitem(engines._ENGINES, "torch", missing)
    with pytest.raises(engines.EngineUnavailable) as err:
        make_engine(SwitchyardConfig().with_overrides(**{"dispatcher.engine": "torch"}))
    assert "pip install -e '.[torch]'" in str(err.value)
    assert "switchyard[" not in str(err.value)
