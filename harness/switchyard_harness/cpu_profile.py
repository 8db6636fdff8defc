"""``switchyard profile SERVICE``: a CPU profile of a running service, and its top functions.

    switchyard profile orchestrator --seconds 30 --top 15
    switchyard profile 127.0.0.1:9103 --seconds 10 --output dispatcher.pb.gz
    switchyard profile agent_cpu.pprof         # a profile saved before (curl's or --output's), read back

SERVICE is orchestrator, retrieval or dispatcher (its metrics port from the up
file that ``switchyard up`` writes, else from the config), or a metrics
endpoint as host:port or URL. The service records its event-loop thread for
``--seconds`` (``/debug/pprof/profile``, common/profiling.py); this prints the
functions with the most cumulative time (``go tool pprof -top -cum``: flat is
time as the innermost Python frame, cum is time anywhere on the stack, both
wall-clock), the process's CPU seconds and the garbage collector's pause time
in the same window. ``--output`` keeps the profile (gzip'd pprof protobuf) for
``go tool pprof -http=: FILE`` or any pprof viewer.

A service with ``orchestrator.auth`` on answers only a bearer token: the value of
``SWITCHYARD_AUTH_TOKEN`` (another variable with ``--token-env NAME``), as
``switchyard run`` sends it, or the contents of ``--token-file FILE``, which wins
over the variable (switchyard.common.client_token).

Exit status: 0; 1 when the service refused or could not be reached, or a saved file is not a pprof
profile; 2 for bad arguments (an unreadable or empty ``--token-file`` among them, and a ``--seconds`` past
the service's ``server.cpu_profile_max_s``, which it answers 400).
"""

from __future__ import annotations

import argparse
import http.client
import sys
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

from google.protobuf.message import DecodeError

from switchyard.common.cli_text import parser_for
from switchyard.common.config import ConfigError
from switchyard.common.config.base import did_you_mean
from switchyard.common.profiling import PATH, comments, read_pprof, top_functions
from switchyard.common import outputs
from switchyard.common.client_token import TokenError, add_token_options, authorization, bearer_token
from switchyard_harness.top import NOT_HTTP1, SERVICES, endpoints_from, metrics_url


def profile_url(service: str, up_file: str | None, config_dir: str | None, seconds: float) -> str:
    """The ``/debug/pprof/profile`` URL of ``service`` (a name, host:port or URL). A name whose endpoint comes
    from the config's ports, not the up file, is said so on stderr with why (the up file stale, absent, ...).

    Raises:
        ValueError: ``service`` is neither a service name nor host:port or a URL.
    """
    if service in SERVICES:
        flags = argparse.Namespace(up_file=up_file, config_dir=config_dir, **{name: None for name in SERVICES})
        endpoints, source = endpoints_from(flags)
        url = endpoints[service]
        if source.startswith("config"):  # the up file was not read: say why (a stale --up-file is left in place)
            print(f"switchyard profile: the {service}'s endpoint from the {source}", file=sys.stderr)
    elif "://" not in service and ":" not in service:  # a word: a mistyped service name, not an address
        saved = " (no such profile file)" if "." in service or "/" in service else ""
        raise ValueError(f"expected one of {', '.join(SERVICES)}, a metrics endpoint host:port or URL, or a saved "
                         f"profile's file (got {service!r}{saved}){did_you_mean(service, SERVICES)}")
    else:
        url = metrics_url(service)
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, PATH, f"seconds={seconds:g}", ""))


IDLE_LEAVES = frozenset({("run", "runners.py"), ("run_until_complete", "base_events.py"),
                         ("run_forever", "base_events.py"), ("select", "selectors.py")})
"""(function, file) of a sample's innermost Python frame while the event loop waits: asyncio's selector, or uvloop's
loop, which runs in C below ``Runner.run`` (its own I/O callbacks too, which Python cannot see)."""


def report(data: bytes, top: int) -> str:
    """The text this command prints for the profile ``data``: the window, GC pauses, the event loop's waiting
    share, and the ``top`` functions by cumulative time, leaving out the entry frames every sample holds
    (``<module>``, ``main``, ``Runner.run``: named on one line) and the waiting frames."""
    profile = read_pprof(data)
    notes = comments(profile)
    total = sum(s.value[-1] for s in profile.sample)
    window_s = profile.duration_nanos / 1e9
    gc_ms = int(notes.get("gc_pause_ns", 0)) / 1e6
    rows = top_functions(profile)
    idle = {id(r) for r in rows if (r.name.rsplit(".", 1)[-1], Path(r.filename).name) in IDLE_LEAVES}  # Runner.run
    idle_ns = sum(r.flat_ns for r in rows if id(r) in idle)
    everywhere = [r for r in rows if total and r.cum_ns >= total]
    lines = [
        f"window {window_s:.2f} s, {len(profile.sample)} samples of the event-loop thread "
        f"({total / 1e9:.2f} s of wall time), process CPU {float(notes.get('process_cpu_s', 0)):.2f} s",
        f"GC pauses: {gc_ms:.1f} ms in {notes.get('gc_collections', 0)} collections "
        f"({100 * gc_ms / 1000 / window_s if window_s else 0:.2f} % of the window)",
        f"event loop waiting: {100 * idle_ns / total if total else 0:.1f} % of the samples (in the selector, or in "
        "uvloop's C loop: idle, or its own I/O)",
    ]
    if everywhere:
        lines.append(f"on every sample, not listed: {', '.join(r.name for r in everywhere)}")
    lines += ["", f"{'flat':>10} {'flat%':>6} {'cum':>10} {'cum%':>6}  function"]
    listed = [r for r in rows if r not in everywhere and id(r) not in idle]
    for row in listed[:top]:
        where = f"{row.filename}:{row.line}" if row.filename else ""
        lines.append(f"{row.flat_ns / 1e6:8.1f}ms {100 * row.flat_ns / total if total else 0:5.1f}% "
                     f"{row.cum_ns / 1e6:8.1f}ms {100 * row.cum_ns / total if total else 0:5.1f}%  {row.name}  {where}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = parser_for("switchyard profile", __doc__)
    parser.add_argument("service", help="orchestrator | retrieval | dispatcher, or a metrics endpoint host:port or URL; "
                        "or a saved profile's file (curl's or --output's), read back instead of profiling")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the profile, seconds (default 30)")
    parser.add_argument("--top", type=int, default=15, help="functions to print (default 15)")
    parser.add_argument("--output", help="also write the profile (gzip'd pprof protobuf) to this file")
    add_token_options(parser)
    parser.add_argument("--up-file", help="endpoints file written by switchyard up (default: its usual place); one "
                        "whose switchyard up is gone is said to be stale and left in place")
    parser.add_argument("--config-dir", help="config folder for the fallback ports (default: config/)")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 3600:
        parser.error(f"--seconds: expected seconds in (0, 3600] (got {args.seconds:g})")
    if args.top < 1:
        parser.error(f"--top: expected a count >= 1 (got {args.top})")
    if args.output and (problem := outputs.unwritable(args.output)):  # found now, not after the profile's window
        parser.error(f"--output: expected a file that can be written ({problem})")
    saved = Path(args.service)
    if args.service not in SERVICES and saved.is_dir():
        parser.error(f"service: {args.service!r} is a directory; name a saved profile's file, a service or an endpoint")
    if args.service not in SERVICES and saved.is_file():  # a profile written before: read back, nothing asked
        try:
            data = saved.read_bytes()
            if not read_pprof(data).sample_type:  # an empty file parses as an empty Profile
                raise ValueError("no sample types: empty, or not a profile")
            text = report(data, args.top)
        except (DecodeError, OSError, EOFError, zlib.error, ValueError, IndexError) as exc:
            # not protobuf; a broken gzip stream; a Profile whose indexes or comments do not hold
            print(f"switchyard profile: {saved} is not a pprof profile ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 1
        print(text)
        return 0
    try:
        url = profile_url(args.service, args.up_file, args.config_dir, args.seconds)
    except ConfigError as exc:
        print(f"switchyard profile: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        parser.error(f"service: {exc}")
    try:
        token = bearer_token(args.token_file, args.token_env)
    except TokenError as exc:
        parser.error(str(exc))
    request = urllib.request.Request(url, headers=authorization(token))
    print(f"profiling {args.service} for {args.seconds:g} s ({url}) ...", file=sys.stderr, flush=True)
    try:
        with urllib.request.urlopen(request, timeout=args.seconds + 90) as reply:
            data = reply.read()
    except urllib.error.HTTPError as exc:
        hint = (f"; set {args.token_env} (or pass --token-file FILE) to the bearer token (the service checks "
                "tokens: orchestrator.auth)" if exc.code == 401 and token is None else "")
        print(f"switchyard profile: {url} answered {exc.code}: {exc.read().decode(errors='replace').strip()}{hint}",
              file=sys.stderr)
        return 2 if exc.code == 400 else 1  # 400: an argument the service refused (--seconds past its maximum)
    except http.client.HTTPException as exc:
        closed = "closed the connection without an answer; " if isinstance(exc, OSError) else ""  # RemoteDisconnected
        print(f"switchyard profile: {url}: {closed}{NOT_HTTP1}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"switchyard profile: cannot reach {url}: {exc}; is the service running (switchyard up)?",
              file=sys.stderr)
        return 1
    if args.output:
        try:
            outputs.write(args.output, data)
        except OSError as exc:
            print(f"switchyard profile: --output {args.output}: could not write the profile ({exc.strerror or exc})",
                  file=sys.stderr)
            return 1
        print(f"wrote {args.output} (pprof; open with: go tool pprof -http=: {args.output})", file=sys.stderr)
    print(report(data, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
