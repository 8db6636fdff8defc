"""Label values come from bounded sets, whatever callers and models send; known counters start at 0."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client import REGISTRY

from switchyard.api import agent_pb2, agent_pb2_grpc
from switchyard.common.config import UpstreamConfig, SwitchyardConfig
from switchyard.common.metrics import OTHER, bounded
from switchyard.common.server import start_server
from switchyard.dispatcher.service import DispatcherService
from switchyard.gateway.models import model_label
from switchyard.common.channels import open_channel

pytestmark = pytest.mark.no_gpu


def label_values(metric: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name.startswith(metric) and label in sample.labels
    }


def test_bounded_keeps_known_values_and_folds_the_rest() -> None:
    assert bounded("chat", ("chat",)) == "chat"
    assert bounded("", ("chat",)) == "unknown"
    assert bounded(f"tool_{uuid.uuid4().hex}", ("search_docs",)) == OTHER


def test_gateway_model_labels_are_the_configured_models_or_other() -> None:
    config = UpstreamConfig(model_map={"sonnet": "claude-sonnet-4-5"})
    assert model_label("claude-sonnet-4-5", config) == "claude-sonnet-4-5"
    assert model_label("gpt-4o-mini", config) == "gpt-4o-mini"  # the fallback
    assert model_label("made-up-model-" + uuid.uuid4().hex, config) == OTHER


async def test_adversarial_task_types_and_models_add_no_series() -> None:
    fast = {"sim.prefill_overhead_ms": 0.1, "sim.decode_base_ms": 0.1,
            "limits.default_context_window_tokens": 4096}
    config = SwitchyardConfig().with_overrides(**fast)
    service = DispatcherService(config)
    srv = await start_server([service], "127.0.0.1", 0, config.server)
    try:
        async with open_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = agent_pb2_grpc.InferenceServiceStub(channel)

            async def one(i: int) -> None:
                request = agent_pb2.GenerateRequest(prompt="<question>what is a list?</question>", max_tokens=3,
                                                    task_type=f"type-{uuid.uuid4().hex[:8]}")
                [c async for c in stub.Generate(request, timeout=30)]

            await asyncio.gather(*(one(i) for i in range(30)))
    finally:
        await srv.stop(1.0)
    assert label_values("switchyard_expected_compute_score", "task_type") <= {
        "rag_answer", "chat", "react_loop", "unknown", "other"}


def test_counters_with_a_known_label_set_start_at_zero() -> None:
    SwitchyardConfig()  # the metrics modules are imported with the dispatcher
    import switchyard.dispatcher.scheduler.core  # noqa: F401

    for cls in ("core", "normal", "batch"):
        assert REGISTRY.get_sample_value("switchyard_preemptions_total", {"priority_class": cls}) is not None
    for resume in ("preempted", "warm", "restored", "cold"):
        assert REGISTRY.get_sample_value("switchyard_resumes_total", {"resume": resume}) is not None
    for reason in ("admission_wave", "compute_score", "kv_memory", "upstream_concurrency"):
        assert REGISTRY.get_sample_value("switchyard_admissions_refused_total", {"reason": reason}) is not None


def test_metric_names_follow_prometheus_conventions() -> None:
    # every service's metrics, as promtool check metrics would read them
    import switchyard.dispatcher.adaptive_limit  # noqa: F401
    import switchyard.dispatcher.metrics  # noqa: F401
    import switchyard.gateway.metrics  # noqa: F401
    import switchyard.orchestrator.metrics  # noqa: F401
    import switchyard.retrieval.service  # noqa: F401

    reserved = ("_count", "_sum", "_bucket", "_total", "_created")
    for family in REGISTRY.collect():
        if not family.name.startswith("switchyard_"):
            continue
        if family.type == "gauge":
            assert not family.name.endswith(reserved), f"{family.name}: a gauge may not use a reserved suffix"
        if family.type in ("gauge", "counter", "histogram"):
            assert family.documentation, f"{family.name}: no help text"


def labelled_families_without_series(kind: str, suffix: str, sample_suffix: str) -> list[str]:
    """The ``switchyard_*`` metric families of ``kind`` with labels that have no ``sample_suffix`` series yet,
    after importing every service module and building the gateway client as the dispatcher does (``suffix``:
    the name a family's collector is registered under)."""
    import importlib
    import pkgutil

    import switchyard
    from switchyard.gateway.client import GatewayClient

    for module in pkgutil.walk_packages(switchyard.__path__, "switchyard."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    GatewayClient(SwitchyardConfig().upstream)
    missing = []
    for family in REGISTRY.collect():
        collector = REGISTRY._names_to_collectors.get(family.name + suffix)
        if family.type != kind or not family.name.startswith("switchyard_") or collector is None:
            continue
        if getattr(collector, "_labelnames", ()) and not any(s.name.endswith(sample_suffix) for s in family.samples):
            missing.append(family.name)
    return missing


def test_every_labelled_counter_of_the_services_starts_at_zero() -> None:
    """Each ``switchyard_*`` counter with labels has its known series from the start (0), so that a rate over
    them is defined before the first event: after importing every service module and building the gateway
    client as the dispatcher does."""
    assert labelled_families_without_series("counter", "_total", "_total") == []


async def test_model_labels_are_the_upstream_ids_the_gateway_calls_each_counted_from_zero() -> None:
    """default_model and fallback_model go through model_map as a request's model does (GatewayClient.models_for):
    the labels are the ids they resolve to. The fallback counter was started at 0 for the alias ('cheap'), a series
    that never moves, and its real pair (default, the fallback's upstream id) appeared only at its first fallback."""
    from switchyard.gateway.client import GatewayClient

    upstream = "cheap-upstream-" + uuid.uuid4().hex[:8]
    config = UpstreamConfig(fallback_model="cheap", model_map={"cheap": upstream}, api_key_required=False)
    assert model_label(upstream, config) == upstream
    assert model_label("cheap", config) == OTHER  # an alias is never an upstream id
    async with GatewayClient(config):
        pass
    assert REGISTRY.get_sample_value("switchyard_gateway_fallbacks_total",
                                     {"model": "claude-sonnet-4-5", "fallback_model": upstream}) == 0.0
    assert REGISTRY.get_sample_value("switchyard_gateway_fallbacks_total",
                                     {"model": "claude-sonnet-4-5", "fallback_model": "cheap"}) is None


def test_every_labelled_histogram_of_the_services_starts_at_zero() -> None:
    """A histogram's buckets and count are counters: with a known label set its series are there from the start,
    so that a rate over them sees the first observation. The orchestrator's task duration and TTFT by task type,
    its stage durations and the gateway's upstream TTFT by model appeared only with their first observation
    (the queue-wait histogram started at 0 already)."""
    from switchyard.common.config import ProgramConfig
    from switchyard.common.metrics import TOOL_NAMES
    from switchyard.orchestrator.program import ToolDurations

    ToolDurations(ProgramConfig(), TOOL_NAMES)  # the orchestrator's registered tools, as it builds them
    assert labelled_families_without_series("histogram", "_bucket", "_count") == []
    for task_type in ("rag_answer", "chat", "react_loop"):
        assert REGISTRY.get_sample_value("switchyard_task_ttft_seconds_count", {"task_type": task_type}) is not None
    assert REGISTRY.get_sample_value("switchyard_stage_duration_seconds_count", {"stage": "tool:search_docs"}) is not None


def test_every_stage_the_workflows_run_is_a_known_stage_label() -> None:
    """The stage names started at 0 (WORKFLOW_STAGES) are the ones the workflows run."""
    import re
    from pathlib import Path

    from switchyard.orchestrator.metrics import WORKFLOW_STAGES

    folder = Path(__file__).resolve().parent.parent / "services" / "switchyard" / "orchestrator"
    run = {m for path in folder.glob("*.py") for m in re.findall(r'\.stage\("([a-z_]+)"', path.read_text())}
    assert run and run <= set(WORKFLOW_STAGES), run - set(WORKFLOW_STAGES)


def test_the_tool_wait_label_sets_are_the_schedulers_own() -> None:
    """The tool-wait counters start at 0 for exactly the labels the scheduler counts by: its decisions
    (tool_wait.Decision), resume kinds (RESUME_KINDS) and prefetch timings (PREFETCH_TIMINGS)."""
    import switchyard.dispatcher.metrics  # noqa: F401 - starts the label sets
    from switchyard.dispatcher.scheduler.tool_wait import PREFETCH_TIMINGS, RESUME_KINDS, Decision

    decisions = {d.value for d in Decision}
    assert label_values("switchyard_tool_wait_decisions_total", "decision") == decisions
    assert label_values("switchyard_tool_wait_decisions_by_tool_total", "decision") == decisions
    assert label_values("switchyard_tool_resumes_total", "resume") == set(RESUME_KINDS)
    # one label, one set: the sequences' resumes are the tool resumes' kinds and preempted
    assert label_values("switchyard_resumes_total", "resume") == {"preempted", *RESUME_KINDS}
    assert label_values("switchyard_tool_wait_prefetches_total", "tool_return") == set(PREFETCH_TIMINGS)


def test_every_queue_counts_its_refusals_by_the_one_reason_set() -> None:
    """The inference queue (the scheduler's) and the work queues (common/queues.py) start
    switchyard_queue_rejected_total at 0 for the same reasons, common.metrics.QUEUE_REJECT_REASONS."""
    from switchyard.common.config import QueueConfig
    from switchyard.common.metrics import QUEUE_REJECT_REASONS
    from switchyard.common.queues import WorkQueue
    import switchyard.dispatcher.metrics  # noqa: F401 - starts the inference queue's

    WorkQueue("label-check", QueueConfig(capacity=1, workers=1, timeout_ms=1000))
    for queue in ("inference", "label-check"):
        assert {reason for reason in QUEUE_REJECT_REASONS
                if REGISTRY.get_sample_value("switchyard_queue_rejected_total",
                                             {"queue": queue, "reason": reason}) is not None} == {"full", "timeout"}
