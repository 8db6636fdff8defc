"""Request path: which Switchyard modules one RunTask passes through, in order, and how often it comes back.

Usage: PYTHONPATH=services python tools/request_path.py [--task-types chat,rag_answer,react_loop]
       [--max-tokens 8] [--repeat 3] [--index-dir DIR] [--docs PATH ...] [--show-path]

The orchestrator, retrieval and the dispatcher (the sim engine, a step every 25 ms: :data:`PACED`) run in
this process, each on its own server on 127.0.0.1 port 0, as the tests start them
(:func:`switchyard.common.server.running`), on one uvloop event loop; the orchestrator's CPU work runs on
that loop too (``orchestrator.cpu_executor = loop``) and its task store is SQLite in a temporary folder.
Retrieval serves ``--index-dir``, or an index built into a temporary folder from ``--docs`` (default:
``README.md``). The client is a bare grpc.aio channel (no Switchyard code on the client side). Each task
type runs once as a warm-up (channels, streams, caches, the dispatcher's first steps), then ``--repeat``
times recorded.

What is recorded (``sys.setprofile`` on the event-loop thread only; Python 3.11 has no
``sys.monitoring``): from the first call of ``OrchestratorService.RunTask`` for the recorded task to that
frame's last return (after it streamed the task's last event, final), at every Python call and return,
the **current module**: the module of the innermost frame on the stack that belongs to a counted
Switchyard module. A counted module is one under ``switchyard.`` other than

- the generated ``switchyard.api`` modules, and
- the helpers reported apart, not counted: metrics, telemetry, logging
  (:data:`HELPER_MODULES`, and any ``switchyard.*.metrics``).

A frame of any other module (asyncio, grpc, protobuf, the helpers) is transparent: the module it was
called from stays current, and an event with no counted frame on the stack (the event loop between two
callbacks) changes nothing. A call from one module into a function of another and its return are two
transitions (A -> B -> A). Each module visit has a **side**: the service whose package
(``switchyard.orchestrator``, ``.retrieval``, ``.dispatcher``) holds the innermost service frame on the
stack, for a shared module (``switchyard.common``, ``switchyard.gateway``) too; with none on the stack,
the side of the visit before. Services call each other only over gRPC, so **a change of side is an RPC
boundary**.

The **path** is the sequence of visits with consecutive visits of one module on one side collapsed into
one, and a boundary marker (``|``) where the side changes. A **return into an already-left module** is a
visit of a module that was visited earlier on the path (on any side): since consecutive visits are
collapsed and a boundary separates two sides, the module was left in between (an RPC boundary counts as
leaving). ``returns`` counts them over the path, ``modules returned into`` the distinct modules they
enter, ``dispatcher returns`` those on the dispatcher side. Each is given for the whole task and for its
**round trip**: the path from RunTask's entry to the first event RunTask yields after the dispatcher's
first engine step (a module of ``switchyard.dispatcher.engines``), the first token: servicer to engine
step and back. Helper modules entered on the path are counted apart (``helper entries``: each call into
a helper module's frame from outside it).

**Callbacks** are what the issue's "returns into an already-left module" counts, and the figure its target
bounds: a call from one counted module into a function of another that already has a frame below it on
the stack, waiting for the call in progress (``core -> engine_loop`` on arrival while ``engine_loop.submit``
waits for ``core.add_request``; ``generate_stream -> service.chunk`` while ``service.GenerateStream`` waits
for the session's replies): control goes back up into a module the request had been handed on from. The
stack of a task started by ``asyncio.create_task`` on the path continues its creator's (a GenerateStream's
reader task continues ``service.GenerateStream``) while the creator's coroutine frames wait (suspended at an
``await``; :class:`TaskCreators` records them for every task started while the stack runs), so a call back
into a waiting creator's modules counts too. A
call that returns to its caller is not one (the caller never left: it delegated), nor is a coroutine
resuming (only a frame's first call is looked at), nor a call into a module that is on no waiting stack,
such as the step loop calling the scheduler at each step, or an output stream waking its session's task
(a hand-off to another task, not a return). ``returns`` above, the strict count, counts every module
change back (each call's return included), so it grows with every helper call and property read.

The path depends on the code, not on timing, but for interleaving with the stack's background tasks
(readiness checks every ``orchestrator.health_check_interval_s``, the task store's lease renewal every
``lease_s / 3``), and for the order in which grpc hands the loop the messages of the two ends of a
stream, which may differ from one task to the next by a few visits: ``--repeat N`` records N tasks of
each type and prints each figure's most common value and its range.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dis
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, AsyncIterator, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]

SERVICE_SIDES = ("orchestrator", "retrieval", "dispatcher")
"""The packages under ``switchyard`` that are services: a visit's side is one of these."""

HELPER_MODULES = frozenset({
    "switchyard.common.metrics",
    "switchyard.common.process_metrics",
    "switchyard.common.telemetry",
    "switchyard.common.grpc_tracing",
    "switchyard.common.grpc_decoding",
    "switchyard.common.logs",
})
"""Metrics, telemetry, logging and interceptor helpers: transparent on the path, their entries reported apart."""

ENGINES = "switchyard.dispatcher.engines"
"""The package of the dispatcher's engines: the first visit of one of its modules is the first engine step."""

BOUNDARY = "|"
"""The path's marker of an RPC boundary (a change of side)."""

PACED = {
    "sim.prefill_overhead_ms": 25.0, "sim.prefill_per_token_ms": 0.0,
    "sim.decode_base_ms": 25.0, "sim.decode_per_seq_ms": 0.0,
    "orchestrator.cpu_executor": "loop",
}
"""Overrides: sim engine steps of 25 ms each, so that each token's way back to the client (well under a
millisecond, a few under the profiler) ends before the next step starts, and the path does not depend on
how the loop interleaves the two; the orchestrator's CPU work on its event loop."""

PAYLOADS = {
    "chat": "Say hello in five words.",
    "rag_answer": "How do I start the stack?",
    "react_loop": "What is 12*(3+4), and how do I start the stack?",
}


def is_helper(module: str) -> bool:
    return module in HELPER_MODULES or (module.startswith("switchyard.") and module.endswith(".metrics"))


def counted(module: str) -> bool:
    """A module that takes part in the path: under ``switchyard.``, not generated, not a helper."""
    return module.startswith("switchyard.") and not module.startswith("switchyard.api") and not is_helper(module)


def side_of(module: str) -> str | None:
    """The service whose package holds ``module`` (``switchyard.dispatcher.engines.sim`` -> dispatcher), or None."""
    parts = module.split(".", 2)
    return parts[1] if len(parts) > 1 and parts[1] in SERVICE_SIDES else None


@dataclass
class Visit:
    side: str
    module: str


@dataclass(frozen=True)
class Callback:
    """A call from ``caller`` into ``function`` of ``module``, a module with a frame waiting below ``caller``'s
    on the stack (or on the stack of the task that started this one): see the module docstring."""

    side: str
    caller: str
    module: str
    function: str

    def __str__(self) -> str:
        return f"{self.caller.removeprefix('switchyard.')} -> {self.module.removeprefix('switchyard.')}:{self.function}"


_YIELD_VALUE = dis.opmap["YIELD_VALUE"]


def _waiting(frame: FrameType) -> bool:
    """A coroutine or generator frame suspended at a yield (an ``await``), not finished."""
    code = frame.f_code
    return 0 <= frame.f_lasti < len(code.co_code) and code.co_code[frame.f_lasti] == _YIELD_VALUE


class TaskCreators:
    """While installed, ``asyncio.create_task`` records the stack of frames each task was started from (its
    creator's task's too), so that a task's stack can be read as continuing its creator's."""

    def __init__(self) -> None:
        self._frames: dict[int, tuple[Any, list[FrameType]]] = {}  # id(task) -> (task, creator frames)

    def frames_of(self, task: Any) -> list[FrameType]:
        entry = self._frames.get(id(task)) if task is not None else None
        return entry[1] if entry is not None and entry[0] is task else []

    @contextlib.contextmanager
    def install(self):
        original = asyncio.create_task

        def create_task(coro: Any, **kwargs: Any) -> Any:
            task = original(coro, **kwargs)
            frames = []
            here: FrameType | None = sys._getframe(1)
            while here is not None:
                frames.append(here)
                here = here.f_back
            try:
                frames += self.frames_of(asyncio.current_task())
            except RuntimeError:
                pass
            self._frames[id(task)] = (task, frames)
            task.add_done_callback(lambda t: self._frames.pop(id(t), None))
            return task

        asyncio.create_task = asyncio.tasks.create_task = create_task  # type: ignore[assignment]
        try:
            yield self
        finally:
            asyncio.create_task = asyncio.tasks.create_task = original  # type: ignore[assignment]


def _first_resume(code: CodeType) -> int:
    """Offset of ``code``'s first RESUME: a frame whose last instruction is at or before it is on its first
    call (a coroutine's resumptions come later in its code)."""
    for ins in dis.get_instructions(code):
        if ins.opname == "RESUME":
            return ins.offset
    return 0


@dataclass
class PathReport:
    """One recorded task: its path (visits and boundaries) and the counts defined in the module docstring."""

    task_type: str
    path: list[Visit | None]
    """Visits in order; None is an RPC boundary."""
    helper_entries: dict[str, int] = field(default_factory=dict)
    round_trip_end: int | None = None
    """Length of the round trip's part of ``path`` (None: no engine step was seen)."""
    callbacks: list[Callback] = field(default_factory=list)
    """The callbacks (module docstring), in order."""
    round_trip_callbacks: int | None = None
    """How many of ``callbacks`` fall in the round trip (None: all)."""

    def round_trip(self) -> "PathReport":
        """The report of the round trip alone (the whole path when no engine step was seen)."""
        return PathReport(self.task_type, self.path[: self.round_trip_end], {}, self.round_trip_end,
                          self.callbacks[: self.round_trip_callbacks], self.round_trip_callbacks)

    @property
    def dispatcher_callbacks(self) -> list[Callback]:
        return [c for c in self.callbacks if c.side == "dispatcher"]

    @property
    def visits(self) -> int:
        return len(self.path) - self.boundaries

    @property
    def modules_returned_into(self) -> set[str]:
        return {v.module for v in self.returns}

    @property
    def returns(self) -> list[Visit]:
        seen: set[str] = set()
        back = []
        for visit in self.path:
            if visit is None:
                continue
            if visit.module in seen:
                back.append(visit)
            seen.add(visit.module)
        return back

    @property
    def dispatcher_returns(self) -> list[Visit]:
        return [v for v in self.returns if v.side == "dispatcher"]

    @property
    def boundaries(self) -> int:
        return sum(1 for v in self.path if v is None)

    def collapsed(self) -> str:
        """``A -> B | C -> B ...`` with module names without the ``switchyard.`` prefix."""
        out: list[str] = []
        for visit in self.path:
            if visit is None:
                out.append(BOUNDARY)
            else:
                if out and out[-1] != BOUNDARY:
                    out.append("->")
                out.append(visit.module.removeprefix("switchyard."))
        return " ".join(out)


class PathRecorder:
    """A ``sys.setprofile`` function recording module visits from the first call of ``start`` to its last return.

    Set it with :meth:`install` in the event-loop thread (a profile function is per thread).
    """

    def __init__(self, start: CodeType, creators: TaskCreators | None = None) -> None:
        self.start = start
        self.creators = creators or TaskCreators()
        self.armed = False
        self.visits: list[tuple[str, str]] = []  # (side, module), uncollapsed
        self.end = 0  # len(visits) at the start frame's latest return
        self.yields: list[int] = []  # len(visits) at each return of the start frame (its yields, its end)
        self.first_engine_step: int | None = None  # index in visits of the first engine module's visit
        self.helpers: dict[str, int] = {}
        self.callbacks: list[tuple[int, Callback]] = []  # (len(visits) when it happened, the callback)
        self._side = "orchestrator"
        self._modules: dict[int, str] = {}  # id(f_globals) -> module name
        self._first_resume: dict[CodeType, int] = {}

    def _module(self, frame: FrameType) -> str:
        key = id(frame.f_globals)
        name = self._modules.get(key)
        if name is None:
            name = self._modules[key] = str(frame.f_globals.get("__name__", ""))
        return name

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" and event != "return":
            return
        code = frame.f_code
        if not self.armed:
            if event != "call" or code is not self.start:
                return
            self.armed = True
        if event == "call":
            module = self._module(frame)
            if is_helper(module):
                back = frame.f_back
                if back is None or self._module(back) != module:
                    self.helpers[module] = self.helpers.get(module, 0) + 1
            here: FrameType | None = frame
        else:
            here = frame.f_back
        current = side = None
        while here is not None:
            module = self._module(here)
            if counted(module):
                if current is None:
                    current = module
                side = side_of(module)
                if side is not None:
                    break
            here = here.f_back
        if current is not None:
            self._side = side or self._side
            if not self.visits or self.visits[-1] != (self._side, current):
                if self.first_engine_step is None and current.startswith(ENGINES):
                    self.first_engine_step = len(self.visits)
                self.visits.append((self._side, current))
        if event == "call" and current is not None and counted(current):
            self._check_callback(frame, code, current)
        if event == "return" and code is self.start:
            self.end = len(self.visits)
            self.yields.append(self.end)

    def _task_modules(self) -> set[str]:
        """The counted modules of the waiting coroutine frames the current task was started from."""
        try:
            task = asyncio.current_task()
        except RuntimeError:
            return set()
        return {m for f in self.creators.frames_of(task) if counted(m := self._module(f)) and _waiting(f)}

    def _stack_modules(self, frame: FrameType | None) -> set[str]:
        """The counted modules on ``frame``'s stack, with those waiting where the current task was started."""
        found = self._task_modules()
        while frame is not None:
            module = self._module(frame)
            if counted(module):
                found.add(module)
            frame = frame.f_back
        return found

    def _check_callback(self, frame: FrameType, code: CodeType, module: str) -> None:
        """A frame of counted ``module`` starts: a callback when its caller is another counted module and
        ``module`` has a frame waiting below that caller's (or on its task's creator's stack)."""
        if self._module(frame) != module:
            return  # the innermost counted frame is an older one: a library frame is starting
        first = self._first_resume.get(code)
        if first is None:
            first = self._first_resume[code] = _first_resume(code)
        if frame.f_lasti > first:
            return  # a coroutine resuming, not a call
        here = frame.f_back
        caller = None
        while here is not None:
            name = self._module(here)
            if counted(name):
                caller = name
                break
            here = here.f_back
        if caller is None or caller == module:
            return
        if module in self._stack_modules(here.f_back if here is not None else None):
            self.callbacks.append((len(self.visits), Callback(self._side, caller, module, code.co_qualname)))

    @contextlib.contextmanager
    def install(self):
        sys.setprofile(self)
        try:
            yield self
        finally:
            sys.setprofile(None)

    def report(self, task_type: str) -> PathReport:
        engine = self.first_engine_step
        back = next((i for i in self.yields if engine is not None and i > engine), None)
        path: list[Visit | None] = []
        round_trip_end = None
        last_side = None
        for i, (side, module) in enumerate(self.visits[: self.end]):
            if i == back:
                round_trip_end = len(path)
            if last_side is not None and side != last_side:
                path.append(None)
            last_side = side
            path.append(Visit(side, module))
        if back is not None and round_trip_end is None:
            round_trip_end = len(path)
        callbacks = [c for at, c in self.callbacks if at <= self.end]
        trip = None if back is None else sum(1 for at, _ in self.callbacks if at <= back)
        return PathReport(task_type, path, dict(sorted(self.helpers.items())), round_trip_end, callbacks, trip)


def _config(index_dir: Path, store_dir: str, overrides: dict[str, Any]):
    from switchyard.common.config import load_config

    return load_config(REPO / "config").with_overrides(**{
        **PACED,
        "retrieval.index_dir": str(index_dir),
        "orchestrator.task_store.sqlite_path": f"{store_dir}/tasks.sqlite3",
        **overrides,
    })


@contextlib.asynccontextmanager
async def stack(index_dir: Path, **overrides: Any) -> AsyncIterator[Any]:
    """The three services on port 0 servers; yields a bare AgentService stub on the orchestrator."""
    import grpc

    from switchyard.api import agent_pb2_grpc
    from switchyard.common.server import running
    from switchyard.dispatcher.service import DispatcherService
    from switchyard.orchestrator.service import OrchestratorService
    from switchyard.retrieval.service import RetrievalService

    with tempfile.TemporaryDirectory(prefix="switchyard-path-") as store:
        cfg = _config(index_dir, store, overrides)
        async with running([RetrievalService(cfg)], cfg.server) as retrieval, \
                running([DispatcherService(cfg)], cfg.server) as dispatcher:
            wired = cfg.with_overrides(**{
                "orchestrator.retrieval_addr": f"127.0.0.1:{retrieval.port}",
                "orchestrator.dispatcher_addr": f"127.0.0.1:{dispatcher.port}",
            })
            async with running([OrchestratorService(wired)], cfg.server) as orch:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{orch.port}") as channel:
                    yield agent_pb2_grpc.AgentServiceStub(channel)


MAX_TOKENS = 32
"""Each task's ``max_tokens`` by default: room for a react_loop step's whole tool call on the sim engine (at 8 the
orchestrator refused the task INVALID_ARGUMENT naming ``max_tokens``, its first step cut inside its call)."""


async def run_task(stub: Any, task_type: str, max_tokens: int) -> list[Any]:
    from switchyard.api import agent_pb2

    request = agent_pb2.RunTaskRequest(payload=PAYLOADS[task_type], task_type=task_type, max_tokens=max_tokens)
    events = [event async for event in stub.RunTask(request)]
    if not events or not events[-1].HasField("final"):
        raise RuntimeError(f"{task_type}: the task ended without a final event ({len(events)} events)")
    return events


async def measure(index_dir: Path, task_types: Sequence[str], max_tokens: int = MAX_TOKENS, repeat: int = 1,
                  **overrides: Any) -> list[PathReport]:
    """Record ``repeat`` tasks of each type (after one warm-up each) on a fresh in-process stack.

    Raises:
        RuntimeError: a task ended without a final event.
    """
    from switchyard.orchestrator.service import OrchestratorService

    start = OrchestratorService.RunTask.__code__
    reports = []
    with TaskCreators().install() as creators:
        async with stack(index_dir, **overrides) as stub:
            for task_type in task_types:
                await run_task(stub, task_type, max_tokens)  # warm-up
                for _ in range(repeat):
                    recorder = PathRecorder(start, creators)
                    with recorder.install():
                        await run_task(stub, task_type, max_tokens)
                    reports.append(recorder.report(task_type))
    return reports


def build_index(docs: Sequence[str], out_dir: Path) -> Path:
    """An index of ``docs`` in ``out_dir`` (the embedding model loads offline)."""
    from switchyard.common.config import load_config
    from switchyard.retrieval.indexer import build_index as build

    build(list(docs), out_dir, load_config(REPO / "config"), progress=False)
    return out_dir


FIGURES: dict[str, Callable[[PathReport], int]] = {
    "callbacks (returns into an already-left module, the issue's count)": lambda r: len(r.callbacks),
    "callbacks on the dispatcher side": lambda r: len(r.dispatcher_callbacks),
    "visits": lambda r: r.visits,
    "RPC boundaries": lambda r: r.boundaries,
    "strict module returns (every call's return too)": lambda r: len(r.returns),
    "modules returned into": lambda r: len(r.modules_returned_into),
    "strict returns on the dispatcher side": lambda r: len(r.dispatcher_returns),
}


def most_common(values: Sequence[int]) -> int:
    """The most common of ``values`` (the smallest of those tied)."""
    tally = Counter(values)
    return min(tally, key=lambda v: (-tally[v], v))


def summary(reports: Sequence[PathReport]) -> str:
    """Each figure of :data:`FIGURES` over ``reports``: its most common value, then its range when it varies."""
    parts = []
    for name, figure in FIGURES.items():
        values = [figure(r) for r in reports]
        spread = f" [{min(values)}-{max(values)}]" if min(values) != max(values) else ""
        parts.append(f"{name} {most_common(values)}{spread}")
    return ", ".join(parts)


def print_reports(reports: Sequence[PathReport], show_path: bool, out: Any = sys.stdout) -> None:
    """Per task type: the round trip's and the whole task's figures, the round trip's path (of the task whose
    returns are the most common) and the helper entries."""
    for task_type in dict.fromkeys(r.task_type for r in reports):
        mine = [r for r in reports if r.task_type == task_type]
        trips = [r.round_trip() for r in mine]
        usual = most_common([len(t.callbacks) for t in trips])
        shown = next(i for i, t in enumerate(trips) if len(t.callbacks) == usual)
        print(f"{task_type} ({len(mine)} recorded; each figure: its most common value [its range]):", file=out)
        print(f"  round trip (RunTask to the first engine step and back to RunTask's next event): {summary(trips)}",
              file=out)
        calls = Counter(f"{c.side}: {c}" for c in trips[shown].callbacks)
        print("    callbacks: " + ("; ".join(f"{name} x{n}" if n > 1 else name for name, n in calls.items())
                                  or "none"), file=out)
        print(f"    path: {trips[shown].collapsed()}", file=out)
        print(f"  whole task: {summary(mine)}", file=out)
        if show_path:
            calls = Counter(f"{c.side}: {c}" for c in mine[shown].callbacks)
            print("    callbacks: " + ("; ".join(f"{name} x{n}" if n > 1 else name for name, n in calls.items())
                                      or "none"), file=out)
            print(f"    path: {mine[shown].collapsed()}", file=out)
        helpers = ", ".join(f"{m.removeprefix('switchyard.')} {n}" for m, n in mine[shown].helper_entries.items())
        print(f"  helper entries, not counted: {helpers or 'none'}", file=out)


def main(argv: list[str] | None = None) -> int:
    from switchyard_harness.arg_types import count, max_tokens

    parser = argparse.ArgumentParser(prog="tools/request_path.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task-types", default="chat,rag_answer,react_loop",
                        help="comma-separated task types, recorded in this order (default: all three)")
    parser.add_argument("--max-tokens", type=max_tokens, default=MAX_TOKENS,
                        help=f"max_tokens of each task (default {MAX_TOKENS})")
    parser.add_argument("--repeat", type=count, default=3, help="recorded tasks of each type (default 3)")
    parser.add_argument("--index-dir", help="an index for retrieval (default: one built from --docs)")
    parser.add_argument("--docs", nargs="*", default=[str(REPO / "README.md")],
                        help="files to index when no --index-dir is given (default: README.md)")
    parser.add_argument("--show-path", action="store_true", help="print the whole task's path too")
    args = parser.parse_args(argv)
    task_types = [t for t in args.task_types.split(",") if t]
    if unknown := set(task_types) - set(PAYLOADS):
        parser.error(f"--task-types: expected some of {', '.join(PAYLOADS)}, got {', '.join(sorted(unknown))}")
    import uvloop

    with tempfile.TemporaryDirectory(prefix="switchyard-path-index-") as tmp:
        index_dir = Path(args.index_dir) if args.index_dir else build_index(args.docs, Path(tmp))
        reports = uvloop.run(measure(index_dir, task_types, args.max_tokens, args.repeat))
    print_reports(reports, args.show_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
