"""Benchmark plots (matplotlib, Agg backend): a comparison of scenarios, and one run's distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_comparison(rows: list[dict[str, Any]], path: Path, subtitle: str = "") -> Path:
    """Write a PNG with two bar panels: engine busy ratio (and GPU util when measured), P95 latency.

    Args:
        rows: scenario rows from :func:`switchyard_harness.bench.compare.summarize`.
        path: the PNG to write.
        subtitle: the run's parameters (command, machine), shown under the title.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [r["scenario"] for r in rows]
    busy = [100 * (r["engine_busy_ratio"] or 0.0) for r in rows]
    gpu = [None if r["gpu_util"] is None else 100 * r["gpu_util"] for r in rows]
    p95 = [1000 * r["latency_s"]["p95"] for r in rows]
    fig, (ax_util, ax_p95) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(keys))
    if any(g is not None for g in gpu):
        width = 0.4
        ax_util.bar([i - width / 2 for i in x], busy, width, label="engine busy")
        ax_util.bar([i + width / 2 for i in x], [g or 0.0 for g in gpu], width, label="GPU util (NVML)")
    else:
        ax_util.bar(list(x), busy, color="tab:blue", label="engine busy")
    roofline = [r.get("roofline_efficiency") for r in rows]
    if any(v is not None for v in roofline):
        ax_util.plot(list(x), [100 * (v or 0.0) for v in roofline], "D", color="tab:green", markersize=9,
                     label="roofline efficiency")
    ax_util.legend(loc="lower right")
    ax_util.set_title("Utilisation per scenario")
    ax_util.set_ylabel("%")
    ax_util.set_ylim(0, 100)
    ax_p95.bar(list(x), p95, color="tab:orange", label="P95 latency")
    ax_p95.legend(loc="upper right")
    ax_p95.set_title("P95 latency per scenario")
    ax_p95.set_ylabel("ms")
    for ax in (ax_util, ax_p95):
        ax.set_xticks(list(x), [f"{r['scenario']}\n{r['rps']:.0f} rps" for r in rows])
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("switchyard bench compare" + (f"\n{subtitle}" if subtitle else ""), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_run(load: Any, path: Path, title: str) -> Path:
    """Write one run's PNG: latency histogram, TTFT distribution and throughput over time.

    Args:
        load: a :class:`switchyard_harness.bench.loadgen.LoadResult`.
        path: the PNG to write.
        title: the run's parameters, shown as the figure title.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in load.results if not r.error]
    latency = [1000 * r.latency_s for r in ok]
    ttft = sorted(1000 * r.ttft_s for r in ok if r.ttft_s is not None)
    fig, (ax_lat, ax_ttft, ax_rps) = plt.subplots(1, 3, figsize=(14, 4))
    if latency:
        ax_lat.hist(latency, bins=40, color="tab:blue", label=f"{len(latency)} OK calls")
        ax_lat.legend()
    ax_lat.set_title("Latency histogram")
    ax_lat.set_xlabel("ms")
    ax_lat.set_ylabel("calls")
    if ttft:
        ax_ttft.plot(ttft, [100 * (i + 1) / len(ttft) for i in range(len(ttft))], color="tab:green", label="TTFT")
        ax_ttft.legend(loc="lower right")
    ax_ttft.set_title("TTFT distribution (CDF)")
    ax_ttft.set_xlabel("ms")
    ax_ttft.set_ylabel("% of calls")
    if load.results:
        start = min(r.started_at for r in load.results)
        ends = sorted(r.started_at + r.latency_s - start for r in ok)
        errors = sorted(r.started_at + r.latency_s - start for r in load.results if r.error)
        width = max(1, int(max(ends + errors, default=0.0)) + 1)
        ax_rps.hist(ends, bins=width, range=(0, width), color="tab:purple", label="completed (OK) per second")
        if errors:
            ax_rps.hist(errors, bins=width, range=(0, width), color="tab:red", alpha=0.6, label="errors per second")
        ax_rps.legend(loc="lower right")
    ax_rps.set_title("Throughput over time")
    ax_rps.set_xlabel("s since the first call")
    ax_rps.set_ylabel("calls / s")
    for ax in (ax_lat, ax_ttft, ax_rps):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
