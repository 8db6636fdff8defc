"""CPU profiles on demand: ``/debug/pprof/profile?seconds=N`` on every service's metrics port.

A request profiles the service's event-loop thread (where its RPCs, queues and
scheduling run) for N seconds with pyinstrument's sampling profiler
(``setstatprofile``: the stack is recorded at most once per
:data:`INTERVAL_S`), and answers pprof's format: a gzip-compressed
``perftools.profiles.Profile`` (proto/profile.proto, from github.com/google/pprof),
which ``go tool pprof`` and other pprof viewers open. Sample values are wall
time in nanoseconds. The garbage collector's pauses in the same window, read
through :data:`gc.callbacks`, travel in the profile's comments
(``gc_pause_ns=...``, ``gc_collections=...``; ``go tool pprof -comments``)
together with the process's CPU seconds.

Nothing runs while no profile is asked for: the profiler and the GC callback
are installed for the window only, one profile at a time (a second request
meanwhile answers 409); a profile whose caller closed its connection stops
there, as Go's net/http/pprof does.

Who may ask (``server.cpu_profile``): ``loopback`` (default) serves it when the
metrics port listens on a loopback address, and on other addresses only where
the service checks bearer tokens (the orchestrator with ``orchestrator.auth``
on: ``Authorization: Bearer <token>``, a token that may call every method or
:data:`PROFILE_METHOD`); ``on`` serves it on any address (still behind tokens
where auth is on); ``off`` never.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import gzip
import ipaddress
import resource
import re
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs

from pyinstrument import Profiler
from pyinstrument.frame_info import ATTRIBUTE_MARKER_CLASS_NAME, ATTRIBUTE_MARKER_LINE_NUMBER, parse_frame_info

from switchyard.api import profile_pb2

INTERVAL_S = 0.001
"""Sampling interval, seconds: pyinstrument's default."""
PROFILE_METHOD = "switchyard.Debug/CpuProfile"
"""The method name a bearer token restricted to methods must list to take profiles."""
PATH = "/debug/pprof/profile"
DEFAULT_SECONDS = 30
"""A profile's window when ``seconds`` is not given, seconds (Go's net/http/pprof default)."""
SECONDS_PATTERN = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")
"""What ``seconds`` may be: a plain decimal number."""


GONE_POLL_S = 0.25
"""How often a profile being recorded asks whether its caller is still there, seconds."""


class ProfileAbandoned(RuntimeError):
    """The caller of a profile went away while it was recorded: the profile was stopped, and nobody reads it."""


class ProfileBusy(RuntimeError):
    """A profile is already being recorded in this process; ``retry_after_s``: seconds until its window ends."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"a CPU profile is already being recorded in this process; its window ends in "
                         f"{retry_after_s:.0f} s: retry then")
        self.retry_after_s = retry_after_s


@dataclass
class GcPauses:
    """Collections and their pause time, summed over a window (gc.callbacks 'start' -> 'stop')."""

    collections: int = 0
    pause_ns: int = 0
    _started: int = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter_ns()
        elif self._started:
            self.pause_ns += time.perf_counter_ns() - self._started
            self.collections += 1
            self._started = 0


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Strings:
    """pprof's string table: index 0 is the empty string."""

    def __init__(self) -> None:
        self.table = [""]
        self._index = {"": 0}

    def __call__(self, text: str) -> int:
        index = self._index.get(text)
        if index is None:
            index = self._index[text] = len(self.table)
            self.table.append(text)
        return index


def to_pprof(frame_records: Iterable[tuple[list[str], float]], start_s: float, duration_s: float,
             comments: Iterable[str] = ()) -> profile_pb2.Profile:
    """pyinstrument's samples (call stack root first, seconds) -> a pprof Profile of wall nanoseconds.

    One Function per (name, file, first line), one Location per (function, line); a sample's locations
    run leaf first, as profile.proto asks.
    """
    strings = _Strings()
    functions: dict[tuple[str, str, int], int] = {}
    locations: dict[tuple[int, int], int] = {}
    profile = profile_pb2.Profile()
    for stack, seconds in frame_records:
        ids = []
        for info in stack:
            identifier, attributes = parse_frame_info(info)
            name, _, rest = identifier.partition("\x00")
            path, _, first = rest.partition("\x00")
            line = int(first or 0)
            for attribute in attributes:
                if attribute.startswith(ATTRIBUTE_MARKER_CLASS_NAME):
                    name = f"{attribute[1:]}.{name}"
                elif attribute.startswith(ATTRIBUTE_MARKER_LINE_NUMBER):
                    line = int(attribute[1:] or line)
            key = (name, path, int(first or 0))
            fid = functions.get(key)
            if fid is None:
                fid = functions[key] = len(functions) + 1
                profile.function.add(id=fid, name=strings(name), system_name=strings(name), filename=strings(path),
                                     start_line=key[2])
            lid = locations.get((fid, line))
            if lid is None:
                lid = locations[(fid, line)] = len(locations) + 1
                profile.location.add(id=lid, line=[profile_pb2.Line(function_id=fid, line=line)])
            ids.append(lid)
        ids.reverse()
        profile.sample.add(location_id=ids, value=[1, int(seconds * 1e9)])
    profile.sample_type.add(type=strings("samples"), unit=strings("count"))
    profile.sample_type.add(type=strings("wall"), unit=strings("nanoseconds"))
    profile.default_sample_type = strings("wall")  # an index into the string table (profile.proto), not a position
    profile.period_type.CopyFrom(profile_pb2.ValueType(type=strings("wall"), unit=strings("nanoseconds")))
    profile.period = int(INTERVAL_S * 1e9)
    profile.time_nanos = int(start_s * 1e9)
    profile.duration_nanos = int(duration_s * 1e9)
    profile.comment.extend(strings(c) for c in comments)
    profile.string_table.extend(strings.table)
    return profile


class LoopProfiler:
    """Profiles the thread of ``loop`` on request from another thread (the metrics server's).

    Args:
        loop: the service's running event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._ends_at = 0.0  # monotonic seconds: when the profile being recorded ends

    async def _record(self, seconds: float, stop: asyncio.Event) -> tuple[Any, GcPauses, float]:
        profiler = Profiler(interval=INTERVAL_S, async_mode="disabled")
        pauses = GcPauses()
        cpu = _cpu_s()
        gc.callbacks.append(pauses)
        profiler.start()  # on the loop's thread: setstatprofile hooks this thread
        try:
            with contextlib.suppress(TimeoutError):  # the window's end; ``stop``: its caller went away
                await asyncio.wait_for(stop.wait(), seconds)
        finally:
            session = profiler.stop()
            gc.callbacks.remove(pauses)
        return session, pauses, _cpu_s() - cpu

    def profile(self, seconds: float, gone: Callable[[], bool] = lambda: False) -> bytes:
        """Record ``seconds`` of the loop's thread; returns the gzip'd pprof Profile. Blocks the calling thread.
        ``gone``: whether the caller went away, asked every :data:`GONE_POLL_S` (as Go's net/http/pprof ends a
        profile whose request's context is done): the profiler's cost on the loop (a tenth to two fifths of its
        throughput, docs/benchmarks.md) ends with it, and the one profile slot is free again. It held both to the
        window's end, up to ``server.cpu_profile_max_s`` (300 s), with every other caller answered 409.

        Raises:
            ProfileBusy: another profile is being recorded.
            ProfileAbandoned: ``gone`` said the caller went away; the profile was stopped.
            TimeoutError: the loop did not finish the window within ``seconds`` + 60 s (it is blocked).
        """
        if not self._lock.acquire(blocking=False):
            raise ProfileBusy(max(1.0, self._ends_at - time.monotonic()))
        try:
            self._ends_at = time.monotonic() + seconds
            started = time.time()
            stop = asyncio.Event()
            future = asyncio.run_coroutine_threadsafe(self._record(seconds, stop), self.loop)
            give_up = time.monotonic() + seconds + 60
            while True:
                try:
                    session, pauses, cpu_s = future.result(timeout=GONE_POLL_S)
                    break
                except TimeoutError:
                    if time.monotonic() > give_up:
                        raise
                    if gone():
                        self.loop.call_soon_threadsafe(stop.set)
                        future.result(timeout=60)  # the profiler is off the loop before the slot is free
                        raise ProfileAbandoned("the caller went away; the profile was stopped") from None
            comments = [f"gc_pause_ns={pauses.pause_ns}", f"gc_collections={pauses.collections}",
                        f"process_cpu_s={cpu_s:.6f}", f"sampler=pyinstrument interval_s={INTERVAL_S}",
                        "thread=event loop"]
            profile = to_pprof(session.frame_records, started, session.duration, comments)
            return gzip.compress(profile.SerializeToString())
        finally:
            self._lock.release()


CONNECTION_KEY = "switchyard.connection"
"""The WSGI environ key under which the metrics server (process_metrics.py) passes a request's socket."""


def caller_gone(environ: dict[str, Any]) -> bool:
    """Whether the client of this WSGI request closed its connection: its socket reads as ended (readable, and
    a peek finds no byte). Bytes it sent after its request (a pipelined one) are left for the server to read.
    False where the server passed no socket."""
    connection = environ.get(CONNECTION_KEY)
    if connection is None:
        return False
    try:
        with selectors.DefaultSelector() as selector:  # not select(): a descriptor past 1024 is a ValueError there
            selector.register(connection, selectors.EVENT_READ)
            readable = selector.select(0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # reset by its peer
        return True


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ProfileEndpoint:
    """The WSGI side of ``/debug/pprof/profile``: access rules, the ``seconds`` parameter, the answer.

    Args:
        profiler: the process's :class:`LoopProfiler`.
        mode: ``server.cpu_profile`` (loopback, on, off).
        host: the address the metrics port listens on.
        max_s: ``server.cpu_profile_max_s``.
        tokens: the service's bearer tokens (common/auth.py ``BearerTokens``), None when it checks none.
    """

    def __init__(self, profiler: LoopProfiler, mode: str, host: str, max_s: float, tokens: Any = None) -> None:
        self.profiler, self.mode, self.host, self.max_s, self.tokens = profiler, mode, host, max_s, tokens

    def _refusal(self, environ: dict[str, Any]) -> tuple[str, str] | None:
        if self.mode == "off":
            return "404 Not Found", "CPU profiles are off (server.cpu_profile = off)"
        if self.mode == "loopback" and not is_loopback(self.host) and self.tokens is None:
            return ("403 Forbidden", f"CPU profiles are served on a loopback address only: this service listens on "
                    f"{self.host} and checks no bearer tokens (server.cpu_profile = loopback; set it to on to serve "
                    "them on this address, or listen on a loopback address)")
        if self.tokens is not None:
            refused = self.tokens.check(PROFILE_METHOD, environ.get("HTTP_AUTHORIZATION"))
            if refused is not None:
                code, message = refused
                status = "403 Forbidden" if code.name == "PERMISSION_DENIED" else "401 Unauthorized"
                return status, message.replace("'authorization' metadata", "'Authorization' header")
        return None

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        def answer(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8",
                   headers: tuple[tuple[str, str], ...] = ()) -> list[bytes]:
            start_response(status, [("Content-Type", content_type), ("Content-Length", str(len(body))), *headers])
            return [body]

        if environ.get("REQUEST_METHOD", "GET") != "GET":  # a HEAD took the one profile slot, for nothing
            return answer("405 Method Not Allowed", f"{PATH} answers GET only\n".encode(), headers=(("Allow", "GET"),))
        refused = self._refusal(environ)
        if refused is not None:
            challenge = (("WWW-Authenticate", 'Bearer realm="switchyard"'),) if refused[0].startswith("401") else ()
            return answer(refused[0], (refused[1] + "\n").encode(), headers=challenge)
        given = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True).get("seconds")
        raw = given[0] if given else str(DEFAULT_SECONDS)
        # one plain decimal number: Python's float() also takes "0_1" (1 s), "1e0", "inf", "nan" and spaces
        seconds = float(raw) if given is None or (len(given) == 1 and SECONDS_PATTERN.fullmatch(raw)) else -1.0
        if not 0 < seconds <= self.max_s:
            shown = raw if given is None or len(given) == 1 else given
            return answer("400 Bad Request", f"seconds: expected one plain decimal number in (0, {self.max_s:g}] "
                          f"(server.cpu_profile_max_s; {DEFAULT_SECONDS} when left out), got {shown!r}\n".encode())
        try:
            data = self.profiler.profile(seconds, lambda: caller_gone(environ))
        except ProfileAbandoned:
            return answer("499 Client Closed Request", b"")  # nobody reads it: nginx's word for the case
        except ProfileBusy as exc:
            return answer("409 Conflict", f"{exc}\n".encode(),
                          headers=(("Retry-After", str(max(1, round(exc.retry_after_s)))),))
        except TimeoutError:
            return answer("503 Service Unavailable", b"the event loop did not end the profile in time\n")
        return answer("200 OK", data, "application/octet-stream")


# --------------------------------------------------------------------------- reading a profile back


@dataclass
class FunctionTime:
    """One function's share of a profile: ``flat_ns`` as the leaf, ``cum_ns`` anywhere on the stack."""

    name: str
    filename: str
    line: int
    flat_ns: int
    cum_ns: int


def read_pprof(data: bytes) -> profile_pb2.Profile:
    """A pprof profile, gzip'd (as served and as pprof writes them) or not.

    Raises:
        google.protobuf.message.DecodeError: not a Profile.
    """
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return profile_pb2.Profile.FromString(data)


def comments(profile: profile_pb2.Profile) -> dict[str, str]:
    """The profile's ``key=value`` comments (gc_pause_ns, gc_collections, process_cpu_s, ...)."""
    out = {}
    for index in profile.comment:
        for part in profile.string_table[index].split():
            key, sep, value = part.partition("=")
            if sep:
                out[key] = value
    return out


def top_functions(profile: profile_pb2.Profile, sample_index: int | None = None) -> list[FunctionTime]:
    """Every function with its flat and cumulative time, most cumulative first (``go tool pprof -top -cum``).

    ``sample_index``: which value of each sample to sum (default: the profile's default sample type,
    else the last). A function that appears several times on one stack (recursion) counts once there.
    """
    strings = profile.string_table
    index = sample_index
    if index is None:
        default = profile.default_sample_type
        index = next((i for i, t in enumerate(profile.sample_type) if default and t.type == default),
                     len(profile.sample_type) - 1)
    function_of = {loc.id: [line.function_id for line in loc.line] for loc in profile.location}
    functions = {f.id: f for f in profile.function}
    flat: dict[int, int] = {}
    cum: dict[int, int] = {}
    for sample in profile.sample:
        value = sample.value[index]
        seen: set[int] = set()
        for depth, location in enumerate(sample.location_id):
            ids = function_of.get(location, [])
            if depth == 0 and ids:
                flat[ids[0]] = flat.get(ids[0], 0) + value
            for fid in ids:
                if fid not in seen:
                    seen.add(fid)
                    cum[fid] = cum.get(fid, 0) + value
    rows = [FunctionTime(strings[functions[f].name], strings[functions[f].filename], functions[f].start_line,
                         flat.get(f, 0), total) for f, total in cum.items()]
    rows.sort(key=lambda r: (-r.cum_ns, -r.flat_ns, r.name))
    return rows
