"""Where the adaptive upstream limit settles when each window's throughput is off by a spread: the knee rule
(dispatcher/adaptive_limit.py) driven by synthetic servers (switchyard_harness.testing.limit_drive), 100
streams offered, 200 s of 0.5 s windows per seed, on a simulated clock (repeatable, no server).

    python tools/limit_noise.py                 # 10 seeds, spreads 0, 10 % and 20 %
    python tools/limit_noise.py --offered 32

Prints, per server and spread, the limit each seed held over the run's second half (its median), sorted,
beside the server's knee (the concurrency where its throughput reaches 90 % of its plateau).
"""

from __future__ import annotations

import argparse
import statistics

from switchyard_harness.arg_types import count, fraction
from switchyard_harness.testing.limit_drive import drive, flat_then_falling, knee_server, make_limit, noisy

SERVERS = {
    "linear to 8, flat": (knee_server(8), 0.9 * 8),
    "linear to 24, flat": (knee_server(24), 0.9 * 24),
    "linear to 6, falling from 60": (flat_then_falling(6), 0.9 * 6),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=count, default=10, help="runs per server and spread (default 10)")
    parser.add_argument("--offered", type=count, default=100, help="BATCH streams offered (default 100)")
    parser.add_argument("--windows", type=count, default=400, help="windows of 0.5 s per run (default 400)")
    parser.add_argument("--spreads", type=fraction, nargs="+", default=[0.0, 0.1, 0.2],
                        help="window-to-window spreads of throughput, fractions (default 0 0.1 0.2)")
    args = parser.parse_args()
    print(f"{'server':<30} {'spread':>6} {'knee':>5}  limit held, per seed (median over the second half)")
    for name, (server, knee) in SERVERS.items():
        for spread in args.spreads:
            held = []
            for seed in range(args.seeds):
                limit = make_limit(initial_limit=4, max_limit=128)
                trace: list[tuple[float, int]] = []
                drive(limit, noisy(server, spread, seed), offered=args.offered, windows=args.windows, trace=trace)
                held.append(statistics.median(value for value, _ in trace[len(trace) // 2:]))
            print(f"{name:<30} {spread:>6.0%} {knee:>5.1f}  {' '.join(f'{v:.0f}' for v in sorted(held))}")


if __name__ == "__main__":
    main()
