"""The comparison plot: engine utilisation and P95 latency per scenario (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_comparison(rows: list[dict[str, Any]], path: Path) -> Path:
    """Write a PNG with two bar panels: engine busy ratio (and GPU util when measured), P95 latency.

    Args:
        rows: scenario rows from :func:`switchyard.bench.compare.summarize`.
        path: the PNG to write.

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
        ax_util.legend()
    else:
        ax_util.bar(list(x), busy, color="tab:blue")
    ax_util.set_title("Utilisation per scenario")
    ax_util.set_ylabel("%")
    ax_util.set_ylim(0, 100)
    ax_p95.bar(list(x), p95, color="tab:orange")
    ax_p95.set_title("P95 latency per scenario")
    ax_p95.set_ylabel("ms")
    for ax in (ax_util, ax_p95):
        ax.set_xticks(list(x), keys)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
