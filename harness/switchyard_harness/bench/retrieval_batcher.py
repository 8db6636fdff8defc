"""Benchmark of the query micro-batcher: ``python -m switchyard_harness.bench.retrieval_batcher``.

Sends N concurrent Retrieve calls through an in-process :class:`RetrievalService`
(the same queue, batcher and index as over gRPC, without the network) once per
``embed_batch_size`` setting and prints throughput, forward passes and mean batch
size, so the effect of sharing forward passes can be compared on one machine.
Needs a built index (``switchyard index``).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from switchyard_harness.arg_types import count
from switchyard.common.config import ConfigError, SwitchyardConfig, load_config
from switchyard.retrieval.index import IndexNotFoundError
from switchyard.retrieval.service import RetrievalService
from switchyard.common.cli_text import parser_for

QUESTIONS = (
    "How does the with statement work?",
    "What does the yield expression do?",
    "How do I catch an exception?",
    "What is operator precedence in Python?",
    "How are names resolved in nested functions?",
    "What does the global statement do?",
    "How do f-strings format numbers?",
    "When is __del__ called?",
)


async def run_once(config: SwitchyardConfig, queries: int) -> dict[str, float]:
    """Start a service with ``config``, send ``queries`` concurrent calls, stop it.

    Returns:
        seconds, queries_per_s, forward_passes, mean_batch, p50_embed_s, p95_embed_s.
    """
    service = RetrievalService(config)
    await service.start()
    try:
        texts = [f"{QUESTIONS[i % len(QUESTIONS)]} (variant {i})" for i in range(queries)]
        started = time.monotonic()
        replies = await asyncio.gather(*(service.retrieve(t) for t in texts))
        seconds = time.monotonic() - started
        sizes = service.batcher.batch_sizes
    finally:
        await service.stop()
    embeds = sorted(r.embed_s for r in replies)
    return {
        "seconds": seconds,
        "queries_per_s": queries / seconds,
        "forward_passes": len(sizes),
        "mean_batch": statistics.fmean(sizes),
        "p50_embed_s": embeds[len(embeds) // 2],
        "p95_embed_s": embeds[min(len(embeds) - 1, int(len(embeds) * 0.95))],
    }


def main(argv: list[str]) -> int:
    """Entry point; prints one line per setting. Exit 0, or 2 on bad config or a missing index."""
    parser = parser_for("python -m switchyard_harness.bench.retrieval_batcher", __doc__)
    parser.add_argument("--config-dir", help="config folder (default: SWITCHYARD_CONFIG_DIR or config/)")
    parser.add_argument("--index-dir", help="index folder (default: retrieval.index_dir)")
    parser.add_argument("--queries", type=count, default=96, help="concurrent Retrieve calls per run (default 96)")
    parser.add_argument(
        "--batch-sizes", default="1,32", help="comma-separated embed_batch_size values to compare (default 1,32)"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config_dir)
        if args.index_dir:
            config = config.with_overrides(**{"retrieval.index_dir": args.index_dir})
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except (ConfigError, ValueError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    workers = config.queues.retrieval.workers
    print(f"{args.queries} concurrent Retrieve calls, {workers} retrieval queue workers")
    for size in sizes:
        overrides = {
            "retrieval.embed_batch_size": size,
            # no queue timeouts while measuring throughput
            "queues.retrieval": {"capacity": max(args.queries, 1), "workers": workers, "timeout_ms": 3_600_000},
        }
        try:
            result = asyncio.run(run_once(config.with_overrides(**overrides), args.queries))
        except (ConfigError, IndexNotFoundError) as exc:
            print(f"bench: {exc}", file=sys.stderr)
            return 2
        print(
            f"embed_batch_size={size:<4} {result['seconds']:.2f} s  {result['queries_per_s']:.0f} queries/s  "
            f"{result['forward_passes']:.0f} forward passes  mean batch {result['mean_batch']:.1f}  "
            f"embed p50 {result['p50_embed_s'] * 1000:.1f} ms  p95 {result['p95_embed_s'] * 1000:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
