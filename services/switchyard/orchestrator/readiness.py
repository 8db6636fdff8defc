"""The orchestrator's readiness: SERVING only while the services a task needs answer.

A background task checks the gRPC health (``grpc.health.v1``) of the dispatcher
and of retrieval every ``orchestrator.health_check_interval_s``, over the same
channels the tasks use, and sets the orchestrator's own health statuses:

============================  ==========================================================
health service name           SERVING while
============================  ==========================================================
``workflow.chat``             a dispatcher is ready
``workflow.rag_answer``       a dispatcher and a retrieval replica are ready
``workflow.react_loop``       a dispatcher and a retrieval replica are ready (search_docs)
``agent.AgentService``        the default workflow (``orchestrator.default_task_type``) is
============================  ==========================================================

The readiness probe checks ``agent.AgentService``; the liveness probe checks
the server's overall status (``""``), which stays SERVING whatever the
downstream services do, so a dispatcher outage takes orchestrators out of the
Service's endpoints without restarting them.

"Ready" means one health ``Check`` answered SERVING within
``orchestrator.health_check_timeout_s``. A target with several addresses
(``ipv4:a,b``, ``dns:///`` of a headless Service) is balanced per call, so a
round asks up to one Check per known address (3 for a name that resolves to an
unknown number), and one SERVING answer is enough: one ready replica serves.
A stopped process (SIGSTOP) answers nothing and counts as not ready after the
timeout; a closed port fails at once. Where the dispatcher client knows the
replicas one by one (:class:`~switchyard.orchestrator.replicas.ReplicaSet`),
each is checked on its own channel, and calls avoid those that do not answer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.common.grpc_target import static_addresses
from switchyard.common.metrics import TASK_TYPES
from switchyard.common.server import GRPC_SERVICES
from switchyard.orchestrator.replicas import ReplicaSet

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

NEEDS: Mapping[str, tuple[str, ...]] = {
    "chat": ("dispatcher",),
    "rag_answer": ("dispatcher", "retrieval"),
    "react_loop": ("dispatcher", "retrieval"),
}
"""The downstream services each workflow calls (see workflows.py)."""
assert set(NEEDS) == set(TASK_TYPES)

CANNOT_RUN_WITHOUT: Mapping[str, tuple[str, ...]] = {
    "chat": ("dispatcher",),
    "rag_answer": ("dispatcher", "retrieval"),
    "react_loop": ("dispatcher",),
}
"""The downstream services without which a workflow fails: react_loop calls retrieval only through its
``search_docs`` tool, whose failure the model reads as the tool's observation (orchestrator/tools.py)."""
assert set(CANNOT_RUN_WITHOUT) == set(TASK_TYPES)

HEALTH_NAMES = {name: GRPC_SERVICES[name] for name in ("dispatcher", "retrieval")}
"""The health service name each downstream sets SERVING when it is ready."""

UNKNOWN_FAN_OUT = 3
"""Checks per round for a target whose address count is not known from its text (``dns:///``)."""


def workflow_health_name(workflow: str) -> str:
    """The health service name of one workflow, e.g. ``workflow.chat``."""
    return f"workflow.{workflow}"


def address_count(target: str) -> int:
    """Addresses a gRPC target names: 2 for ``ipv4:127.0.0.1:1,127.0.0.1:2``; :data:`UNKNOWN_FAN_OUT` for a
    name resolved by DNS (``dns:///dispatcher:50053``, a headless Service); 1 for ``host:port`` and a
    ``unix:`` socket (:func:`~switchyard.common.grpc_target.static_addresses` reads the target)."""
    addresses = static_addresses(target)
    return UNKNOWN_FAN_OUT if addresses is None else max(1, len(addresses))


async def check(channel: grpc.aio.Channel, service: str, timeout_s: float, attempts: int) -> str:
    """"" when one of up to ``attempts`` health Checks of ``service`` answers SERVING, else why not, in words
    that end the sentence "dispatcher service unavailable at ADDRESS: ..." (:func:`not_ready_reason`).

    Each Check waits at most ``timeout_s`` seconds; a failed or NOT_SERVING
    answer moves on to the next attempt (the channel's round_robin sends it to
    the next address), and the last attempt's failure is the one named. Never raises.
    """
    stub = health_pb2_grpc.HealthStub(channel)
    why = "it was not asked its health"
    for _ in range(attempts):
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            why = not_ready_reason(exc.code(), exc.details() or "", timeout_s)
            continue
        if reply.status == SERVING:
            return ""
        why = not_ready_reason(None, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), timeout_s)
    return why


def not_ready_reason(code: grpc.StatusCode | None, said: str, timeout_s: float) -> str:
    """Why one health Check found its service not ready: ``code`` the Check's failure (None: it answered
    ``said``, a status other than SERVING). A service that answered NOT_SERVING is draining or starting, one
    whose Check ran out of time answers nothing (SIGSTOP, a hung process), one refused is not running there:
    each its own words, so an operator does not look for a hang where a drain or a closed port is."""
    if code is None:
        if said == "NOT_SERVING":
            return "its last health check answered NOT_SERVING (draining after SIGTERM, or not ready yet)"
        return f"its last health check answered {said} (is the address another service's?)"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ("it did not answer its last health check (within orchestrator.health_check_timeout_s = "
                f"{timeout_s:g} s)")
    return f"its last health check failed ({code.name}: {said})"


class Readiness:
    """Sets the orchestrator's health statuses from its downstream services' health.

    Args:
        set_status: ``HealthServicer.set`` (a coroutine function of name and status).
        channels: ``{"dispatcher": (channel, target), "retrieval": (channel, target)}``,
            the channels the tasks use and the targets they were opened with.
        default_workflow: the workflow whose status ``agent.AgentService`` takes.
        interval_s: seconds between rounds of checks.
        timeout_s: seconds one health Check may take.
        replica_sets: the services whose replicas are known one by one, each checked on its own channel.
        on_back: called with a service's name when a round finds it ready after one that did not.
    """

    def __init__(
        self,
        set_status: Callable[[str, int], object],
        channels: Mapping[str, tuple[grpc.aio.Channel, str]],
        default_workflow: str,
        interval_s: float,
        timeout_s: float,
        replica_sets: Mapping[str, ReplicaSet] | None = None,
        on_back: Callable[[str], None] | None = None,
    ) -> None:
        self._set = set_status
        self._channels = channels
        self._default = default_workflow
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.ready: dict[str, bool] = {name: False for name in channels}
        """Last result per downstream service (False before the first round)."""
        self.why: dict[str, str] = {name: "" for name in channels}
        """Why the last round found each service not ready (:func:`check`); "" where it found it ready."""
        self.checked = False
        """A round has ended: :attr:`ready` says what was found, not what is not known yet."""
        self._published: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._replica_sets = dict(replica_sets or {})
        self._on_back = on_back
        """Called with a service's name when a round finds it ready after one that found it not (it restarted,
        perhaps as another build: the dispatcher's DescribeModel is asked again)."""

    async def _check_service(self, name: str) -> str:
        """One service's readiness. With its replicas known (a :class:`ReplicaSet`), each replica is checked
        on its own channel, and those that do not answer SERVING are marked unhealthy there, so calls avoid
        a replica that stopped answering (SIGSTOP) while its connection still looks open."""
        channel, target = self._channels[name]
        replicas = self._replica_sets.get(name)
        if replicas is not None:
            await replicas.refresh()  # a dns:/// target is resolved even while no task calls it
        if replicas is None or not replicas.channels:
            return await check(channel, HEALTH_NAMES[name], self.timeout_s, address_count(target))
        addresses = list(replicas.channels.items())
        results = await asyncio.gather(*(check(ch, HEALTH_NAMES[name], self.timeout_s, 1) for _, ch in addresses))
        unhealthy = frozenset(address for (address, _), why in zip(addresses, results) if why)
        if unhealthy != replicas.unhealthy:
            log.warning("readiness: %s replicas not ready: %s", name, "; ".join(sorted(
                f"{address}: {why}" for (address, _), why in zip(addresses, results) if why)) or "none")
        replicas.unhealthy = unhealthy
        return "" if not all(results) else results[0]

    def unready(self, workflow: str) -> list[tuple[str, str]]:
        """The downstream services ``workflow`` cannot run without (:data:`CANNOT_RUN_WITHOUT`) that the last
        round found not ready, with their targets; none before the first round has ended."""
        if not self.checked:
            return []
        return [(name, self._channels[name][1]) for name in CANNOT_RUN_WITHOUT[workflow]
                if name in self._channels and not self.ready.get(name, False)]

    def not_serving(self, workflow: str) -> list[tuple[str, str]]:
        """The downstream services ``workflow`` needs (:data:`NEEDS`) that the last round did not find ready, with
        their targets: the one rule of its health status (``workflow.<name>``, and ``agent.AgentService`` for the
        default workflow: :meth:`statuses`), which the HTTP face's ``/readyz`` answers too. Before the first round
        has ended every one (the statuses published then are NOT_SERVING)."""
        return [(name, self._channels[name][1] if name in self._channels else "") for name in NEEDS[workflow]
                if not (self.checked and self.ready.get(name, False))]

    def statuses(self) -> dict[str, int]:
        """Health service name -> SERVING / NOT_SERVING under the current :attr:`ready` (:meth:`not_serving`)."""
        out = {workflow_health_name(w): NOT_SERVING if self.not_serving(w) else SERVING for w in NEEDS}
        out[GRPC_SERVICES["orchestrator"]] = out[workflow_health_name(self._default)]
        return out

    async def check_once(self) -> dict[str, int]:
        """Check every downstream service once (concurrently) and publish the statuses that changed."""
        names = list(self._channels)
        results = await asyncio.gather(*(self._check_service(name) for name in names))
        for name, why in zip(names, results):
            ok = not why
            if ok != self.ready[name]:
                target = self._channels[name][1]
                if ok:
                    log.info("readiness: %s at %s is ready", name, target)
                    if self.checked and self._on_back is not None:
                        self._on_back(name)
                else:
                    log.warning("readiness: no ready %s at %s: %s", name, target, why)
            self.ready[name] = ok
            self.why[name] = why
        self.checked = True
        statuses = self.statuses()
        for name, status in statuses.items():
            if self._published.get(name) != status:
                await self._set(name, status)  # type: ignore[misc]
                self._published[name] = status
        return statuses

    async def _run(self) -> None:
        while True:
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug here must not end readiness for good
                log.exception("readiness: check failed")
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        """Publish NOT_SERVING for every name, run the first round, then keep checking in the background."""
        for name in self.statuses():
            await self._set(name, NOT_SERVING)  # type: ignore[misc]
            self._published[name] = NOT_SERVING
        await self.check_once()
        self._task = asyncio.create_task(self._run_after_first(), name="orchestrator-readiness")

    async def _run_after_first(self) -> None:
        await asyncio.sleep(self.interval_s)
        await self._run()

    async def stop(self) -> None:
        """Stop checking (statuses stay as they are: the server's drain sets NOT_SERVING)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
