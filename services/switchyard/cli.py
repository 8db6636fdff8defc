"""The ``switchyard`` command.

Subcommands that belong to one part of the system live beside it and take
their own arguments; this module only routes to them:

- ``up``: start all three services as separate processes (switchyard.launcher)
- ``serve NAME``: start one service (orchestrator, retrieval, dispatcher, sim-openai)
- ``run QUESTION``: stream one task (switchyard.client)
- ``index [PATHS]``: build the vector index (switchyard.retrieval.indexer)
- ``doctor``: check the model gateway set-up (switchyard.gateway.doctor)
- ``bench``: load generator and A/B comparison (switchyard.bench.cli)
- ``top``: live terminal view of a running stack from its /metrics (switchyard.top)
- ``profile SERVICE``: CPU profile of a running service (switchyard.cpu_profile)
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Each module has ``main(argv) -> int``.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("switchyard.launcher", "start orchestrator, retrieval and dispatcher as separate processes"),
    "serve": ("switchyard.serve", "start one service: orchestrator | retrieval | dispatcher | sim-openai"),
    "run": ("switchyard.client", "stream one task's events"),
    "index": ("switchyard.retrieval.indexer",
              "build the vector index (default: CPython's documentation topics) and export the query encoder"),
    "doctor": ("switchyard.gateway.doctor", "check base URL, API key, model id and proxies of the model gateway"),
    "bench": ("switchyard.bench.cli", "load-test RunTask (ghz report format), or one of the benchmarks: "
              "compare, sched, isolation, agents, route, fault, retrieval"),
    "top": ("switchyard.top", "live view of a running stack from its /metrics; --once --json for scripts"),
    "config": ("switchyard.common.config.reference",
               "the configuration reference of every key (docs/configuration.md): config reference [--write|--check FILE]"),
    "profile": ("switchyard.cpu_profile", "CPU profile of a running service: top functions by cumulative time, "
                "GC pauses; pprof file with --output"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: switchyard COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'switchyard COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
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
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
