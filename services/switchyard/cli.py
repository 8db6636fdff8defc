"""The ``switchyard`` command.

Subcommands that belong to one part of the system live beside it and take
their own arguments; this module only routes to them:

- ``up``: start all three services as separate processes (switchyard.launcher)
- ``serve NAME``: start one service (orchestrator, retrieval, dispatcher, sim-openai)
- ``run QUESTION``: stream one task (switchyard.client)
- ``index [PATHS]``: build the vector index (switchyard.retrieval.indexer)
- ``doctor``: check the model gateway set-up (switchyard.gateway.doctor)
- ``bench``: load generator and A/B comparison (switchyard_harness.bench.cli)
- ``top``: live terminal view of a running stack from its /metrics (switchyard_harness.top)
- ``profile SERVICE``: CPU profile of a running service (switchyard_harness.cpu_profile)

``bench``, ``top``, ``profile`` and ``serve sim-openai`` live in the harness (package
``switchyard_harness``, the repository's ``harness/`` folder), imported only when one of them
runs (:func:`harness_module`); without it they say what to install and exit 1, and every
other command works as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

HARNESS = "switchyard_harness"
"""The measuring path's package: benchmarks, the fake upstream, top and profile, test tooling."""

# subcommand -> (module, one-line help). Each module has ``main(argv) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("switchyard.launcher", "start orchestrator, retrieval and dispatcher as separate processes"),
    "serve": ("switchyard.serve", "start one service: orchestrator | retrieval | dispatcher | sim-openai"),
    "run": ("switchyard.client", "stream one task's events"),
    "index": ("switchyard.retrieval.indexer",
              "build the vector index (default: CPython's documentation topics) and export the query encoder"),
    "doctor": ("switchyard.gateway.doctor", "check base URL, API key, model id and proxies of the model gateway"),
    "bench": ("switchyard_harness.bench.cli", "load-test RunTask (ghz report format), or one of the benchmarks: "
              "run, compare, sched, isolation, agents, route, pool, fault, upstream, retrieval, diff, http"),
    "top": ("switchyard_harness.top", "live view of a running stack from its /metrics; --once --json for scripts"),
    "config": ("switchyard.common.config.reference",
               "the configuration reference of every key (docs/configuration.md): config reference [--write|--check FILE]"),
    "profile": ("switchyard_harness.cpu_profile", "CPU profile of a running service: top functions by cumulative time, "
                "GC pauses; pprof file with --output"),
}


class HarnessMissing(Exception):
    """A harness command ran where the harness package is not installed (a service image)."""


def harness_module(module: str, command: str) -> ModuleType:
    """Import ``module`` of the harness for ``command`` (e.g. ``"switchyard bench"``).

    Raises:
        HarnessMissing: ``switchyard_harness`` is not installed; the message says what to install.
            A harness that is installed but lacks one of its own dependencies raises that
            ModuleNotFoundError unchanged.
    """
    if importlib.util.find_spec(HARNESS) is None:
        raise HarnessMissing(
            f"{command}: this command is part of the benchmark harness (package {HARNESS}, the "
            "repository's harness/ folder), which this installation lacks (the service images leave it "
            "out). Install Switchyard from a checkout of the repository: `pip install .` (or `make install`)."
        )
    return importlib.import_module(module)


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: switchyard COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'switchyard COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default: the process's arguments); its exit status."""
    try:
        return _command(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        # stdout to /dev/null, so that the interpreter's own flush at exit meets no closed pipe again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl-C: the user stopped it; 128 + SIGINT, as a shell reports it, no traceback
        return 130


def _command(argv: list[str]) -> int:
    if not argv:  # a usage error, as argparse answers one: the usage on stderr, exit 2
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from switchyard import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"switchyard: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target = COMMANDS[name][0]
    try:
        module = harness_module(target, f"switchyard {name}") if target.startswith(HARNESS + ".") \
            else importlib.import_module(target)
    except HarnessMissing as exc:
        print(exc, file=sys.stderr)
        return 1
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
