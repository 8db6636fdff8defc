"""Per upstream model: its circuit breaker (LiteLLM's cooldowns) and the waits it asked for.

**Circuit breaker.** A model whose calls fail ``model_gateway.cooldown.failures``
times in a row is *open* for ``first_cooldown_s``, doubled at each reopening
(a probe failed) up to ``cooldown_s`` and started over once it closes
(resilience4j's exponential wait in the open state): a model server that stays
down is tried ever less often. While open, the endpoint's ``GET /models`` is read
every ``health_check_interval_s``, in the background and on a refused call, never
more often (an active health check beside the breaker's passive one, as Envoy runs
both); an answer half-opens the circuit at once, so a server back after a restart
is served within about that interval however long the open period has grown, with no
call refused first to start the check. A probe admitted on a health check's word that fails (the
server lists its models but fails its calls) stops the checks until that open
period ends, so such a server is probed at the doubling periods, not every second.
While open its requests are refused at once
with :class:`~switchyard.gateway.errors.ModelCoolingDown` (UNAVAILABLE, fallback
allowed), so the fallback model serves them without paying the dead model's
timeouts and retries first. After the cooldown the circuit is *half-open*: it
admits exactly ``half_open_probes`` calls at once (the probes); every other
call is refused at once as while open, except a call with nowhere else to go
(no fallback model left to try, no other endpoint that takes it), which waits
for the probes' outcome within its own deadline: sent once they succeed,
refused when one fails (refused at once, such calls failed although the server
was back and the probe beside them was served). A probe's failure opens the circuit
again; once ``half_open_probes`` probes have succeeded it closes. A probe that
ends without telling (a 429, the request's own fault, a cancelled call) frees
its place for the next probe and counts neither way.

Only upstream faults count: UNAVAILABLE (5xx, connection refused, stream cut
before the first token), DEADLINE_EXCEEDED (timeouts) and INTERNAL. A rate limit
(429), a request's own fault (400, 404 for a named model, 413, 422),
authentication, and a dead local proxy (not the model's doing) never open a circuit.

**Server-requested waits.** A 429 or 503 whose ``Retry-After`` (or
``retry-after-ms``) asks for a wait is recorded against the model: until that
time has passed every call to it is refused locally with
:class:`~switchyard.gateway.errors.UpstreamAskedToWait` (the upstream's own
status, retryable after the time left, fallback allowed), so no request reaches
the model earlier than it allowed. The local refusal lasts at most
``cooldown.cooldown_s`` (the longest a failing model is skipped; also with
``cooldown.enabled`` off): after it, the calls that come reach the server again
until an answer asking for a wait renews the hold, so a longer wait (an hourly
quota's, or a nonsense 1e20 s) is asked again about once per ``cooldown_s``. A
refused call is told the whole wait's rest, not the hold's. :func:`switchyard.gateway.resilience.with_retries`
then waits the time left when it is within ``retry_after_max_s`` and the call's
deadline, or gives up at once (to the fallback model) when it is not; a wait is
never shortened.

Why not purgatory (the library this module used before): its half-open state
admits every concurrent call (10, then 8, then 4 calls at once were measured
against one allowed), counts an excluded error during half-open (a 429, a
cancelled probe) as a success that closes the circuit, and times the cooldown
on the wall clock. The state machine here is small and keeps the same rules
otherwise (threshold and cooldown as LiteLLM's cooldowns and purgatory's
defaults).

Metrics: ``switchyard_gateway_circuit_state{model, state}``: how many of the
gateway's endpoints have that model's circuit in that state (closed, open,
half_open; with one endpoint, 1 for the current state and 0 for the others;
an endpoint whose several models share one label, ``other``, counts once, in
the worst of their states: open, then half_open, then closed), kept by
:class:`CircuitGauges`; and
``switchyard_gateway_circuit_transitions_total{model, from_state, to_state}``,
every legal transition pre-initialised to 0.

A circuit that holds nothing (closed, no failure counted, no wait asked for,
no probe) is the same as none: past :data:`MAX_CIRCUITS` models, such circuits
are let go, so callers naming ever new model ids cannot grow the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

import grpc

from switchyard.common.config import CooldownConfig, UpstreamConfig
from switchyard.common.metrics import OTHER
from switchyard.gateway import models as model_names
from switchyard.gateway.errors import GatewayError, ModelCoolingDown, UpstreamAskedToWait
from switchyard.gateway.metrics import CIRCUIT_STATES, CIRCUIT_TRANSITIONS, GATEWAY_CIRCUIT_STATE, GATEWAY_CIRCUIT_TRANSITIONS

log = logging.getLogger(__name__)
T = TypeVar("T")

CLOSED, OPEN, HALF_OPEN = CIRCUIT_STATES
_WORST_FIRST = (OPEN, HALF_OPEN, CLOSED)

MAX_CIRCUITS = 1024
"""Circuits one endpoint keeps before those that hold nothing are let go (see the module docstring)."""

UPSTREAM_FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL})
"""What counts against a model. Not RESOURCE_EXHAUSTED (429): "slow down" is answered by Retry-After and
the dispatcher's adaptive concurrency limit; opening the circuit on it would refuse all the traffic the
upstream can still take."""


def _not_the_models_fault(exc: BaseException) -> bool:
    """True for an error that must not count against the model (neither failure nor success)."""
    if not isinstance(exc, GatewayError):
        return True  # cancellation, bugs: not an upstream answer
    return exc.code not in UPSTREAM_FAULTS or exc.origin == "proxy" or isinstance(exc, ModelCoolingDown)


@dataclass
class _Circuit:
    """One model's breaker and recorded wait. Times are ``time.monotonic()`` seconds."""

    state: str = CLOSED
    failures: int = 0
    """Upstream faults in a row while closed."""
    open_until: float = 0.0
    probes_succeeded: int = 0
    not_before: float = 0.0
    """No request is sent before this time: the wait the upstream asked for (Retry-After), held at most
    ``cooldown.cooldown_s``."""
    asked_until: float = 0.0
    """The end of the wait the upstream asked for, whole: what a refused call is told is left (a retry is not
    waited out for a wait longer than ``retry_after_max_s`` because the hold is shorter)."""
    asked_s: float = 0.0
    """The wait it asked for, seconds, for the message."""
    asked_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    asked_status: str = ""
    probes: set[int] = field(default_factory=set)
    """Ids of the probes in flight in the current half-open period."""
    opens: int = 0
    """Openings since the circuit was last closed: the open period is ``first_cooldown_s x 2^(opens - 1)``."""
    last_error: str = ""
    """The last upstream fault counted (the cause a refusal while open repeats)."""
    checked_at: float = float("-inf")
    """When the last health check of this circuit's endpoint started (open only)."""
    by_health: bool = False
    """The circuit is half-open because a health check answered (not because its open period ended)."""
    checks_from: float = float("-inf")
    """No health check before this time: a probe admitted on a health check's word failed (the server answers
    its model list but not its calls), so the open period alone decides until it ends."""
    verdict: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced by a fresh one) when a half-open probe ends or the state moves: what a call waiting for
    the probes' outcome (:meth:`Cooldowns.call` with ``wait_for_probes``) waits on."""


def open_period_s(cfg: CooldownConfig, opens: int) -> float:
    """Seconds a circuit stays open at its ``opens``-th opening since it last closed (1 for the first):
    ``min(cooldown_s, first_cooldown_s x 2^(opens - 1))``."""
    return min(cfg.cooldown_s, cfg.first_cooldown_s * 2.0 ** min(opens - 1, 32))


class CircuitGauges:
    """``switchyard_gateway_circuit_state`` over the endpoints of one gateway (see the module docstring): the
    one writer of the gauge, so that endpoints joining, leaving or moving never overwrite each other's state.

    Args:
        config: ``model_gateway``: its configured models (and ``other``) are the labels, every one published
            from the start.
    """

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.members: list[Cooldowns] = []
        self.labels = sorted({model_names.model_label(m, config) for m in model_names.configured_models(config)}
                             | {OTHER})
        for label in self.labels:
            for before, after in CIRCUIT_TRANSITIONS:
                GATEWAY_CIRCUIT_TRANSITIONS.labels(label, before, after)
        self.publish()

    def join(self, cooldowns: "Cooldowns") -> None:
        """An endpoint's circuits count from now on."""
        self.members.append(cooldowns)
        self.publish()

    def leave(self, cooldowns: "Cooldowns") -> None:
        """An endpoint left the gateway: its circuits count no more."""
        if cooldowns in self.members:
            self.members.remove(cooldowns)
            self.publish()

    def publish(self, label: str | None = None) -> None:
        """Set the gauge for ``label`` (every label when None) from the members' circuits."""
        for each in self.labels if label is None else (label,):
            counts = dict.fromkeys(CIRCUIT_STATES, 0)
            for member in self.members:
                counts[member.label_state(each)] += 1
            for state, count in counts.items():
                GATEWAY_CIRCUIT_STATE.labels(each, state).set(count)


class Cooldowns:
    """One circuit and one recorded wait per upstream model id, for one endpoint.

    Args:
        config: ``model_gateway``; ``cooldown`` gives the threshold, cooldown and probes.
        clock: monotonic seconds (tests step it by hand).
        gauges: the gateway's :class:`CircuitGauges`, which this endpoint joins; None: gauges of its own (one
            endpoint).
    """

    def __init__(self, config: UpstreamConfig, clock: Callable[[], float] = time.monotonic,
                 health_check: Callable[[], Awaitable[bool]] | None = None,
                 gauges: CircuitGauges | None = None) -> None:
        self.config = config
        self._clock = clock
        self.health_check = health_check
        """True when the endpoint answers (its ``GET /models``): read while a circuit is open, at most every
        ``health_check_interval_s``; True half-opens it at once. None: the open period alone decides."""
        self._checks: dict[str, asyncio.Task[None]] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        """Per open circuit, the background task that starts its health checks (:meth:`_watching`)."""
        self._circuits: dict[str, _Circuit] = {}
        self._next_call = 0
        self.gauges = gauges if gauges is not None else CircuitGauges(config)
        self.gauges.join(self)

    def state(self, model: str) -> str:
        """``closed``, ``open`` or ``half_open``: the circuit's state as of its last call."""
        return self._circuits[model].state if model in self._circuits else CLOSED

    def refusing(self, model: str) -> bool:
        """Whether a call of ``model`` would be refused here now without reaching the endpoint: its circuit open
        (its period not over), half-open with every probe place taken, or a wait it asked for not passed."""
        circuit = self._circuits.get(model)
        if circuit is None:
            return False
        now = self._clock()
        if now < circuit.not_before:
            return True
        if not self.config.cooldown.enabled:
            return False
        if circuit.state == OPEN:
            return now < circuit.open_until
        return circuit.state == HALF_OPEN and len(circuit.probes) >= self.config.cooldown.half_open_probes

    def label_state(self, label: str) -> str:
        """The worst state (open, half_open, closed) of the circuits whose model has metric label ``label``."""
        states = {c.state for m, c in self._circuits.items() if model_names.model_label(m, self.config) == label}
        return next((state for state in _WORST_FIRST if state in states), CLOSED)

    def _circuit(self, model: str) -> _Circuit:
        circuit = self._circuits.get(model)
        if circuit is None:
            if len(self._circuits) >= MAX_CIRCUITS:
                self._let_go_of_idle(self._clock())
            circuit = self._circuits[model] = _Circuit()
        return circuit

    def _let_go_of_idle(self, now: float) -> None:
        """Drop the circuits that hold nothing: closed, no failure counted, no wait asked for, no probe."""
        for model in [m for m, c in self._circuits.items()
                      if c.state == CLOSED and c.failures == 0 and c.not_before <= now and not c.probes
                      and m not in self._checks]:
            del self._circuits[model]

    @staticmethod
    def _decided(circuit: _Circuit) -> None:
        """Wake the calls waiting for the probes' outcome (a probe ended, or the state moved)."""
        circuit.verdict.set()
        circuit.verdict = asyncio.Event()

    def _move(self, model: str, circuit: _Circuit, to: str) -> None:
        before, circuit.state = circuit.state, to
        self._decided(circuit)
        label = model_names.model_label(model, self.config)
        self.gauges.publish(label)
        GATEWAY_CIRCUIT_TRANSITIONS.labels(label, before, to).inc()
        cfg = self.config.cooldown
        if to == OPEN:
            circuit.opens += 1
            period = open_period_s(cfg, circuit.opens)
            circuit.open_until = self._clock() + period
            self._watch(model, circuit)
            if circuit.by_health:  # its model list answered, its calls did not: no more checks this period
                circuit.checks_from = circuit.open_until
            circuit.by_health = False
            circuit.probes.clear()
            circuit.probes_succeeded = 0
            why = "a probe failed" if before == HALF_OPEN else f"{cfg.failures} failures in a row"
            log.warning("upstream model %r: circuit open after %s; skipped for %g s (model_gateway.cooldown)",
                        model, why, period)
        elif to == HALF_OPEN:
            log.info("upstream model %r: circuit half-open, admitting %d probe(s)", model, cfg.half_open_probes)
        else:
            circuit.failures = circuit.opens = 0
            circuit.probes.clear()
            circuit.by_health, circuit.checks_from = False, float("-inf")
            log.info("upstream model %r: circuit closed, serving again", model)

    def _admit(self, model: str, circuit: _Circuit, now: float) -> int | None:
        """Let one call in, returning its probe id when it is a half-open probe.

        Raises:
            ModelCoolingDown: open, or half-open with every probe place taken.
        """
        cfg = self.config.cooldown
        if circuit.state == OPEN and now >= circuit.open_until:
            self._move(model, circuit, HALF_OPEN)
        if circuit.state == CLOSED:
            return None
        if circuit.state == HALF_OPEN and len(circuit.probes) < cfg.half_open_probes:
            self._next_call += 1
            circuit.probes.add(self._next_call)
            return self._next_call
        if circuit.state == OPEN:
            self._check_health(model, circuit, now)
            checked = self.health_check is not None and now >= circuit.checks_from
            wait_s = circuit.open_until - now
            more = f"{wait_s:.1f} s more" if wait_s >= 0.05 else "under 0.1 s more"  # never "0.0 s more"
            left = (f"skipped for {more}{', or until it answers again' if checked else ''}"
                    " (model_gateway.cooldown: first_cooldown_s, doubled at each reopening up to cooldown_s)")
        else:
            left = (f"half-open with its {cfg.half_open_probes} probe(s) in flight "
                    "(model_gateway.cooldown.half_open_probes); refused until they end")
        cause = f"; the last: {circuit.last_error}" if circuit.last_error else ""
        raise ModelCoolingDown(
            f"upstream model {model!r} is cooling down after {cfg.failures} failures in a row at "
            f"{self.config.base_url}{cause}; {left}"
        )

    def _watch(self, model: str, circuit: _Circuit) -> None:
        """Start :meth:`_watching` ``circuit``, which has just opened, unless it is watched already or there is
        no health check (or no running loop)."""
        if self.health_check is None or model in self._watches:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._watching(model, circuit), name=f"circuit-watch-{model}")
        self._watches[model] = task
        task.add_done_callback(lambda done: self._watches.pop(model, None) if self._watches.get(model) is done
                               else None)

    async def _watching(self, model: str, circuit: _Circuit) -> None:
        """While ``circuit`` is open and its period not over, start a health check every
        ``health_check_interval_s``, the first one interval after it opened (:meth:`_check_health`, whose rules
        apply), so that a server back half-opens it within about that interval, calls arriving or not. Started only by a refused call, the check came after that call, which
        failed with the server back (and so did every call arriving before the check's answer)."""
        interval = self.config.cooldown.health_check_interval_s
        while True:
            # the first check one interval after the circuit opened, not at once: a server that lists its models
            # while one of them fails (a 503 of its own) would be half-opened by it as it opened, and the model
            # tried again at once rather than skipped for its open period
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(circuit.verdict.wait(), interval)  # the state moved: look again at once
            if circuit.state != OPEN or self._clock() >= circuit.open_until:
                return
            self._check_health(model, circuit, self._clock())

    async def aclose(self) -> None:
        """Stop the health checks and their watches under way (the endpoint's connections are closing)."""
        tasks = [*self._watches.values(), *self._checks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _check_health(self, model: str, circuit: _Circuit, now: float) -> None:
        """Start a health check of the endpoint (:attr:`health_check`) unless one runs or one started within
        ``health_check_interval_s``; an answer while still open half-opens the circuit."""
        if self.health_check is None or model in self._checks or now < circuit.checks_from \
                or now - circuit.checked_at < self.config.cooldown.health_check_interval_s:
            return
        circuit.checked_at = now
        check = self.health_check

        async def run() -> None:
            try:
                answered = await check()
            except Exception:  # noqa: BLE001 - a check that cannot tell counts as no answer
                answered = False
            finally:
                self._checks.pop(model, None)
            if answered and circuit.state == OPEN:
                log.info("upstream model %r: %s answers again; circuit half-open before its open period ended",
                         model, self.config.base_url)
                self._move(model, circuit, HALF_OPEN)
                circuit.by_health = True

        self._checks[model] = asyncio.get_running_loop().create_task(run(), name=f"health-check-{model}")

    def _asked_to_wait(self, model: str, circuit: _Circuit, now: float) -> UpstreamAskedToWait:
        left = circuit.asked_until - now
        held = self.config.cooldown.cooldown_s
        asked = (f"{circuit.asked_s:.1f} s" if circuit.asked_s <= held else
                 f"{circuit.asked_s:.4g} s (held here for model_gateway.cooldown.cooldown_s = {held:g} s, then asked "
                 "again)")
        error = UpstreamAskedToWait(
            f"upstream model {model!r} asked to wait {asked} before another request "
            f"(Retry-After on its {circuit.asked_status}); {left:.4g} s of it left, so the call was not sent"
        )
        error.code = circuit.asked_code
        error.retry_after_s = left
        return error

    def _record_wait(self, model: str, circuit: _Circuit, exc: GatewayError, now: float) -> None:
        asked = exc.retry_after_s
        if asked is None or asked <= 0 or isinstance(exc, UpstreamAskedToWait):
            return
        # Held locally for at most cooldown.cooldown_s, the longest a model is skipped for its failures: then calls
        # reach the server again, the first answer asking for a wait renewing the hold. A Retry-After of 1e20 s, or
        # an HTTP date years ahead, had locked the model out for as long, past any restart of the server that sent it.
        held = min(asked, self.config.cooldown.cooldown_s)
        if now + held <= circuit.not_before:
            return
        circuit.not_before, circuit.asked_until = now + held, now + asked
        circuit.asked_s, circuit.asked_code = asked, exc.code
        circuit.asked_status = ("429" if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                                else str(exc.overloaded_status or 503))
        log.info("upstream model %r asked to wait %.1f s (Retry-After): no call to it before then", model, asked)

    async def call(self, model: str, once: Callable[[], Awaitable[T]], *, wait_for_probes: bool = False) -> T:
        """``await once()`` unless ``model`` asked for a wait that has not passed or its circuit refuses.

        ``wait_for_probes``: a call that finds the circuit half-open with every probe place taken waits for the
        probes' outcome instead of being refused at once (the caller's deadline bounds the wait, a probe's own
        timeouts bound it too): it is sent once they succeed (the circuit closed), takes the place of a probe
        that ended telling nothing, and is refused as while open when one fails. For a call with nowhere else to
        go (no fallback model left, no other endpoint): refused at once, it failed UNAVAILABLE although the
        server had come back, while the one probe let through was being served.

        Raises:
            UpstreamAskedToWait: the wait the model asked for has not passed (its status, retryable after
                ``retry_after_s``, fallback allowed).
            ModelCoolingDown: the circuit is open or half-open with every probe in flight (UNAVAILABLE,
                fallback allowed).
            GatewayError: whatever ``once`` raised, after counting it.
        """
        circuit = self._circuit(model)
        now = self._clock()
        if now < circuit.not_before:
            raise self._asked_to_wait(model, circuit, now)
        enabled = self.config.cooldown.enabled
        probe = None
        while enabled:
            try:
                probe = self._admit(model, circuit, now)
                break
            except ModelCoolingDown:
                if not (wait_for_probes and circuit.state == HALF_OPEN):
                    raise
            await circuit.verdict.wait()
            now = self._clock()
            if now < circuit.not_before:  # a probe's answer asked for a wait meanwhile
                raise self._asked_to_wait(model, circuit, now)
        try:
            result = await once()
        except BaseException as exc:
            if isinstance(exc, GatewayError):
                self._record_wait(model, circuit, exc, self._clock())
            if enabled:
                counts = not _not_the_models_fault(exc)
                if counts:
                    circuit.last_error = str(exc)[:500]
                self._ended(model, circuit, probe, failed=counts, told=counts)
            raise
        if enabled:
            self._ended(model, circuit, probe, failed=False, told=True)
        return result

    def _ended(self, model: str, circuit: _Circuit, probe: int | None, *, failed: bool, told: bool) -> None:
        """Count one call's outcome; ``told``: the outcome says something about the model."""
        if probe is not None:
            if probe not in circuit.probes:
                return  # a probe of an earlier half-open period, already decided
            circuit.probes.discard(probe)
            self._decided(circuit)  # a place is free, or the state moves below (which wakes them again)
            if failed:
                self._move(model, circuit, OPEN)
            elif told:
                circuit.probes_succeeded += 1
                if circuit.probes_succeeded >= self.config.cooldown.half_open_probes:
                    self._move(model, circuit, CLOSED)
            return
        if circuit.state != CLOSED:
            return  # admitted while closed, ended after the circuit opened: already counted by others
        if failed:
            circuit.failures += 1
            if circuit.failures >= self.config.cooldown.failures:
                self._move(model, circuit, OPEN)
        elif told:
            circuit.failures = 0
